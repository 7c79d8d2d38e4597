"""ggml's type facts, the one definition conversion (resplit/) and planning (placement/) both use: block size,
bytes per block, bits per weight, whether a row length is a whole number of blocks, a tensor's bytes, and
llama-quantize's per-tensor fallback when a row is not.

The sizes are gguf-py's GGML_QUANT_SIZES (the same numbers as ggml's type traits; tests/placement/test_placement.py
checks them against rapidmoe._core.type_info), so this needs no build and works for models we cannot load.
"""
from __future__ import annotations

import math

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import RapidMoEError


class UnknownTypeError(RapidMoEError, ValueError):
    """A ggml type name that gguf-py does not know (a ValueError too, as argument checks expect)."""


def ggml_type(name: str) -> GGMLQuantizationType:
    """The ggml type of a name, any case ('q4_k' -> Q4_K)."""
    try:
        return GGMLQuantizationType[name.upper()]
    except KeyError:
        raise UnknownTypeError(f"unknown ggml type {name!r}") from None


def block_size(name: str) -> int:
    """Values per block."""
    return GGML_QUANT_SIZES[ggml_type(name)][0]


def block_bytes(name: str) -> int:
    """Bytes per block."""
    return GGML_QUANT_SIZES[ggml_type(name)][1]


def bits_per_weight(name: str) -> float:
    block, size = GGML_QUANT_SIZES[ggml_type(name)]
    return 8.0 * size / block


def fits_rows(name: str, row_length: int) -> bool:
    """Whether rows of this length are a whole number of the type's blocks."""
    return row_length % block_size(name) == 0


def tensor_bytes(name: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` (ggml order, ne[0] = row length first) stored as `name`."""
    block, size = GGML_QUANT_SIZES[ggml_type(name)]
    if shape[0] % block:
        raise RapidMoEError(f"rows of {shape[0]} values are not whole {name} blocks of {block}")
    return math.prod(shape) // block * size


# llama-quantize's fallback for a row length the asked type's block does not divide (tensor_type_fallback in the
# pinned vendor/llama.cpp/src/llama-quant.cpp): a 256-block type becomes a 32-block one. A type not listed (a
# 32-block type) keeps itself; where the result does not fit either, the tensor is F16.
FALLBACK = {"IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL",
            "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q2_K": "Q4_0", "Q3_K": "Q4_0",
            "TQ1_0": "Q4_0", "TQ2_0": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def fit_type(name: str, row_length: int) -> str:
    """The type a tensor with rows of `row_length` values gets when `name` is asked for, as llama-quantize decides:
    `name` itself where its block divides the row, else its fallback (a 32-block type), else F16."""
    name = name.upper()
    if fits_rows(name, row_length):
        return name
    fb = FALLBACK.get(name, name)
    return fb if fits_rows(fb, row_length) else "F16"
