"""The latency model R: per-token time as a function of the critical expert slots, fitted to measurements.

Per token, in one phase (decode: one token per step; prefill: a batch of B tokens, time per token):

    R(c, a) = fixed_ms + n_moe * k * wq_ms + c * wr_ms + a * active_ms

c is the number of critical slots per token summed over the MoE layers (n_moe * r for fixed r; what the r
histogram gives for UMIA), a the number of MoE layers where the token has at least one critical slot (n_moe for
fixed r > 0, 0 for r = 0), wq_ms the time of one expert slot on the WQ path in one layer, wr_ms the extra time of
making one slot critical (WR residuals + high-precision down), active_ms the per-layer set-up of the residual path
when it has any work (activation conversion, threads woken for non-empty masked matmuls), fixed_ms everything
else (attention, dense and shared parts, router, sampling, graph overheads). Runs with the drop baseline (only the
c critical slots computed, in high precision) give R_drop(c, a) = fixed_ms + c * (wq_ms + wr_ms) + a * active_ms,
which separates wq_ms from fixed_ms. The coefficients (all >= 0) are fitted by least squares over all measured
points; the report shows every point's measured and predicted time and the leave-one-out prediction (each point
predicted by a fit without it).

With a device (a per-expert WQ cache on a GPU or an RPC device), `device` holds the terms of umia/device.py and
R becomes fixed_ms + sum over the MoE layers of max(device stage, CPU stage) + sync (concurrent) or their sum
(serial), priced per layer from the r histogram; from a machine profile or measured (`calibrate-latency --machine
/ --device`).
"""
from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import write_text
from ..errors import RapidMoEError
from .device import DeviceCosts, DevicePoint
from .device import predict_ms as device_predict_ms
from .fit import nnls

FORMAT = "rapidmoe-latency-model"
VERSION = 1


@dataclass(frozen=True)
class Point:
    """One measurement: ms per token in a phase with fixed r, the WQ path kept (wq) or dropped (drop)."""

    phase: str  # "decode" or "prefill"
    mode: str  # "wq" or "drop"
    r: int
    ms: float
    predicted_ms: float = float("nan")
    loo_ms: float = float("nan")  # predicted by the fit without this point

    @property
    def rel_err(self) -> float:
        return (self.predicted_ms - self.ms) / self.ms

    @property
    def loo_rel_err(self) -> float:
        return (self.loo_ms - self.ms) / self.ms


@dataclass(frozen=True)
class PhaseCosts:
    fixed_ms: float
    wq_ms: float  # one expert slot, one layer, WQ path
    wr_ms: float  # making one slot critical, one layer
    active_ms: float = 0.0  # one layer's residual path having any work


@dataclass
class DeviceModel:
    """The device part: where its terms come from, the expert cache's hit rate and schedule they price."""

    source: str  # "profile <name>" or "measured on <device>"
    hit_rate: float
    overlap: bool  # concurrent stages (max) or serial (sum)
    decode: DeviceCosts
    prefill: DeviceCosts | None
    points: list[DevicePoint] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "hit_rate": self.hit_rate, "overlap": self.overlap,
                "decode": self.decode.to_dict(), "prefill": self.prefill.to_dict() if self.prefill else None,
                "points": [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                            for k, v in asdict(p).items()} for p in self.points]}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> DeviceModel:
        return DeviceModel(str(d["source"]), float(d["hit_rate"]), bool(d["overlap"]),
                           DeviceCosts.from_dict(d["decode"]),
                           DeviceCosts.from_dict(d["prefill"]) if d.get("prefill") else None,
                           [_device_point(x) for x in d.get("points", [])])


@dataclass
class LatencyModel:
    n_moe_layers: int
    k: int
    decode: PhaseCosts
    prefill: PhaseCosts | None
    prefill_batch: int
    points: list[Point]
    machine: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    device: DeviceModel | None = None

    def predict_layers_ms(self, r_per_layer: Any, active_per_layer: Any, phase: str = "decode") -> float:
        """R from each MoE layer's mean r and share of tokens with any critical slot (the r histogram): the device
        part's per-layer max when there is one, else R(sum of r, sum of active)."""
        r_l = [float(x) for x in r_per_layer]
        a_l = [float(x) for x in active_per_layer]
        if self.device is None:
            return self.predict_ms(sum(r_l), sum(a_l), phase)
        c = self.device.decode if phase == "decode" else self.device.prefill
        if c is None:
            raise RapidMoEError(f"this latency model's device part has no {phase} terms")
        return device_predict_ms(c, self.k, self.device.hit_rate, r_l, a_l, overlap=self.device.overlap)

    def predict_ms(self, critical_slots_per_token: float, active_layers_per_token: float | None = None,
                   phase: str = "decode") -> float:
        """R(c, a); a defaults to every MoE layer active when c > 0. With a device part: c and a spread evenly
        over the MoE layers (predict_layers_ms prices an uneven spread)."""
        if self.device is not None:
            n = self.n_moe_layers
            a = active_layers_per_token if active_layers_per_token is not None else (
                n if critical_slots_per_token > 0 else 0.0)
            return self.predict_layers_ms([critical_slots_per_token / n] * n, [a / n] * n, phase)
        c = self.decode if phase == "decode" else self.prefill
        if c is None:
            raise RapidMoEError(f"this latency model has no {phase} part")
        a = active_layers_per_token if active_layers_per_token is not None else (
            self.n_moe_layers if critical_slots_per_token > 0 else 0.0)
        return (c.fixed_ms + self.n_moe_layers * self.k * c.wq_ms + critical_slots_per_token * c.wr_ms
                + a * c.active_ms)

    def predict_drop_ms(self, critical_slots_per_token: float, active_layers_per_token: float) -> float:
        """The drop baseline computes only the critical slots, WQ + WR."""
        c = self.decode
        return (c.fixed_ms + critical_slots_per_token * (c.wq_ms + c.wr_ms)
                + active_layers_per_token * c.active_ms)

    def fit_errors(self, phase: str | None = None) -> dict[str, float]:
        pts = [p for p in self.points if phase is None or p.phase == phase]
        if not pts:
            return {}
        e = np.abs([p.rel_err for p in pts])
        loo = np.abs([p.loo_rel_err for p in pts])
        return {"mean_rel_err": float(e.mean()), "max_rel_err": float(e.max()),
                "loo_mean_rel_err": float(np.nanmean(loo)), "loo_max_rel_err": float(np.nanmax(loo))}

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "machine": self.machine, "model": self.model,
                "n_moe_layers": self.n_moe_layers, "k": self.k, "prefill_batch": self.prefill_batch,
                "decode": asdict(self.decode), "prefill": asdict(self.prefill) if self.prefill else None,
                "fit": {ph: self.fit_errors(ph) for ph in ("decode", "prefill")
                        if any(p.phase == ph for p in self.points)},
                "points": [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                            for k, v in asdict(p).items()} for p in self.points],
                "device": self.device.to_dict() if self.device is not None else None}

    def save(self, path: str | os.PathLike[str]) -> Path:
        return write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    def table(self) -> str:
        rows = ["phase    path  r   measured ms/token  predicted  error   leave-one-out error"]
        for p in self.points:
            rows.append(f"{p.phase:8s} {p.mode:5s} {p.r:<3d} {p.ms:17.3f}  {p.predicted_ms:9.3f}  "
                        f"{100 * p.rel_err:+5.1f}%  "
                        + (f"{100 * p.loo_rel_err:+5.1f}%" if np.isfinite(p.loo_ms) else "  n/a (needed by the fit)"))
        for ph in ("decode", "prefill"):
            if any(p.phase == ph for p in self.points):
                f = self.fit_errors(ph)
                rows.append(f"{ph}: mean |error| {100 * f['mean_rel_err']:.1f}%, max {100 * f['max_rel_err']:.1f}%;"
                            f" leave-one-out mean {100 * f['loo_mean_rel_err']:.1f}%,"
                            f" max {100 * f['loo_max_rel_err']:.1f}%")
        return "\n".join(rows)


N_COEF = 4


def _design(points: list[Point], n_moe: int, k: int) -> np.ndarray:
    """Rows [1, WQ slots, WR slots, active layers] per point: unknowns (fixed_ms, wq_ms, wr_ms, active_ms)."""
    rows = []
    for p in points:
        c = n_moe * p.r
        rows.append([1.0, n_moe * k if p.mode == "wq" else c, c, n_moe if p.r > 0 else 0])
    return np.array(rows, dtype=np.float64)


def fit_phase(points: list[Point], n_moe: int, k: int) -> tuple[PhaseCosts, list[Point]]:
    """Least-squares costs of one phase; the points come back with predictions and leave-one-out predictions."""
    if len(points) < N_COEF:
        raise RapidMoEError(f"fitting the latency model needs at least {N_COEF} measurements, got {len(points)}")
    a = _design(points, n_moe, k)
    if np.linalg.matrix_rank(a) < N_COEF:
        raise RapidMoEError("the measurements cannot separate the costs: measure r = 0 and at least two r > 0 "
                            "with the WQ path, and one r > 0 with the drop baseline")
    y = np.array([p.ms for p in points])
    coef = nnls(a, y)
    pred = a @ coef
    out = []
    for i, p in enumerate(points):
        keep = np.arange(len(points)) != i
        loo = float("nan")
        if np.linalg.matrix_rank(a[keep]) == N_COEF:
            loo = float(a[i] @ nnls(a[keep], y[keep]))
        out.append(Point(p.phase, p.mode, p.r, p.ms, float(pred[i]), loo))
    return PhaseCosts(float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3])), out


def fit(points: list[Point], n_moe: int, k: int, prefill_batch: int, machine: dict[str, Any] | None = None,
        model: dict[str, Any] | None = None) -> LatencyModel:
    dec, dec_pts = fit_phase([p for p in points if p.phase == "decode"], n_moe, k)
    pre_in = [p for p in points if p.phase == "prefill"]
    pre, pre_pts = fit_phase(pre_in, n_moe, k) if pre_in else (None, [])
    return LatencyModel(n_moe, k, dec, pre, prefill_batch, dec_pts + pre_pts, machine or {}, model or {})


def load_latency_model(path: str | os.PathLike[str]) -> LatencyModel:
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise RapidMoEError(
            f"latency model {p} does not exist (make one with `rapidmoe-cli calibrate-latency`)") from None
    except (OSError, ValueError) as e:
        raise RapidMoEError(f"cannot read latency model {p}: {e}") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != VERSION:
        raise RapidMoEError(f"{p} is not a rapidmoe latency model (format {FORMAT!r} version {VERSION})")
    try:
        return LatencyModel(
            n_moe_layers=int(d["n_moe_layers"]), k=int(d["k"]), decode=PhaseCosts(**d["decode"]),
            prefill=PhaseCosts(**d["prefill"]) if d.get("prefill") else None,
            prefill_batch=int(d["prefill_batch"]),
            points=[_point(x) for x in d["points"]],
            machine=d.get("machine", {}), model=d.get("model", {}),
            device=DeviceModel.from_dict(d["device"]) if d.get("device") else None)
    except (KeyError, TypeError, ValueError) as e:
        raise RapidMoEError(f"{p}: malformed latency model ({e})") from None


def _device_point(x: dict[str, Any]) -> DevicePoint:
    values: dict[str, Any] = {k: (float("nan") if v is None else v) for k, v in x.items()}
    return DevicePoint(**values)


def _point(x: dict[str, Any]) -> Point:
    """A measured point from its JSON form (null stands for NaN)."""
    values: dict[str, Any] = {k: (float("nan") if v is None else v) for k, v in x.items()}
    return Point(**values)


def describe_machine(threads: int | None) -> dict[str, Any]:
    """What the measurements depend on: CPU model and flags, cores, threads used, memory."""
    cpu, flags = platform.processor() or "unknown", list[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu in ("unknown", "x86_64", ""):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = [f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma", "f16c"))]
    except OSError:
        pass
    mem = 0
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return {"cpu": cpu, "cpu_flags": sorted(flags), "logical_cpus": os.cpu_count(), "threads": threads,
            "memory_bytes": mem, "system": platform.platform(), "devices": ["CPU"]}
