"""The `rapidmoe-cli` entry point: one typer app composed from one module per command.

Known problems (RapidMoEError) print as one line and exit 1; `--debug` (or RAPIDMOE_DEBUG=1) shows tracebacks.
"""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from ..errors import RapidMoEError
from . import calibrate, convert, inspect, make_model, plan, rpc_server, run, serve

F = TypeVar("F", bound=Callable[..., Any])


def one_line_errors(command: F) -> F:
    """Turn a RapidMoEError into one line on stderr and exit status 1 (the traceback only with --debug)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except RapidMoEError as e:
            if os.environ.get("RAPIDMOE_DEBUG") == "1":
                raise
            typer.echo(f"rapidmoe-cli: error: {e}", err=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


app = typer.Typer(
    name="rapidmoe-cli",
    help="RapidMoE: fast Mixture-of-Experts inference on llama.cpp.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("run")(one_line_errors(run.run))
app.command("make-model")(one_line_errors(make_model.make_model))
app.command("convert")(one_line_errors(convert.convert))
app.command("inspect")(one_line_errors(inspect.inspect))
app.command("calibrate-latency")(one_line_errors(calibrate.calibrate_latency))
app.command("calibrate")(one_line_errors(calibrate.calibrate))
app.command("serve")(one_line_errors(serve.serve))
app.command("plan")(one_line_errors(plan.plan))
app.command("rpc-server")(one_line_errors(rpc_server.rpc_server))


@app.callback()
def _global(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks and debug logging."),
) -> None:
    if debug:
        os.environ["RAPIDMOE_DEBUG"] = "1"
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


def main() -> None:
    # names the program in the line a llama.cpp abort prints (src/rapidmoe_ggml/pymodule/abort_message.h)
    os.environ.setdefault("RAPIDMOE_PROG", "rapidmoe-cli")
    app()
