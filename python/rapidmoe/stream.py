"""Prefill streaming for layers with a per-expert WQ cache: the threshold, set in libllama.

A ubatch of at least `min_batch` tokens computes every WQ slot of a cached layer on the cache's device, from the
stacked host experts that ggml's scheduler copies there for the split (stock llama.cpp's op offload does the same
for CPU-resident experts and batches of 32+), instead of the misses on the CPU (hooks/rapidmoe-stream.h). Where
the threshold comes from: `rapidmoe.umia.device.stream_threshold` (the latency model). Nothing here decides it.
"""
from __future__ import annotations

import ctypes
from typing import Any

from ._runtime import llama_cpp
from .errors import RapidMoEError


def _fn() -> Any:
    fn = llama_cpp.llama_cpp._lib.rapidmoe_llama_set_stream_min_batch
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    fn.restype = ctypes.c_int32
    return fn


def check_min_batch(min_batch: int) -> int:
    """A threshold as Llama takes it: 0 (off) or a token count >= 1."""
    if isinstance(min_batch, bool) or not isinstance(min_batch, int) or min_batch < 0:
        raise RapidMoEError(f"prefill_stream must be 0 (off) or a number of tokens >= 1, got {min_batch!r}")
    return min_batch


def set_stream_min_batch(model: int, min_batch: int) -> int:
    """Set the loaded model's threshold (0: off); read when graphs are built. Returns the threshold in force."""
    return int(_fn()(ctypes.c_void_p(model), check_min_batch(min_batch)))
