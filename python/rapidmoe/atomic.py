"""Writing output files so that each is either complete or absent: temporary names, renamed when all are complete,
removed on an error and on any signal that ends the process and can be handled (SIGTERM, SIGHUP, ...).

What the files hold is the caller's; this module names, renames and removes them, and words a failed write (a full
disk, a file size limit, a read-only folder) as one RapidMoEError.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from .errors import RapidMoEError

# Signals left alone: those that cannot be caught, SIGINT (Python raises KeyboardInterrupt, which unwinds through
# the `finally` that removes the temporaries), the faults a Python handler never runs for (the process ends inside
# the C code that raised them: SIGSEGV, SIGBUS, SIGABRT of an assert, SIGFPE, SIGILL) and those whose default is
# not to end the process. Every other signal whose handler is the default, which ends the process, gets ours while
# temporaries exist: it removes them, then ends the process by the same signal.
_LEFT_ALONE = ("SIGKILL", "SIGSTOP", "SIGINT", "SIGSEGV", "SIGBUS", "SIGABRT", "SIGFPE", "SIGILL", "SIGCHLD",
               "SIGCONT", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGURG", "SIGWINCH")

_lock = threading.Lock()
_pending: list[Path] = []  # temporaries being written now, by every `outputs` open in this process
_replaced: dict[int, Any] = {}  # signal -> the handler ours replaced (always the default)


class OutputError(RapidMoEError):
    """An output could not be written (nothing of it is left)."""


def _ending_signals() -> list[int]:
    skip = {getattr(signal, name) for name in _LEFT_ALONE if hasattr(signal, name)}
    return [int(s) for s in signal.valid_signals() if s not in skip]


def _on_signal(signum: int, frame: FrameType | None) -> None:
    del frame
    for tmp in list(_pending):
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    _restore_handlers()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # ends the process as the signal would have, its exit status included


def _install_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers; a signal then ends the process as it would have
    for s in _ending_signals():
        try:
            if signal.getsignal(s) == signal.SIG_DFL:
                signal.signal(s, _on_signal)
                _replaced[s] = signal.SIG_DFL
        except (OSError, ValueError, RuntimeError):
            continue  # a signal the platform reserves


def _restore_handlers() -> None:
    for s, previous in list(_replaced.items()):
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            if signal.getsignal(s) is _on_signal:
                signal.signal(s, previous)
        del _replaced[s]


@contextlib.contextmanager
def _held_signals() -> Iterator[None]:
    """Signals held back (delivered after the block): the renames of a set of outputs happen all or none."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    held = set(_replaced) | {int(signal.SIGINT)}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _named(e: OSError) -> Path | None:
    return Path(e.filename) if isinstance(e.filename, (str, os.PathLike)) else None


def _failed(e: OSError, finals: Sequence[Path], tmps: Sequence[Path]) -> OutputError:
    """The write error as one line naming the output (the one it names, else all of them)."""
    named = _named(e)
    by_tmp = dict(zip(tmps, finals, strict=True))
    which = str(by_tmp.get(named, named)) if named is not None else ", ".join(str(p) for p in finals)
    why = e.strerror if e.errno is not None else f"the write was cut short ({e})"  # numpy's short write: no errno
    return OutputError(f"cannot write {which}: {why}; nothing was kept")


@contextlib.contextmanager
def outputs(paths: Sequence[str | os.PathLike[str]]) -> Iterator[list[Path]]:
    """Temporary names (PATH.tmp) for `paths`; when the body completes, each replaces its path (signals held
    meanwhile, so that one does not end the process between two renames); on an exception or a signal that ends
    the process they are removed. An OSError of the body or the renames that names no file but these (a full disk,
    a file size limit, a folder that cannot be written) becomes an OutputError saying which outputs and why."""
    finals = [Path(p) for p in paths]
    tmps = [p.with_name(p.name + ".tmp") for p in finals]
    with _lock:
        if not _pending:
            _install_handlers()
        _pending.extend(tmps)
    try:
        try:
            yield tmps
            with _held_signals():
                for tmp, final in zip(tmps, finals, strict=True):
                    os.replace(tmp, final)
        except OSError as e:
            named = _named(e)
            if named is None or named in (*tmps, *finals):
                raise _failed(e, finals, tmps) from e
            raise
    finally:
        for tmp in tmps:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        with _lock:
            for tmp in tmps:
                _pending.remove(tmp)
            if not _pending:
                _restore_handlers()


def replace_all(pairs: Sequence[tuple[Path, Path]]) -> None:
    """Rename each (source, destination) pair, signals held meanwhile: all of them happen or, on an error, the ones
    before it (an OSError naming the file)."""
    with _held_signals():
        for a, b in pairs:
            os.replace(a, b)


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` to `path` through a temporary name (complete or absent)."""
    path = Path(path)
    with outputs([path]) as (tmp,):
        tmp.write_text(text)
    return path


def make_dir(path: str | os.PathLike[str]) -> Path:
    """`path` as a folder for outputs (made with its parents where missing); OutputError if it cannot be."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OutputError(f"output {p} exists and is not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot make the output folder {p}: {e.strerror or e}") from e
    return p
