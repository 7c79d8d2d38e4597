"""Pareto frontier over (latency, KL) points, and the choice of one point: min KL under a budget, or the knee."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import RapidMoEError


def pareto(latency: Sequence[float], kl: Sequence[float]) -> list[int]:
    """Indices of the non-dominated points (no other point is at most as slow AND at most as far, one strictly),
    sorted by latency. Exact duplicates keep the first."""
    lat, k = np.asarray(latency, float), np.asarray(kl, float)
    if lat.shape != k.shape:
        raise ValueError("latency and kl must have the same length")
    order = sorted(range(len(lat)), key=lambda i: (lat[i], k[i], i))
    out: list[int] = []
    best = np.inf
    for i in order:
        if k[i] < best:
            out.append(i)
            best = k[i]
    return out


def knee(latency: Sequence[float], kl: Sequence[float], front: Sequence[int] | None = None) -> int:
    """The frontier point farthest below the chord from its fastest to its most accurate end, both axes scaled
    to [0, 1] (the point after which more latency buys the least KL). One or two points: the most accurate."""
    front = list(front) if front is not None else pareto(latency, kl)
    if not front:
        raise RapidMoEError("no points to choose from")
    if len(front) <= 2:
        return min(front, key=lambda i: (kl[i], latency[i]))
    x = np.array([latency[i] for i in front], float)
    y = np.array([kl[i] for i in front], float)
    xs = (x - x.min()) / max(x.max() - x.min(), 1e-12)
    ys = (y - y.min()) / max(y.max() - y.min(), 1e-12)
    # chord from (0, 1) (fastest, worst) to (1, 0) (slowest, best): distance below it is 1 - xs - ys
    return front[int(np.argmax(1.0 - xs - ys))]


def choose(latency: Sequence[float], kl: Sequence[float], budget: float | None,
           allowed: Sequence[int] | None = None) -> int:
    """Min KL among points whose latency is within the budget; the knee of the frontier without a budget."""
    idx = list(allowed) if allowed is not None else list(range(len(kl)))
    if budget is None:
        sub = pareto([latency[i] for i in idx], [kl[i] for i in idx])
        return knee(latency, kl, [idx[j] for j in sub])
    ok = [i for i in idx if latency[i] <= budget]
    if not ok:
        fastest = min(latency[i] for i in idx)
        raise RapidMoEError(f"no candidate meets the latency budget {budget:.2f} ms/token "
                            f"(the fastest is predicted at {fastest:.2f} ms/token)")
    return min(ok, key=lambda i: (kl[i], latency[i]))
