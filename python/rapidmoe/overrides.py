"""Tensor buffer-type overrides (llama.cpp's `-ot PATTERN=BUFT` and `--n-cpu-moe N`) as llama_model_params wants them.

Patterns and buffer-type names follow llama.cpp's common/arg.cpp exactly, so flags copied from llama-server
work here. Building the NULL-terminated C array is here too; choosing a placement is not (see the planner).
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

from ._runtime import _core
from .errors import RapidMoEError
from .moe_tensors import LLAMA_FFN_EXPS_REGEX


class TensorBuftOverride(ctypes.Structure):
    """llama.h `struct llama_model_tensor_buft_override` (llama-cpp-python does not mirror it)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def n_cpu_moe_patterns(n: int) -> list[str]:
    """Patterns that keep the routed experts of the first n layers on the CPU (llama.cpp's --n-cpu-moe)."""
    if n < 0:
        raise RapidMoEError(f"n_cpu_moe must be >= 0, got {n}")
    return [rf"blk\.{i}{LLAMA_FFN_EXPS_REGEX}" for i in range(n)]  # llama.cpp's llm_ffn_block_regex()


def parse_override_tensor(spec: str | Sequence[str] | None) -> list[tuple[str, str]]:
    """'pat=BUFT,pat2=BUFT2' (or a list of such strings) -> [(pattern, buffer type name)]."""
    if spec is None:
        return []
    items = [spec] if isinstance(spec, str) else list(spec)
    out: list[tuple[str, str]] = []
    for item in items:
        for part in item.split(","):
            if not part:
                continue
            pattern, sep, buft = part.partition("=")
            if not sep or not pattern or not buft:
                raise RapidMoEError(f"invalid tensor override {part!r}: expected <tensor name pattern>=<buffer type>")
            out.append((pattern, buft))
    return out


@dataclass
class BufferOverrides:
    """A NULL-terminated llama_model_tensor_buft_override array; keeps its strings alive while it lives."""

    pairs: list[tuple[str, str]]  # (tensor name regex, buffer type name), first match wins as in llama.cpp
    _array: ctypes.Array[TensorBuftOverride] | None = None
    _strings: list[bytes] | None = None

    def __post_init__(self) -> None:
        available = dict(_core.buffer_types())
        for _, name in self.pairs:
            if name not in available:
                raise RapidMoEError(
                    f"unknown buffer type {name!r}; available: {', '.join(sorted(available))}")
        self._strings = [p.encode() for p, _ in self.pairs]
        arr = (TensorBuftOverride * (len(self.pairs) + 1))()
        for i, ((_, name), pat) in enumerate(zip(self.pairs, self._strings, strict=True)):
            arr[i].pattern = pat
            arr[i].buft = available[name]
        self._array = arr  # the last element stays zeroed: the terminator

    @property
    def address(self) -> int:
        assert self._array is not None
        return ctypes.addressof(self._array)


def build_overrides(n_cpu_moe: int = 0, override_tensor: str | Sequence[str] | None = None) -> BufferOverrides | None:
    """The override array for these knobs, or None when there is nothing to override (stock placement)."""
    pairs = parse_override_tensor(override_tensor) + [(p, "CPU") for p in n_cpu_moe_patterns(n_cpu_moe)]
    return BufferOverrides(pairs) if pairs else None
