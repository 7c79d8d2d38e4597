"""The least-squares fit the latency models share (latency.py's WQ/WR costs, device.py's stage terms)."""
from __future__ import annotations

import numpy as np


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (costs cannot be negative): the best unconstrained fit over each
    subset of the columns whose solution is non-negative. Exact, and cheap for the few columns these models have
    (2^n subsets: 16 for the latency model's 4)."""
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.sum(y * y))
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        sub, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if (sub < 0).any():
            continue
        coef = np.zeros(n)
        coef[cols] = sub
        err = float(np.sum((a @ coef - y) ** 2))
        if err < best_err - 1e-12:
            best, best_err = coef, err
    return best
