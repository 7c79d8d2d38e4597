"""Reconstruction-error bookkeeping for RESplit: ||W - What|| / ||W|| per tensor and in total, for WQ alone,
the critical path (deq WQ + deq WR, the down copy, or the refine codec's refined weights), and plain Q4_K / Q8_0
of the same weights (and Q3_K with the refine codec: its base's stock counterpart).

Pure numpy; sums of squares are accumulated in float64 so totals are exact aggregates, not averages of ratios.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .presets import REFINE_WR


def _sq(x: np.ndarray) -> float:
    return float(np.dot(x.ravel().astype(np.float64), x.ravel().astype(np.float64)))


@dataclass
class ErrorAccumulator:
    """Squared norms of W and of each approximation's error; the reference types only over sampled experts."""

    w2: float = 0.0
    wq2: float = 0.0
    crit2: float = 0.0
    ref_w2: float = 0.0  # ||W||^2 over the experts where the references were computed
    ref2: dict[str, float] = field(default_factory=dict)

    def merge(self, other: ErrorAccumulator) -> None:
        self.w2 += other.w2
        self.wq2 += other.wq2
        self.crit2 += other.crit2
        self.ref_w2 += other.ref_w2
        for k, v in other.ref2.items():
            self.ref2[k] = self.ref2.get(k, 0.0) + v

    def summary(self) -> dict[str, float]:
        def rel(e2: float, w2: float) -> float:
            return float(np.sqrt(e2 / w2)) if w2 > 0 else 0.0

        out = {"wq_only": rel(self.wq2, self.w2), "critical": rel(self.crit2, self.w2)}
        for k, v in sorted(self.ref2.items()):
            out[k] = rel(v, self.ref_w2)
        return out


@dataclass
class TensorReport:
    name: str
    role: str  # gate, up, down, gate_up
    wq_type: str
    hi_type: str  # the sidecar tensor's type
    down_copy: bool  # the sidecar holds a copy of down, not a residual
    acc: ErrorAccumulator = field(default_factory=ErrorAccumulator)
    fallbacks: list[str] = field(default_factory=list)  # "<tensor> <part> <asked>-><used>" (row size forced a type)

    def add(self, w: np.ndarray, wq: np.ndarray, critical: np.ndarray, refs: dict[str, np.ndarray]) -> None:
        """One expert: W, deq(WQ), the critical-path reconstruction, and reference reconstructions."""
        w2 = _sq(w)
        self.acc.w2 += w2
        self.acc.wq2 += _sq(w - wq)
        self.acc.crit2 += _sq(w - critical)
        if refs:
            self.acc.ref_w2 += w2
            for k, r in refs.items():
                self.acc.ref2[k] = self.acc.ref2.get(k, 0.0) + _sq(w - r)

    def summary(self) -> dict[str, object]:
        return {"name": self.name, "role": self.role, "wq_type": self.wq_type, "sidecar_type": self.hi_type,
                "sidecar_is_copy": self.down_copy, "rel_error": self.acc.summary(), "fallbacks": self.fallbacks}


def _sidecar_label(t: dict[str, Any]) -> str:
    if t["sidecar_type"] == REFINE_WR:
        return f"{REFINE_WR} bits"
    return f"{t['sidecar_type']} {'copy' if t['sidecar_is_copy'] else 'res'}"


def format_table(report: dict[str, Any]) -> str:
    """The per-tensor and total relative errors as a fixed-width table (with the refine codec, whose base is a Q3_K
    fitted for the refinement, ggml's own Q3_K of the same weights as a column too)."""
    refs = ("Q3_K", "Q4_K", "Q8_0") if "Q3_K" in report["total"] else ("Q4_K", "Q8_0")
    rows = [("tensor", "wq", "sidecar", "WQ only", "critical", *refs)]
    for t in report["tensors"]:
        e = t["rel_error"]
        rows.append((t["name"], t["wq_type"], _sidecar_label(t), f"{e['wq_only']:.4f}", f"{e['critical']:.4f}",
                     *(f"{e.get(r, float('nan')):.4f}" for r in refs)))
    tot = report["total"]
    rows.append(("TOTAL (routed experts)", "", "", f"{tot['wq_only']:.4f}", f"{tot['critical']:.4f}",
                 *(f"{tot.get(r, float('nan')):.4f}" for r in refs)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    fallbacks = report.get("type_fallbacks") or []
    if fallbacks:
        lines.append(f"{len(fallbacks)} part(s) took llama-quantize's fallback type (rows not a multiple of the "
                     "asked type's block):")
        lines.extend(f"  {line}" for line in fallbacks)
    return "\n".join(lines)
