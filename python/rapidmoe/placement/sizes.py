"""Bytes of a tensor in a ggml type, from the type's block size and bytes per block.

The table is gguf-py's GGML_QUANT_SIZES (the same numbers as ggml's type traits; tests/test_placement.py checks
them against rapidmoe._core.type_info), so planning needs no build and works for models we cannot load.
"""
from __future__ import annotations

import math

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import RapidMoEError


def ggml_type(name: str) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType[name.upper()]
    except KeyError:
        raise RapidMoEError(f"unknown ggml type {name!r}") from None


def block_size(type_name: str) -> int:
    return GGML_QUANT_SIZES[ggml_type(type_name)][0]


def bits_per_weight(type_name: str) -> float:
    block, size = GGML_QUANT_SIZES[ggml_type(type_name)]
    return 8.0 * size / block


def fits_rows(type_name: str, row_length: int) -> bool:
    """Whether rows of this length are a whole number of the type's blocks."""
    return row_length % block_size(type_name) == 0


def tensor_bytes(type_name: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` (ggml order, ne[0] = row length first) stored as `type_name`."""
    block, size = GGML_QUANT_SIZES[ggml_type(type_name)]
    if shape[0] % block:
        raise RapidMoEError(f"rows of {shape[0]} values are not whole {type_name} blocks of {block}")
    return math.prod(shape) // block * size
