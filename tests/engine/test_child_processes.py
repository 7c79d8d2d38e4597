"""The processes the package starts end with it: an RPCServer whose stop() is never called is gone after a normal
exit and after the interpreter is killed (Linux: PR_SET_PDEATHSIG), also when the thread that started it has ended
long before (the guard forks from one thread that lives as long as the process), and a Llama still on its device at
exit finds it alive while the interpreter shuts down (the exit neither hangs nor aborts)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rapidmoe import _children
from rapidmoe.rpc import RPCServer

pytestmark = [pytest.mark.native,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death guard is Linux's")]

# a Python that starts an RPCServer (from the main thread, or from a thread that ends at once), prints the server's
# pid and endpoint, and then waits to be killed, or exits without stop() once told to (a line on stdin)
CHILD = """
import sys, threading, time
from rapidmoe.rpc import RPCServer
how, then = sys.argv[1:3]
model = sys.argv[3] if len(sys.argv) > 3 else None
box = []
if how == "thread":
    t = threading.Thread(target=lambda: box.append(RPCServer()))
    t.start()
    t.join()
    time.sleep(0.5)  # the forking thread is gone: the server must still run
    assert box[0].proc.poll() is None, "the server died with the thread that started it"
else:
    box.append(RPCServer())
if model is not None:  # a Llama on the server's device, never closed: freed during the interpreter's shutdown
    from rapidmoe import Llama
    llm = Llama(model, rpc_servers=[box[0].endpoint], n_gpu_layers=99, n_ctx=64, verbose=False)
    llm.create_completion("hi", max_tokens=2)
print(box[0].proc.pid, box[0].endpoint, flush=True)
if then == "wait":
    time.sleep(600)
sys.stdin.readline()
"""


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), or None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]


def _listening(endpoint: str) -> bool:
    host, port = endpoint.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        return True
    except OSError:
        return False


def _gone_within(pid: int, born: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _start_time(pid) != born:  # exited (a reused pid has another start time)
            return True
        time.sleep(0.05)
    return False


def _run_child(how: str, then: str, *extra: str) -> tuple[subprocess.Popen[str], int, str, str]:
    py = subprocess.Popen([sys.executable, "-c", CHILD, how, then, *extra], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert py.stdout is not None
    line = py.stdout.readline()
    if not line:
        py.wait(timeout=30)
        raise AssertionError(f"the child Python failed: {py.stderr.read() if py.stderr else ''}")
    pid_s, endpoint = line.split()
    pid = int(pid_s)
    born = _start_time(pid)
    assert born is not None and _listening(endpoint)
    return py, pid, born, endpoint


def _cleanup(py: subprocess.Popen[str], pid: int, born: str) -> None:
    """Whatever the test found, leave nothing behind."""
    if py.poll() is None:
        py.kill()
    py.wait(timeout=30)
    for f in (py.stdin, py.stdout, py.stderr):
        if f is not None:
            f.close()
    if _start_time(pid) == born:
        os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(("how", "sig"), [("main", signal.SIGKILL), ("thread", signal.SIGKILL),
                                          ("main", signal.SIGTERM)])
def test_a_killed_interpreter_takes_its_rpc_server_along(how: str, sig: signal.Signals) -> None:
    py, pid, born, endpoint = _run_child(how, "wait")
    try:
        py.send_signal(sig)  # no atexit, no finally: only the kernel can end the server now
        py.wait(timeout=10)
        assert _gone_within(pid, born, 5.0), f"rpc-server {pid} outlived the {sig.name}ed Python"
        assert not _listening(endpoint)
    finally:
        _cleanup(py, pid, born)


@pytest.mark.parametrize("how", ["main", "thread"])
def test_exit_without_stop_leaves_nothing(how: str) -> None:
    py, pid, born, endpoint = _run_child(how, "exit")
    try:
        assert py.stdin is not None
        py.stdin.write("exit\n")
        py.stdin.flush()
        assert py.wait(timeout=30) == 0, py.stderr.read() if py.stderr else ""
        assert _gone_within(pid, born, 0.5), f"rpc-server {pid} outlived its Python's normal exit"
        assert not _listening(endpoint)
    finally:
        _cleanup(py, pid, born)


def test_exit_with_a_llama_still_on_the_server(tiny_qwen: Path) -> None:
    py, pid, born, endpoint = _run_child("main", "exit", str(tiny_qwen))
    try:
        assert py.stdin is not None
        py.stdin.write("exit\n")
        py.stdin.flush()
        assert py.wait(timeout=60) == 0, py.stderr.read() if py.stderr else ""  # stopped at atexit: hung here
        assert _gone_within(pid, born, 5.0), f"rpc-server {pid} outlived its Python's normal exit"
        assert not _listening(endpoint)
    finally:
        _cleanup(py, pid, born)


def test_a_server_outlives_the_thread_that_started_it() -> None:
    box: list[RPCServer] = []
    t = threading.Thread(target=lambda: box.append(RPCServer()))
    t.start()
    t.join()
    srv = box[0]
    try:
        time.sleep(0.5)
        assert srv.proc is not None and srv.proc.poll() is None and _listening(srv.endpoint)
        assert srv.proc in _children.live_children()
    finally:
        proc = srv.proc
        srv.stop()
    assert proc is not None and proc.returncode == -signal.SIGTERM and proc not in _children.live_children()


def test_spawn_refuses_a_preexec_fn_of_its_own() -> None:
    with pytest.raises(TypeError, match="preexec_fn"):
        _children.spawn(["true"], preexec_fn=lambda: None)
