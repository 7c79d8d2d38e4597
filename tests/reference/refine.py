"""Independent numpy decoding of the refine codec ("q3k-refine1"): Q3_K's base values from ggml's own dequantization,
the sub-block scales decoded here from the block bytes, the refinement s_j/4 * (2t - 1) added; and the activation as
ggml's reference quantize_row_q8_K leaves it."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from rapidmoe import _core

Q3_K = int(GGMLQuantizationType.Q3_K)
BLOCK = 110


def q3k_scales(raw: np.ndarray) -> np.ndarray:
    """s_j = d * (sc_j - 32) of each 16-weight sub-block: uint8 [..., n_blocks * 110] -> float64 [..., n_blocks, 16]."""
    blocks = raw.reshape(*raw.shape[:-1], -1, BLOCK)
    sc = blocks[..., 96:108].astype(np.int32)
    d = blocks[..., 108:110].copy().view(np.float16)[..., 0].astype(np.float64)
    j = np.arange(16)
    low = np.where(j < 8, sc[..., j % 8] & 0xF, sc[..., j % 8] >> 4)
    high = (sc[..., 8 + j % 4] >> (2 * (j // 4))) & 3
    return d[..., None] * ((low | (high << 4)) - 32)


def refined(raw: np.ndarray, bits: np.ndarray, n_in: int) -> np.ndarray:
    """The refined weights [..., n_in]: ggml's Q3_K dequantization + s_j/4 * (2t - 1)."""
    base = _core.dequantize(raw.reshape(-1, raw.shape[-1]), Q3_K, n_in).reshape(*raw.shape[:-1], n_in)
    t = np.unpackbits(bits, axis=-1, bitorder="little").astype(np.float64)
    s = np.repeat(q3k_scales(raw), 16, axis=-1).reshape(*raw.shape[:-1], n_in)
    return base.astype(np.float64) + s / 4 * (2 * t - 1)


def q8k_roundtrip(x: np.ndarray) -> np.ndarray:
    """x as ggml's reference quantize_row_q8_K leaves it (per 256: d = max / -127 of the signed largest |x|)."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 256)
    idx = np.abs(blocks).argmax(axis=-1)
    mx = np.take_along_axis(blocks, idx[..., None], axis=-1)
    with np.errstate(divide="ignore"):
        iscale = np.where(mx == 0, np.float32(0), np.float32(-127.0) / mx).astype(np.float32)
    q = np.minimum(np.rint(iscale * blocks), 127)
    d = np.where(iscale == 0, np.float32(0), np.float32(1) / iscale).astype(np.float32)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)
