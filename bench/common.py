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


def read_bandwidth_gbs(threads: int = 2, gib: float = 1.0, reps: int = 5) -> float:
    """Best memory read bandwidth (GB/s) of `threads` threads summing their own part of a `gib`-GiB array (numpy
    releases the GIL in the reduction): the roofline a bandwidth-bound decode step cannot beat on this machine."""
    import threading
    import time

    a = np.ones(int(gib * 2**30) // 8, dtype=np.float64)
    parts = np.array_split(a, threads)
    best = 0.0
    for _ in range(reps):
        ts = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = max(best, a.nbytes / (time.perf_counter() - t0) / 1e9)
    return best
