"""The device part of the latency model R: layers with a per-expert WQ cache on a device (a GPU, an RPC device).

Per token, in one phase, with hit rate h (share of expert slots served by the device's cache), per MoE layer l with
r_l critical slots and a_l = 1 when it has any (mean over tokens):

    D_l = xfer_ms + k * h * hit_ms                                   the device: the cached experts' WQ, and the
                                                                     hand-over of activations in and results out
    C_l = k * (1 - h) * miss_ms + r_l * wr_ms + a_l * active_ms      the CPU: the misses' WQ and the residuals
    layer_l = max(D_l, C_l) + sync_ms     concurrent (the worker runs C while the device runs D: rapidmoe-overlap.h)
            = D_l + C_l + sync_ms + serial_sync_ms    serial (overlap "off": one device split per WQ matmul, three
                                                      per layer, against two stages concurrent: more hand-overs)
    R = fixed_ms + sum over l of layer_l

Prefill streaming (rapidmoe-stream.h) replaces D_l and the misses of C_l for a batch of B tokens by
stream_l = (the layer's stacked WQ bytes over the link + the device computing all B * k slots) / B, with the
residuals beside it: max(stream_l, r_l * wr_ms + a_l * active_ms) + sync_ms.

The terms come either from a machine profile (placement/machine.py, priced by placement/cost.py: the one cost model
the planner and the cache simulator use) or from measurements on the device llama.cpp has (`fit_stage_terms`: the
worker's and the device's per-stage times that the overlap ops record, and the step times for fixed_ms). Pure
arithmetic: no extension imports here.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import RapidMoEError
from ..placement.cost import CostModel
from .fit import nnls


@dataclass(frozen=True)
class DeviceCosts:
    """One phase's terms, ms per token (prefill: per token at the measured/priced batch)."""

    fixed_ms: float  # everything outside the routed experts (on the device), graph and sampling overheads
    hit_ms: float  # one WQ slot, one layer, from the device's cache
    miss_ms: float  # one WQ slot, one layer, on the CPU from DRAM
    wr_ms: float  # making one slot critical, one layer (CPU)
    active_ms: float  # one layer's residual path having any work (CPU)
    xfer_ms: float  # one layer's activations to the device and results back (copies, launch)
    sync_ms: float  # one layer's CPU <-> device hand-over beyond the copies (waits, events)
    serial_sync_ms: float = 0.0  # the serial schedule's extra hand-overs per layer
    stream_ms: float = float("nan")  # prefill: one layer's WQ streamed and computed on the device (nan: unknown)

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> DeviceCosts:
        return DeviceCosts(**{k: (float("nan") if v is None else float(v)) for k, v in d.items()})


@dataclass(frozen=True)
class LayerTimes:
    device_ms: float  # D
    cpu_ms: float  # C
    total_ms: float  # max(D, C) + sync, or D + C + sync


def layer_ms(c: DeviceCosts, k: int, hit_rate: float, r: float, active: float, *, overlap: bool = True,
             stream: bool = False) -> LayerTimes:
    """One MoE layer's time per token under the terms of `c`."""
    if not 0.0 <= hit_rate <= 1.0:
        raise RapidMoEError(f"hit rate must be in [0, 1], got {hit_rate}")
    residual = r * c.wr_ms + active * c.active_ms
    if stream:
        if not math.isfinite(c.stream_ms):
            raise RapidMoEError("these device terms have no streaming cost (prefill from a machine profile only)")
        return LayerTimes(c.stream_ms, residual, max(c.stream_ms, residual) + c.sync_ms)
    dev = c.xfer_ms + k * hit_rate * c.hit_ms
    cpu = k * (1.0 - hit_rate) * c.miss_ms + residual
    sync = c.sync_ms if cpu > 0 else 0.0
    if not overlap and cpu > 0:
        sync += c.serial_sync_ms
    return LayerTimes(dev, cpu, (max(dev, cpu) if overlap else dev + cpu) + sync)


def predict_ms(c: DeviceCosts, k: int, hit_rate: float, r_per_layer: Sequence[float],
               active_per_layer: Sequence[float] | None = None, *, overlap: bool = True, stream: bool = False) -> float:
    """R: fixed_ms plus every MoE layer's time (r_per_layer: mean critical slots per token in each layer; active:
    the share of tokens with any, default 1 where r > 0)."""
    act = active_per_layer if active_per_layer is not None else [1.0 if r > 0 else 0.0 for r in r_per_layer]
    if len(act) != len(r_per_layer):
        raise RapidMoEError(f"{len(r_per_layer)} layers of r but {len(act)} of active shares")
    return c.fixed_ms + sum(layer_ms(c, k, hit_rate, r, a, overlap=overlap, stream=stream).total_ms
                            for r, a in zip(r_per_layer, act, strict=True))


# ---- from a machine profile ------------------------------------------------------------------------------------


def distinct_experts(n_expert: int, k: int, n_tokens: int) -> float:
    """Expected distinct experts a batch of n_tokens touches in one layer under uniform routing."""
    return n_expert * (1.0 - (1.0 - k / n_expert) ** n_tokens)


def profile_costs(cost: CostModel, hit_rate: float, n_tokens: int = 1, n_embd: int = 0) -> DeviceCosts:
    """The terms a machine profile gives for a step of n_tokens (1 = decode), per token and per slot: the roofline
    of placement/cost.py, with the expert reads shared by the batch's tokens (distinct experts under uniform
    routing). xfer: the layer's activations in and results out over the link (n_embd floats per token and slot);
    sync: two hand-overs per layer (machine.sync_s)."""
    m, mc = cost.machine, cost.model
    k, n_e, b = mc.k, mc.n_expert, max(1, n_tokens)
    distinct = distinct_experts(n_e, k, b)
    uses = b * k
    per_slot = 1e3 / uses  # ms per (token x slot) from seconds per step
    hit = cost.gpu_experts_s(distinct, uses) * per_slot
    miss = cost.cpu_experts_s(distinct, uses) * per_slot
    wr = cost.cpu_residual_s(distinct, uses) * per_slot
    xfer = 1e3 * (2 * 4 * n_embd * (k + 1)) / m.pcie_bw  # per token: x in, k results back (f32)
    stream_s = n_e * mc.expert_bytes / m.pcie_bw + cost.gpu_experts_s(n_e, uses)
    return DeviceCosts(fixed_ms=1e3 * cost.resident_s(b) / b, hit_ms=hit, miss_ms=miss, wr_ms=wr,
                       active_ms=0.0, xfer_ms=xfer, sync_ms=1e3 * 2 * m.sync_s / b,
                       serial_sync_ms=1e3 * m.sync_s / b, stream_ms=1e3 * stream_s / b)


def stream_threshold(cost: CostModel, hit_rate: float, r: float = 2.0, n_embd: int = 0,
                     max_tokens: int = 4096) -> int:
    """The smallest batch (tokens) from which streaming a cached layer's WQ to the device beats computing its
    misses on the CPU beside the device's hits (both with r critical slots per token on the CPU), or 0 when it
    never does up to max_tokens. Searched on every batch size: the costs are not monotone in general."""
    for b in range(1, max_tokens + 1):
        c = profile_costs(cost, hit_rate, b, n_embd)
        keep = layer_ms(c, cost.model.k, hit_rate, r, 1.0 if r > 0 else 0.0).total_ms
        streamed = layer_ms(c, cost.model.k, hit_rate, r, 1.0 if r > 0 else 0.0, stream=True).total_ms
        if streamed < keep:
            return b
    return 0


# ---- from measurements on a device --------------------------------------------------------------------------


@dataclass(frozen=True)
class DevicePoint:
    """One measured configuration: ms per token of a phase at fixed r and a hit rate, serial or concurrent, with
    the per-token stage times the overlap ops recorded (concurrent runs only; 0 for serial ones)."""

    phase: str
    r: int
    hit_rate: float
    overlap: bool
    ms: float
    worker_ms: float = 0.0  # the CPU worker per token, all layers: sum of C_l
    device_ms: float = 0.0  # begin returned -> join started per token, all layers: sum of D_l
    predicted_ms: float = float("nan")

    @property
    def rel_err(self) -> float:
        return (self.predicted_ms - self.ms) / self.ms


def fit_stage_terms(points: Sequence[DevicePoint], n_moe: int, k: int) -> tuple[DeviceCosts, list[DevicePoint]]:
    """One phase's terms from measurements: C's (miss, wr, active) from the concurrent runs' worker times, D's
    (xfer, hit) from their device times, fixed_ms and serial_sync_ms from the step times given those (serial runs
    sum D and C, concurrent ones take the max). sync_ms is 0: on a device reached through llama.cpp's scheduler the
    concurrent schedule's hand-over is inside the device time the ops measure. Returns the terms and the points
    with their predictions."""
    conc = [p for p in points if p.overlap]
    if len({(p.r, round(p.hit_rate, 6)) for p in conc}) < 3:
        raise RapidMoEError("fitting the device terms needs concurrent runs at >= 3 (r, hit rate) configurations")
    a_c = np.array([[n_moe * k * (1 - p.hit_rate), n_moe * p.r, n_moe * (p.r > 0)] for p in conc], dtype=float)
    miss, wr, active = nnls(a_c, np.array([p.worker_ms for p in conc]))
    a_d = np.array([[n_moe, n_moe * k * p.hit_rate] for p in conc], dtype=float)
    xfer, hit = nnls(a_d, np.array([p.device_ms for p in conc]))
    base = DeviceCosts(0.0, float(hit), float(miss), float(wr), float(active), float(xfer), 0.0)
    rest = np.array([predict_ms(base, k, p.hit_rate, [float(p.r)] * n_moe, overlap=p.overlap) for p in points])
    # step time - the stages = fixed + (serial runs with CPU work) n_moe * serial_sync
    extra = [n_moe * float(not p.overlap and layer_ms(base, k, p.hit_rate, p.r, p.r > 0).cpu_ms > 0) for p in points]
    fixed, serial_sync = nnls(np.array([[1.0, e] for e in extra]), np.array([p.ms for p in points]) - rest)
    costs = DeviceCosts(float(fixed), float(hit), float(miss), float(wr), float(active), float(xfer), 0.0,
                        float(serial_sync))
    out = [DevicePoint(p.phase, p.r, p.hit_rate, p.overlap, p.ms, p.worker_ms, p.device_ms,
                       predict_ms(costs, k, p.hit_rate, [float(p.r)] * n_moe, overlap=p.overlap)) for p in points]
    return costs, out


def points_table(points: Sequence[DevicePoint]) -> str:
    rows = ["| phase | r | hit rate | schedule | measured ms/token | predicted | error | worker ms | device ms |",
            "|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        rows.append(f"| {p.phase} | {p.r} | {p.hit_rate:.3f} | {'concurrent' if p.overlap else 'serial'} | "
                    f"{p.ms:.2f} | {p.predicted_ms:.2f} | {100 * p.rel_err:+.1f}% | "
                    + (f"{p.worker_ms:.2f} | {p.device_ms:.2f} |" if p.overlap else "— | — |"))
    return "\n".join(rows)
