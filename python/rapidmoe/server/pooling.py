"""Embeddings on the engine side: llama.cpp's pooling types by name, reading a decoded batch's embeddings, and
llama-server's normalisation (`common_embd_normalize`).

Numbers only: request fields and response shapes are server/embeddings.py's.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from .._runtime import llama_cpp as lc

# llama.cpp's `enum llama_pooling_type`, by the names of llama-server's --pooling
POOLING: dict[str, int] = {"none": lc.LLAMA_POOLING_TYPE_NONE, "mean": lc.LLAMA_POOLING_TYPE_MEAN,
                           "cls": lc.LLAMA_POOLING_TYPE_CLS, "last": lc.LLAMA_POOLING_TYPE_LAST,
                           "rank": lc.LLAMA_POOLING_TYPE_RANK}
POOLING_NAMES: dict[int, str] = {v: k for k, v in POOLING.items()}


def pooling_type(name: str | None) -> int:
    """The context parameter for --pooling NAME; None: unspecified (the model's own). The type is fixed when the
    context is made; its embeddings output is switched per batch (llama_set_embeddings), as llama-server does."""
    return POOLING[name] if name is not None else int(lc.LLAMA_POOLING_TYPE_UNSPECIFIED)


def can_split(pooling: int) -> bool:
    """Whether a prompt's embedding may be computed over several batches (llama-server's `can_split` for a
    causal model with a KV cache): only when it pools the last token; mean, cls and per-token (none) embeddings
    need the whole prompt in one ubatch."""
    return pooling in (lc.LLAMA_POOLING_TYPE_LAST, lc.LLAMA_POOLING_TYPE_RANK)


def normalize(v: np.ndarray, p: int) -> np.ndarray:
    """`common_embd_normalize`: -1 none, 0 max absolute scaled to int16's range, 2 euclidean, p > 0 the p-norm
    (1 taxicab); sums in float64, the result float32; a zero vector stays zero."""
    x = np.asarray(v, dtype=np.float64)
    if p == -1:
        norm = 1.0
    elif p == 0:
        norm = float(np.abs(x).max(initial=0.0)) / 32760.0
    elif p == 2:
        norm = float(np.sqrt(np.dot(x, x)))
    else:
        norm = float(np.sum(np.abs(x) ** p)) ** (1.0 / p)
    scale = 1.0 / norm if norm > 0.0 else 0.0
    return (x * scale).astype(np.float32)


def _row(ptr: Any, n_embd: int) -> np.ndarray | None:
    if not ptr:
        return None
    row: np.ndarray = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_embd,))
    out: np.ndarray = row.copy()
    return out


def read(ctx: Any, pooling: int, seq_id: int, rows: list[int], n_embd: int) -> np.ndarray:
    """A sequence's embeddings after the decode that ended its prompt, float32: one pooled vector [1, n_embd]
    (llama_get_embeddings_seq), or with pooling none one per token [len(rows), n_embd] (llama_get_embeddings_ith
    of its batch rows). A vector llama.cpp does not have is zeros, as llama-server answers it."""
    if pooling == lc.LLAMA_POOLING_TYPE_NONE:
        got = [_row(lc.llama_get_embeddings_ith(ctx, i), n_embd) for i in rows]
    else:
        got = [_row(lc.llama_get_embeddings_seq(ctx, seq_id), n_embd)]
    return np.stack([g if g is not None else np.zeros(n_embd, np.float32) for g in got])
