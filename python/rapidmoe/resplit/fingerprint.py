"""Sampled fingerprints of a GGUF's tensor data: a short hash per tensor of fixed, spread-out windows of its bytes,
read in about a thousand small reads (plus two per tensor) whatever the file's size. Used to bind a sidecar to
its base's content.

Only the sampling plan and the hashing live here; which files record and check what is resplit/sidecar.py's.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..ggufio import GGUFFile

DIGEST_CHARS = 16  # hex digits kept per tensor (64 bits)


@dataclass(frozen=True)
class SampleScheme:
    """Which bytes of a tensor are hashed. Files whose tensor data fit in `budget` bytes are hashed whole; else
    each tensor gets windows of `window` bytes in proportion to its size (at least `min_windows`: its first and
    last bytes among them), evenly spread from its start to its end, about budget / window windows in all."""

    window: int = 4096  # bytes per window (one page: a cold read costs the same for fewer bytes)
    budget: int = 4 << 20  # bytes of tensor data read in all, plus min_windows per tensor beyond that
    min_windows: int = 2

    def __post_init__(self) -> None:
        if self.window < 1 or self.budget < 0 or self.min_windows < 2:
            raise ValueError(f"bad sample scheme {self}")

    def windows(self, sizes: Sequence[int]) -> list[list[tuple[int, int]]]:
        """Per tensor of these byte sizes: its windows, (offset in the tensor, length), in increasing order."""
        total = sum(sizes)
        if total <= self.budget:
            return [[(0, n)] if n else [] for n in sizes]
        per_byte = self.budget // self.window / total
        return [self._spread(n, max(self.min_windows, int(n * per_byte))) for n in sizes]

    def _spread(self, n: int, k: int) -> list[tuple[int, int]]:
        if n <= k * self.window:
            return [(0, n)] if n else []
        last = n - self.window
        return [(j * last // (k - 1), self.window) for j in range(k)]


DEFAULT_SCHEME = SampleScheme()


def absolute_windows(f: GGUFFile, scheme: SampleScheme) -> list[list[tuple[int, int]]]:
    """Per tensor of f, in file order: its windows as (absolute offset in the tensor's own file, length)."""
    plan = scheme.windows([int(t.n_bytes) for t in f.tensors])
    return [[(int(t.data_offset) + off, n) for off, n in ws] for t, ws in zip(f.tensors, plan, strict=True)]


def _read_windows(f: GGUFFile, windows: list[list[tuple[int, int]]]) -> Iterator[list[bytes]]:
    """Each tensor's windows, read from its own file (a split model's part)."""
    fds: dict[os.PathLike[str] | str, int] = {}
    try:
        for t, ws in zip(f.tensors, windows, strict=True):
            path = t._file.path
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
                if hasattr(os, "posix_fadvise"):  # scattered small reads: no readahead around each
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            chunks = [os.pread(fd, n, off) for off, n in ws]
            if any(len(c) != n for c, (_, n) in zip(chunks, ws, strict=True)):
                raise EOFError(f"{path} ends inside its tensor data")
            yield chunks
    finally:
        for fd in fds.values():
            os.close(fd)


def sample_digests(f: GGUFFile, scheme: SampleScheme = DEFAULT_SCHEME) -> list[str]:
    """One DIGEST_CHARS-hex sha256 prefix per tensor of f (file order) over its sampled windows."""
    out = []
    for chunks in _read_windows(f, absolute_windows(f, scheme)):
        h = hashlib.sha256()
        for c in chunks:
            h.update(c)
        out.append(h.hexdigest()[:DIGEST_CHARS])
    return out
