"""Child processes that end with this process: every process the package starts goes through `spawn`.

On Linux each child gets PR_SET_PDEATHSIG(SIGTERM) between fork and exec, so it ends when this process ends, however
it ends: a normal exit (`stop()` forgotten), SIGKILL, a crash. The signal comes only once the process is gone, after
the interpreter's own shutdown, so objects that still use a child at exit (a Llama on an RPCServer's device frees
its buffers there) find it alive; an atexit handler that stopped children first made such a script hang at exit.
The kernel sends that signal when the *thread* that forked the child ends, not the process, so every child is
forked from one daemon thread that lives as long as the process (a child started from a short-lived worker thread
would otherwise die with that thread).

Limits: elsewhere than Linux an atexit handler stops the children still running at a normal exit instead (close
what uses them first), and a killed interpreter leaks them; the signal reaches only the direct child (a child that
forks its own children must guard them); a set-user-ID binary drops it. Servers started by hand
(`rapidmoe-cli rpc-server`, `serve`) are not children of the package and are not guarded.
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from queue import SimpleQueue
from typing import Any

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
DEATH_SIGNAL = signal.SIGTERM  # what a child gets when this process dies (rpc-server installs no handler for it)

_live: set[subprocess.Popen[bytes]] = set()  # started by spawn and not yet stopped
_lock = threading.Lock()


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved here: the child between fork and exec must not load libraries."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # a libc without prctl (musl has it; this is for exotic builds)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


_prctl = _load_prctl()


def _death_guard(parent: int) -> Callable[[], None]:
    """The child's preexec_fn: die with SIGTERM when the forking thread ends, or now if the parent is gone already
    (it died between fork and prctl: the child was reparented and the signal will never come)."""
    prctl = _prctl
    assert prctl is not None

    def guard() -> None:
        if prctl(_PR_SET_PDEATHSIG, DEATH_SIGNAL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:
            os.kill(os.getpid(), DEATH_SIGNAL)

    return guard


class _Spawner:
    """One daemon thread that runs every fork: it lives until the process ends, so PDEATHSIG means 'process died'."""

    def __init__(self) -> None:
        self._jobs: SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]] = SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="rapidmoe-spawner", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            fn, box, done = self._jobs.get()
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller's thread, raised there
                box.append((False, e))
            done.set()

    def call(self, fn: Callable[[], Any]) -> Any:
        if threading.current_thread() is self.thread:
            return fn()
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value


_spawner: _Spawner | None = None


def _get_spawner() -> _Spawner:
    global _spawner
    with _lock:
        if _spawner is None:
            _spawner = _Spawner()
        return _spawner


def spawn(args: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[bytes]:
    """subprocess.Popen(args, **popen_kwargs) for a child that must not outlive this process (see the module
    docstring); end it with `stop`. preexec_fn is taken by the guard."""
    if "preexec_fn" in popen_kwargs:
        raise TypeError("spawn() sets preexec_fn itself")
    if _prctl is None:
        proc: subprocess.Popen[bytes] = subprocess.Popen(list(args), **popen_kwargs)
    else:
        guard = _death_guard(os.getpid())
        proc = _get_spawner().call(lambda: subprocess.Popen(list(args), preexec_fn=guard, **popen_kwargs))
    with _lock:
        _live.add(proc)
    return proc


def stop(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `timeout` seconds; waits for the child, so no zombie is left."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("child %d ignored SIGTERM for %.0f s: killing it", proc.pid, timeout)
            proc.kill()
            proc.wait()
    with _lock:
        _live.discard(proc)


def live_children() -> list[subprocess.Popen[bytes]]:
    """The children spawn started that are still running (for tests and diagnostics)."""
    with _lock:
        return [p for p in _live if p.poll() is None]


def _stop_all() -> None:
    """At exit where there is no parent-death signal (see the module docstring)."""
    with _lock:
        procs = list(_live)
    for p in procs:
        if p.poll() is None:
            log.debug("stopping child %d at exit (stop() was not called)", p.pid)
        stop(p, timeout=2.0)


def _after_fork_in_child() -> None:
    """A forked copy of this process owns none of these children, and has no spawner thread."""
    global _spawner, _lock
    _spawner = None
    _lock = threading.Lock()
    _live.clear()


if _prctl is None:
    atexit.register(_stop_all)

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
