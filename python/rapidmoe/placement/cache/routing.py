"""Routing for shapes we cannot run: a real trace's per-layer statistics (expert popularity, token-to-token reuse,
next-layer prediction accuracy) and synthetic routing for a larger shape drawn from them."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from .config import CachePolicyError


@dataclass(frozen=True)
class RoutingStats:
    """Per MoE layer of a real trace: expert popularity, token-to-token reuse, next-layer prediction accuracy."""

    popularity: np.ndarray  # [n_moe, n_expert] shares
    reuse: NDArray[np.float64]  # [n_moe] mean share of a token's experts the previous token also used
    accuracy: np.ndarray  # [n_moe] share of a layer's experts the predictor named (nan without predictions)
    chance: NDArray[np.float64]  # [n_moe] the reuse independent draws by popularity would give
    k: int = 1

    @property
    def excess_reuse(self) -> NDArray[np.float64]:
        """Reuse beyond chance, (reuse - chance) / (1 - chance), >= 0: the locality that carries over to a shape
        with more experts (where chance reuse is much smaller)."""
        return np.clip((self.reuse - self.chance) / np.maximum(1e-12, 1.0 - self.chance), 0.0, 1.0)


def chance_reuse(popularity: np.ndarray, k: int) -> float:
    """Expected share of a token's experts found among the previous token's, both drawn independently: sum over
    experts of p_e x P(e among k draws) ~ sum p_e min(1, k p_e)."""
    p = np.asarray(popularity, dtype=np.float64)
    return float(np.sum(p * np.minimum(1.0, k * p)))


def routing_stats(ids: np.ndarray, n_expert: int, pred: np.ndarray | None = None) -> RoutingStats:
    _, n_moe, k = ids.shape
    pop = np.zeros((n_moe, n_expert))
    reuse = np.zeros(n_moe)
    chance = np.zeros(n_moe)
    acc = np.full(n_moe, np.nan)
    for m in range(n_moe):
        col = ids[:, m, :]
        ok = (col >= 0).all(axis=1)
        c = col[ok]
        pop[m] = np.bincount(c.reshape(-1), minlength=n_expert)[:n_expert]
        pop[m] /= max(1.0, pop[m].sum())
        chance[m] = chance_reuse(pop[m], k)
        if len(c) > 1:
            same = [(np.isin(c[i], c[i - 1])).mean() for i in range(1, len(c))]
            reuse[m] = float(np.mean(same))
        if pred is not None and m > 0:
            p = pred[:, m, :][ok]
            if len(p):
                acc[m] = float(np.mean([np.isin(c[i], p[i]).mean() for i in range(len(c))]))
    return RoutingStats(pop, reuse, acc, chance, k)


def scale_routing(stats: RoutingStats, *, n_tokens: int, n_moe: int, n_expert: int, k: int,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Routing [n_tokens, n_moe, k] (and predictions) for a larger shape from a real trace's per-layer statistics:
    big layer L takes small layer L x n_small // n_moe; small expert e becomes n_expert / n_small big experts that
    share its popularity equally; each token reuses a Binomial(k, excess reuse) number of the previous token's
    experts (the small model's reuse beyond chance) and draws the rest by popularity, without repeats; the
    predictor names each chosen expert with the small layer's measured accuracy (0.5 where none was measured) and
    fills the rest by popularity. A projection of
    the small model's skew and locality onto the big shape, not the big model's routing."""
    small_moe, small_e = stats.popularity.shape
    if n_expert % small_e:
        raise CachePolicyError(f"cannot map {small_e} experts onto {n_expert} (not a multiple)")
    g = n_expert // small_e
    rng = np.random.default_rng(seed)
    ids = np.empty((n_tokens, n_moe, k), dtype=np.int64)
    pred = np.empty_like(ids)
    for lm in range(n_moe):
        sm = lm * small_moe // n_moe
        p = np.repeat(stats.popularity[sm] / g, g)
        p = p / p.sum()
        rho = float(stats.excess_reuse[sm])
        a = float(stats.accuracy[sm]) if np.isfinite(stats.accuracy[sm]) else 0.5
        prev: np.ndarray | None = None
        for t in range(n_tokens):
            chosen: list[int] = []
            if prev is not None:
                n_re = min(k, int(rng.binomial(k, rho)))
                chosen = list(rng.choice(prev, size=n_re, replace=False)) if n_re else []
            chosen += _draw(rng, p, k - len(chosen), chosen)
            row = np.array(chosen, dtype=np.int64)
            ids[t, lm] = row
            keep = [int(e) for e in row if rng.random() < a]
            pred[t, lm] = np.array(keep + _draw(rng, p, k - len(keep), keep), dtype=np.int64)
            prev = row
    return ids, pred


def _draw(rng: np.random.Generator, p: np.ndarray, n: int, exclude: Sequence[int]) -> list[int]:
    if n <= 0:
        return []
    q = p.copy()
    q[list(exclude)] = 0.0
    q /= q.sum()
    return [int(x) for x in rng.choice(q.size, size=n, replace=False, p=q)]
