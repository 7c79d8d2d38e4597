"""`rapidmoe-cli rpc-server`: llama.cpp's rpc-server from this package's own build, so a remote host computes with
the same ggml (our patches, GGML_OP_MUL_MAT_ID_MASKED included) as the client that sends it the graph."""
from __future__ import annotations

import ipaddress
import logging
import os
from typing import Annotated, Optional

import typer

from ..errors import RapidMoEError

log = logging.getLogger(__name__)


def rpc_server(
    host: Annotated[str, typer.Option("--host", "-H", help="Address to bind to. The RPC protocol has no "
                                      "authentication: bind to a trusted network only.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", help="Port to listen on.", min=1, max=65535)] = 50052,
    threads: Annotated[Optional[int], typer.Option("--threads", "-t", help="Threads of the CPU device (default: "
                                                   "llama.cpp's, half the cores).", min=1)] = None,
    device: Annotated[Optional[str], typer.Option("--device", "-d", help="Comma-separated ggml devices to serve "
                                                  "(e.g. CUDA0,CUDA1; default: llama.cpp's choice).")] = None,
    cache: Annotated[bool, typer.Option("--cache", "-c", help="Keep received tensors in a local file cache "
                                        "(llama.cpp's $LLAMA_CACHE/rpc), so a reload skips the transfer.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the rpc-server command line and exit.")] = False,
) -> None:
    """Serve this machine's ggml devices to `rapidmoe-cli run/serve --rpc HOST:PORT` on another machine.

    Runs the package's own rpc-server (llama.cpp's tools/rpc, same pin and patches) in place of this process; its
    flags are llama.cpp's. One client at a time."""
    from ..rpc import server_command  # noqa: PLC0415  (lazy: keeps --help fast)

    cmd = server_command(host=host, port=port, threads=threads, devices=device, cache=cache)
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        log.warning("rpc-server on %s:%d: anyone who can reach this address can run graphs and read its memory; "
                    "use a trusted network only", host, port)
    if dry_run:
        typer.echo(" ".join(cmd))
        return
    try:
        os.execv(cmd[0], cmd)
    except OSError as e:
        raise RapidMoEError(f"cannot start {cmd[0]}: {e.strerror}") from None
