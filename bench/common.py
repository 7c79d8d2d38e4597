"""Shared by the benchmarks: KL divergence and top-1 agreement between two models' logits."""
from __future__ import annotations

import numpy as np


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_stats(ref: np.ndarray, var: np.ndarray) -> dict[str, float]:
    """KL(P_ref || P_var) per position (mean and 99th percentile) and how often the top-1 token agrees;
    ref and var are logits [n_positions, n_vocab] (what llama-perplexity --kl-divergence reports)."""
    lp, lq = log_softmax(ref), log_softmax(var)
    k = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return {"kl_mean": float(k.mean()), "kl_p99": float(np.quantile(k, 0.99)),
            "top1_same": float((ref.argmax(-1) == var.argmax(-1)).mean())}
