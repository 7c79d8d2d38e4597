"""A fork server for `rapidmoe-cli`: imports the package and its native parts once, then forks one child per input,
which runs the real `rapidmoe.cli.app.main()` with the input's arguments and ends as the CLI would (exit status,
traceback, signal), with normal interpreter shutdown. It saves the ~1 s of imports per input that a fresh process
costs; `harness.SubprocessRunner` runs the same arguments in a fresh process, for reproducing a finding.

Protocol (one JSON object per line): request {"argv", "cwd", "timeout", "stdout"} on stdin; reply {"rc",
"timed_out", "elapsed"} on the stdout the server started with. The children's stderr is the file named by
RAPIDMOE_FUZZ_STDERR, truncated before each child (opened before the import, so llama.cpp's abort hook, which keeps
a copy of fd 2 from the import on, writes there too). A reader target: argv ["--reader", KIND, PATH] calls that
Python reader instead of the CLI (readers.py).
"""
from __future__ import annotations

import atexit
import json
import os
import resource
import signal
import sys
import time
import traceback


def _serve() -> list[str]:
    """Serve requests until stdin closes (then exit); returns only in a child, with the argv it must run."""
    proto_in = sys.stdin.buffer
    proto_out = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    err_path = os.environ["RAPIDMOE_FUZZ_STDERR"]
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
    os.dup2(err, 2)
    # the native parts and everything a command imports lazily, loaded once
    import rapidmoe._runtime  # noqa: PLC0415
    import rapidmoe.cli.app  # noqa: PLC0415
    import rapidmoe.llama  # noqa: PLC0415
    import rapidmoe.server.app  # noqa: F401, PLC0415

    from . import readers  # noqa: F401, PLC0415

    mem_limit = int(os.environ.get("RAPIDMOE_FUZZ_MEM_MB", "0"))
    for line in proto_in:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        os.ftruncate(2, 0)
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.dup2(devnull, 0)
            for fd in (out, err, devnull):
                os.close(fd)
            proto_out.close()
            os.chdir(req["cwd"])
            if mem_limit:
                lim = mem_limit << 20
                resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
            return list(req["argv"])
        timed_out = False
        deadline = t0 + float(req["timeout"])
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.005)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        proto_out.write(json.dumps({"rc": rc, "timed_out": timed_out, "elapsed": time.monotonic() - t0}) + "\n")
    sys.exit(0)


def _call(argv: list[str]) -> int:
    """Run the CLI (or a reader) as the interpreter would run it as a script: its exit status, a traceback
    printed for an exception that escapes it."""
    try:
        if argv[:1] == ["--reader"]:
            from .readers import run_reader  # noqa: PLC0415

            return run_reader(argv[1], argv[2])
        from rapidmoe.cli.app import main as cli_main  # noqa: PLC0415

        sys.argv = ["rapidmoe-cli", *argv]
        cli_main()
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - what the interpreter would print at the top level
        traceback.print_exc()
        return 1


def main() -> None:
    argv = _serve()
    code = _call(argv)
    # the interpreter's own shutdown takes ~0.3 s per child (most of a reader case): the atexit handlers run, the
    # C++ static destructors and module teardown do not (the subprocess runner, used for replays, has them)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
