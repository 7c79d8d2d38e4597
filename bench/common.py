"""Shared by the benchmarks: KL divergence and top-1 agreement between two models' logits, synthetic models, plots."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from rapidmoe.paths import vocab_dir
from rapidmoe.synthetic import spec_for, write_model


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
    if not path.exists():
        write_model(spec_for(arch, size, **overrides), path, vocab_dir(), progress=True)
    return path


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None (said on stderr) when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: PLC0415  (optional dependency: the bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415  (optional dependency: the bench extra)
    except ImportError:
        print("matplotlib not installed (pip install '.[bench]'): no plot", file=sys.stderr)
        return None
    return plt
