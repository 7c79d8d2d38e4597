"""Byte quantities as users write them ("24GiB", "80 GB", "512M", "1.5T") and as the planner prints them.

Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB) powers of 1000; a bare
K/M/G/T is binary, as in llama.cpp's and most GPU tools' output. Nothing else belongs here.
"""
from __future__ import annotations

import re

from ..errors import RapidMoEError

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


class SizeError(RapidMoEError, ValueError):
    """A memory size that cannot be parsed or is negative."""


def parse_size(text: str) -> int:
    """'24GiB' -> 25769803776; '80GB' -> 80000000000; '0' -> 0. Raises SizeError with the accepted forms."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise SizeError(f"cannot read memory size {text!r}: use a number with an optional unit "
                        "(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB; K/M/G/T mean KiB/MiB/GiB/TiB), e.g. 24GiB")
    return round(float(m.group(1)) * _UNITS[unit])


def gib(n_bytes: float) -> float:
    return n_bytes / (1 << 30)


def gb(n_bytes: float) -> float:
    return n_bytes / 1e9


def format_size(n_bytes: float) -> str:
    """Human-readable, binary units: '133.2 GiB', '512.0 MiB', '0 B'."""
    if n_bytes == 0:
        return "0 B"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{int(n_bytes)} B"
