"""UMIA's arbitration in numpy: the same rule the graph op applies (rapidmoe-umia.cpp), vectorised over tokens.

Calibration uses it to predict the r distribution a policy gives from recorded routing weights without running
the model; the tests hold the C++ op to it.
"""
from __future__ import annotations

import numpy as np


def sort_weights(weights: np.ndarray) -> np.ndarray:
    """Top-k weights [..., k] sorted descending (stable: equal weights keep the router's slot order)."""
    order = np.argsort(-weights, axis=-1, kind="stable")
    return np.take_along_axis(weights, order, axis=-1)


def n_critical(weights: np.ndarray, tau: np.ndarray | float, r_min: int, r_max: int) -> np.ndarray:
    """r per token: the fewest highest-weight slots whose weight reaches tau of the token's total, clamped.

    weights: float32 [..., k] (any order); tau broadcasts against weights.shape[:-1]. Accumulation is in
    float64 in descending order, as in the op; a token whose weights do not sum to a positive finite mass gets k
    (then the clamp).
    """
    k = weights.shape[-1]
    w = sort_weights(np.asarray(weights, dtype=np.float32)).astype(np.float64)
    cum = np.cumsum(w, axis=-1)
    total = cum[..., -1]
    tau = np.minimum(np.asarray(tau, dtype=np.float32).astype(np.float64), 1.0)
    target = tau * total
    reached = cum >= target[..., None]
    r = np.where(reached.any(axis=-1), reached.argmax(axis=-1) + 1, k)
    r = np.where(~(np.isfinite(total) & (total > 0)), k, r)
    r = np.where(tau > 0, r, 0)
    lo = min(max(r_min, 0), k)
    hi = min(max(r_max, lo), k)
    return np.clip(r, lo, hi)


def critical_ids(weights: np.ndarray, selected: np.ndarray, r: np.ndarray) -> np.ndarray:
    """[..., k] expert ids of the r highest-weight slots of each token, -1 in the others."""
    order = np.argsort(-weights, axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(weights.shape[-1]), axis=-1)
    return np.where(rank < r[..., None], selected, -1).astype(np.int32)
