"""Shared by the benchmarks: KL divergence and top-1 agreement between two models' logits, synthetic models, plots."""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rapidmoe.paths import vocab_dir
from rapidmoe.resplit import Preset, convert, get_preset
from rapidmoe.synthetic import spec_for, write_model


def cpu_name() -> str:
    """The CPU's model name, as results name the machine (/proc/cpuinfo; platform.processor() is empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


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


def source_key(src: Path) -> str:
    """A work folder's name for one source model: its folder, file stem and a digest of its path, size and time, so
    that two models with the same file name (each trained model's model-f16.gguf) or a model written again never
    share cached files."""
    st = src.resolve().stat()
    digest = hashlib.sha256(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:10]
    return f"{src.parent.name}-{src.stem}-{digest}"


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


# -- speed against quality: frontiers ------------------------------------------------------------------------

def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(kl, tok/s) points no other point beats in both (lower KL and higher speed), by increasing KL."""
    pts = sorted(points)
    front: list[tuple[float, float]] = []
    for kl, tps in pts:
        if not front or tps > front[-1][1]:
            front.append((kl, tps))
    return front


def _piecewise(line: list[tuple[float, float]], x: float) -> float:
    """y at x on the polyline through `line` (sorted by x, x inside its range)."""
    for (x0, y0), (x1, y1) in itertools.pairwise(line):
        if x0 <= x <= x1:
            return y0 + ((x - x0) / (x1 - x0) if x1 > x0 else 0.0) * (y1 - y0)
    return line[-1][1]  # one point, at exactly its x


def frontier_speed(front: list[tuple[float, float]], kl: float) -> tuple[float, str]:
    """A frontier's tok/s at this KL (linear in log KL between neighbours) and how it was found: 'interp', 'below'
    (the KL is lower than every frontier point's: the lowest-KL point, a lower bound on what the peer would need),
    or 'above' (higher than every point's: the fastest point)."""
    if kl <= front[0][0]:
        return front[0][1], "below"
    if kl >= front[-1][0]:
        return front[-1][1], "above"
    return _piecewise([(math.log(k), t) for k, t in front], math.log(kl)), "interp"


@dataclass(frozen=True)
class EnvelopeCheck:
    """Our points against a peer's frontier over the peer's KL range: at every KL x in [lo, hi], the fastest of our
    points with KL <= x (what a user who needs quality x can pick) against the peer's frontier interpolated at x."""
    lo: float
    hi: float
    worst_kl: float         # where ours is furthest behind (or least ahead)
    worst_ratio: float      # our best speed there / the peer's frontier speed; 0.0 where we have no point that good
    holds: bool             # worst_ratio > 1: ours is faster over the whole range


def envelope_check(ours: list[tuple[float, float]], peer: list[tuple[float, float]]) -> EnvelopeCheck:
    """Exact, not sampled: the peer's frontier speed grows with KL and our best speed is a step function that only
    steps up at our points' KLs, so the ratio is lowest just below each of our KLs inside the range, or at its ends."""
    front = pareto(peer)
    lo, hi = front[0][0], max(k for k, _ in peer)

    def best(x: float, strict: bool) -> float:
        return max((t for k, t in ours if (k < x if strict else k <= x)), default=0.0)

    candidates = [(lo, best(lo, False)), (hi, best(hi, False))]
    candidates += [(k, best(k, True)) for k, _ in ours if lo < k <= hi]
    ratios = [(s / frontier_speed(front, x)[0], x) for x, s in candidates]
    worst_ratio, worst_kl = min(ratios)
    return EnvelopeCheck(lo, hi, worst_kl, worst_ratio, worst_ratio > 1.0)


K_QUANTS = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K")  # stock llama-quantize's K-quant mixtures, by size


def kl_at_bytes(points: list[tuple[float, float]], mb: float) -> tuple[float | None, str]:
    """A stock line's KL at `mb` bytes read per token: (MB, KL) points, the ones no smaller point beats in KL, log KL
    linear in MB between neighbours; (None, 'below') or (None, 'above') outside the line's range (not extrapolated)."""
    line = [(m, -neg) for m, neg in pareto([(m, -k) for m, k in points])]  # KL falling as the bytes grow
    if not line or mb < line[0][0]:
        return None, "below"
    if mb > line[-1][0]:
        return None, "above"
    return math.exp(_piecewise([(m, math.log(k)) for m, k in line], mb)), "interp"


def spec_preset(spec: str) -> Preset:
    """A preset by name, or NAME@MIXFILE: the preset with the mix in MIXFILE (`convert --mix-bits`'s NAME.mix.json,
    or a text file holding a mix string: docs/resplit.md, Per-layer and per-role types)."""
    name, at, mix_file = spec.partition("@")
    if not at:
        return get_preset(name)
    text = Path(mix_file).read_text()
    mix = str(json.loads(text)["mix"]) if mix_file.endswith(".json") else text.strip()
    return get_preset(name, mix=mix)


def pair_dir(work: Path, stem: str, spec: str) -> Path:
    """Where a preset spec's pair of the model `stem` lives: `<stem>.<name>`, `<stem>.<name>+<mix file stem>`."""
    name, at, mix_file = spec.partition("@")
    return work / (f"{stem}.{name}" + (f"+{Path(mix_file).stem}" if at else ""))


def ensure_pair(model: Path, work: Path, spec: str) -> tuple[Path, Path]:
    """(.wq.gguf, .wr.gguf) of `model` converted with a preset spec (spec_preset), converted once into pair_dir."""
    d = pair_dir(work, model.stem, spec)
    wq, wr, rep = d / f"{model.stem}.wq.gguf", d / f"{model.stem}.wr.gguf", d / f"{model.stem}.resplit.json"
    preset = spec_preset(spec)
    # reused only when made with this very preset (an edited mix file is converted again)
    if not (wq.exists() and wr.exists() and rep.exists()
            and json.loads(rep.read_text()).get("preset") == json.loads(json.dumps(preset.record()))):
        convert(model, d, preset, progress=True, report_experts=1, force=True)
    return wq, wr
