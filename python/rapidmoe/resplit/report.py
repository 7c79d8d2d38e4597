"""Reconstruction-error bookkeeping for RESplit: ||W - What|| / ||W|| per tensor and in total, for WQ alone,
the critical path (deq WQ + deq WR, the down copy, or the refine codec's refined weights), and plain Q4_K / Q8_0
of the same weights (and Q3_K with the refine codec: its base's stock counterpart); from the finished report, the
lines that name the tensors a type flag did not set, and why.

Pure numpy; sums of squares are accumulated in float64 so totals are exact aggregates, not averages of ratios.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .codecs import DEFAULT, REGISTRY, Codec
from .presets import OTHER_TYPES


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


def _codec(report: Mapping[str, Any]) -> Codec:
    """The codec that wrote the report's sidecar (its "codec", absent: the default's; unknown here: the default)."""
    return REGISTRY.get(report.get("codec") or DEFAULT) or REGISTRY[DEFAULT]


def format_table(report: dict[str, Any]) -> str:
    """The per-tensor and total relative errors as a fixed-width table (with the refine codec, whose base is a Q3_K
    fitted for the refinement, ggml's own Q3_K of the same weights as a column too)."""
    refs = ("Q3_K", "Q4_K", "Q8_0") if "Q3_K" in report["total"] else ("Q4_K", "Q8_0")
    rows = [("tensor", "wq", "sidecar", "WQ only", "critical", *refs)]
    label = _codec(report).report_label
    for t in report["tensors"]:
        e = t["rel_error"]
        rows.append((t["name"], t["wq_type"], label(t["sidecar_type"], t["sidecar_is_copy"]), f"{e['wq_only']:.4f}",
                     f"{e['critical']:.4f}",
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


def _names(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def flag_exceptions(report: dict[str, Any], given: Mapping[str, str | None]) -> list[str]:
    """One line per type flag and reason naming the tensors the flag names but did not set (none where it set them
    all): `given` maps --wq, --wr and --other-type to the value given (None: not given). --wq and --wr name the
    routed experts' base and sidecar parts (--wr: not down's copy), left by a --mix entry or llama-quantize's
    row-size fallback; --other-type (a single type; a mixture is llama.cpp's choice per tensor) names every
    non-expert matrix, left by the rules of typechoice.tensor_choice (routers kept F32, rows no block divides)."""
    fallen = {line.split(" ")[0] + " " + line.split(" ")[1] for line in report.get("type_fallbacks") or []}
    out: list[str] = []
    for flag, key, part in (("--wq", "wq_type", "wq"), ("--wr", "sidecar_type", "sidecar")):
        want = given.get(flag)
        if want is None:
            continue
        left: dict[str, list[str]] = {}
        for t in report["tensors"]:
            if (flag == "--wr" and t["sidecar_is_copy"]) or t[key] == want.upper():
                continue
            why = "llama-quantize's fallback: rows not whole blocks" if f"{t['name']} {part}" in fallen else \
                "the mix's entry"
            left.setdefault(f"{t[key]} ({why})", []).append(t["name"])
        out.extend(f"{flag} {want} leaves {_names(names)} at {what}" for what, names in left.items())
    other = given.get("--other-type")
    if other is not None and other.upper() in OTHER_TYPES:
        matrices = {n: t for n, t in (report.get("other_tensors") or {}).items() if t["dims"] >= 2}
        by_rule: dict[str, list[str]] = {}
        for n, t in matrices.items():
            if t["type"] != other.upper():
                by_rule.setdefault(f"{t['type']} ({t['rule']})", []).append(n)
        out.extend(f"--other-type {other} leaves {len(names)} of {len(matrices)} non-expert matrices at {what}: "
                   f"{_names(names)}" for what, names in by_rule.items())
    return out
