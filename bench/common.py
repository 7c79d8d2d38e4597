"""Shared by the benchmarks: KL divergence and top-1 agreement between two models' logits, synthetic models."""
from __future__ import annotations

from pathlib import Path

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


def ensure_synthetic(path: Path, arch: str, size: str, **overrides: object) -> Path:
    """The synthetic model at `path`, written first (with a progress bar) if it is not there yet."""
    from rapidmoe.paths import vocab_dir
    from rapidmoe.synthetic import spec_for, write_model

    if not path.exists():
        write_model(spec_for(arch, size, **overrides), path, vocab_dir(), progress=True)
    return path
