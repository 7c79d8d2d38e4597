"""Stand-in for the `filelock` package the suite's conftest.py imports, used only where it is not installed.

conftest serializes model downloads between pytest-xdist workers with FileLock; run.py runs one worker and
downloads nothing, so an flock on the file is all the lock has to do.
"""
from __future__ import annotations

import fcntl
import os
from types import TracebackType


class FileLock:
    """An exclusive flock on `path` while inside the `with` block."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> FileLock:
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = -1
