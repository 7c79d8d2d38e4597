"""Measuring the latency model on this machine: fixed-r decode steps and prefill batches, WQ path and drop baseline.

Decode: after an 8-token prompt, `decode_tokens` single-token steps (the same tokens every time), the median step
time. Prefill: one batch of `prefill_batch` tokens, time per token. Each (mode, r) is measured `repeats` times in
alternating order (so drift of a shared machine spreads over all r) and the median kept. `device_latency_model`:
the device part of the latency model, priced from a machine profile (umia/profile.py) or measured on a device.
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..errors import RapidMoEError
from ..modelfile import read_model_info
from ..placement.cache.config import ExpertCacheConfig
from ..placement.cache.moepic import moe_layers_of
from ..placement.machine import load_machine
from ..placement.tensors import read_gguf_shapes
from ..resplit.presets import get_preset
from ..umia.device import DeviceCosts, DevicePoint, fit_stage_terms
from ..umia.latency import DeviceModel, LatencyModel, PhaseCosts, Point, describe_machine, fit
from ..umia.profile import PREFILL_BATCH, profile_terms

log = logging.getLogger(__name__)

_TEXT = ("Mixture-of-Experts models route each token to a few experts; the router's weights say which experts "
         "matter most for the token, and the rest of the network is shared by all tokens. ") * 40


def decode_step_ms(llm: object, prompt: Sequence[int], steps: Sequence[int]) -> float:
    """Median time (ms) of single-token decode steps after a fresh prompt, with whatever policy is set."""
    llm.reset()  # type: ignore[attr-defined]
    llm.eval(prompt)  # type: ignore[attr-defined]
    step_ms = []
    for t in steps:
        t0 = time.perf_counter()
        llm.eval([t])  # type: ignore[attr-defined]
        step_ms.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(step_ms)


def default_r_values(k: int) -> tuple[list[int], list[int]]:
    """(r for the WQ path, r for the drop baseline): every r up to 8, then a spread; drop at a few small r."""
    wq = list(range(k + 1)) if k <= 8 else sorted({0, 1, 2, 3, 4, 6, k // 2, k})
    drop = sorted({1, max(2, k // 2)} - {0}) if k > 1 else [1]
    return wq, drop


def measure_points(wq_path: str | os.PathLike[str], wr_path: str | os.PathLike[str], *, threads: int | None,
                   r_values: Sequence[int], drop_r_values: Sequence[int], decode_tokens: int = 16,
                   prefill_batch: int = 64, repeats: int = 3, progress: bool = True) -> list[Point]:
    from ..llama import Llama  # noqa: PLC0415  (rapidmoe.llama loads the compiled part on import)

    if decode_tokens < 2 or prefill_batch < 2 or repeats < 1:
        raise RapidMoEError("decode_tokens and prefill_batch must be >= 2, repeats >= 1")
    n_ctx = max(prefill_batch, 8 + decode_tokens) + 8
    runs = [("wq", list(r_values)), ("drop", list(drop_r_values))]
    total = repeats * sum(len(rs) for _, rs in runs)
    bar = tqdm(total=total, desc="latency", unit="run", disable=not progress)
    points: list[Point] = []
    for mode, rs in runs:
        if not rs:
            continue
        llm = Llama(wq_path, residual_path=wr_path, n_ctx=n_ctx, n_batch=max(prefill_batch, 64),
                    n_ubatch=max(prefill_batch, 64), n_threads=threads, n_threads_batch=threads,
                    skip_noncritical=mode == "drop", verify_residual=False, verbose=False)
        try:
            toks = llm.tokenize(_TEXT.encode())
            if len(toks) < prefill_batch + 8 + decode_tokens:
                raise RapidMoEError("the built-in measuring text is too short for this prefill batch")
            prompt, steps, batch = toks[:8], toks[8:8 + decode_tokens], toks[:prefill_batch]
            llm.eval(prompt)  # warm-up: first-touch of the weights, graph allocation
            dec: dict[int, list[float]] = {r: [] for r in rs}
            pre: dict[int, list[float]] = {r: [] for r in rs}
            for rep in range(repeats):
                for r in (rs if rep % 2 == 0 else rs[::-1]):
                    llm.set_n_critical(r)
                    dec[r].append(decode_step_ms(llm, prompt, steps))
                    llm.reset()
                    t0 = time.perf_counter()
                    llm.eval(batch)
                    pre[r].append(1e3 * (time.perf_counter() - t0) / prefill_batch)
                    bar.update(1)
            for r in rs:
                points.append(Point("decode", mode, r, statistics.median(dec[r])))
                points.append(Point("prefill", mode, r, statistics.median(pre[r])))
        finally:
            llm.close()
    bar.close()
    return points


def calibrate_latency(wq_path: str | os.PathLike[str], wr_path: str | os.PathLike[str], *,
                      threads: int | None = None, r_values: Sequence[int] | None = None,
                      drop_r_values: Sequence[int] | None = None, decode_tokens: int = 16,
                      prefill_batch: int = 64, repeats: int = 3, progress: bool = True) -> LatencyModel:
    """Measure and fit this machine's latency model for a RESplit pair."""
    info = read_model_info(wq_path)
    k = info.n_expert_used

    n_moe = len(moe_layers_of(wq_path))
    d_wq, d_drop = default_r_values(k)
    wq_r = sorted(set(r_values if r_values is not None else d_wq))
    drop_r = sorted(set(drop_r_values if drop_r_values is not None else d_drop))
    bad = [r for r in wq_r + drop_r if not 0 <= r <= k]
    if bad:
        raise RapidMoEError(f"r values must be in 0..{k} (top-k of this model), got {bad}")
    t0 = time.perf_counter()
    points = measure_points(wq_path, wr_path, threads=threads, r_values=wq_r, drop_r_values=drop_r,
                            decode_tokens=decode_tokens, prefill_batch=prefill_batch, repeats=repeats,
                            progress=progress)
    model = {"wq": str(Path(wq_path)), "wr": str(Path(wr_path)), "wq_bytes": Path(wq_path).stat().st_size,
             "wr_bytes": Path(wr_path).stat().st_size, "architecture": info.architecture,
             "n_expert": info.n_expert, "measure_seconds": round(time.perf_counter() - t0, 1),
             "decode_tokens": decode_tokens, "repeats": repeats}
    return fit(points, n_moe, k, prefill_batch, describe_machine(threads), model)


def measure_device_points(wq_path: str | os.PathLike[str], wr_path: str | os.PathLike[str], *, device: str,
                          rpc_servers: Sequence[str] = (), threads: int | None = None,
                          r_values: Sequence[int] = (0, 1, 2), cache_fractions: Sequence[float] = (0.5, 1.0),
                          decode_tokens: int = 16, prefill_batch: int = 64, repeats: int = 2,
                          progress: bool = True) -> tuple[list[DevicePoint], int, int]:
    """The device part's measurements (umia/device.py): for each share of every MoE layer's experts cached on
    `device` (the lowest ids) and each schedule (serial, concurrent), decode steps and a prefill batch at each r,
    with the hit rate and the per-stage worker/device times the runtime recorded. Returns (points, n_moe, k)."""
    from ..llama import Llama  # noqa: PLC0415  (rapidmoe.llama loads the compiled part on import)

    info = read_model_info(wq_path)
    k, n_expert = info.n_expert_used, info.n_expert
    moe = moe_layers_of(wq_path)
    bad = [f for f in cache_fractions if not 0 < f <= 1]
    if bad or not cache_fractions:
        raise RapidMoEError(f"cache fractions must be in (0, 1], got {list(cache_fractions)}")
    n_ctx = max(prefill_batch, 8 + decode_tokens) + 8
    total = len(cache_fractions) * 2 * repeats * len(r_values)
    bar = tqdm(total=total, desc="device latency", unit="run", disable=not progress)
    points: list[DevicePoint] = []
    for frac in cache_fractions:
        n_cached = max(1, round(frac * n_expert))
        for overlap in (False, True):
            llm = Llama(wq_path, residual_path=wr_path, n_ctx=n_ctx, n_batch=max(prefill_batch, 64),
                        n_ubatch=max(prefill_batch, 64), n_threads=threads, n_threads_batch=threads,
                        rpc_servers=list(rpc_servers) or None, n_gpu_layers=-1, override_tensor="exps=CPU",
                        expert_cache=ExpertCacheConfig({il: list(range(n_cached)) for il in moe}, device),
                        overlap="auto" if overlap else "off", verify_residual=False, verbose=False)
            try:
                toks = llm.tokenize(_TEXT.encode())
                prompt, steps, batch = toks[:8], toks[8:8 + decode_tokens], toks[:prefill_batch]
                llm.eval(prompt)  # warm-up
                got: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
                for rep in range(repeats):
                    for r in (r_values if rep % 2 == 0 else list(r_values)[::-1]):
                        llm.set_n_critical(r)
                        got.setdefault(("decode", r), []).append(_decode_sample(llm, prompt, steps))
                        got.setdefault(("prefill", r), []).append(_prefill_sample(llm, batch))
                        bar.update(1)
                for (phase, r), samples in got.items():
                    ms, hit, worker, dev = (statistics.median(s[i] for s in samples) for i in range(4))
                    points.append(DevicePoint(phase, r, hit, overlap, ms, worker, dev))
            finally:
                llm.close()
    bar.close()
    return points, len(moe), k


def _stage_sums(llm: Any, n_tokens: int) -> tuple[float, float, float]:
    """(hit rate, worker ms per token, device ms per token) since the counters were last reset."""
    st = llm.overlap_stats()
    hit = llm.expert_cache.stats().hit_rate
    worker = (st.gate_up.cpu_ms + st.down.cpu_ms) / n_tokens
    dev = (st.gate_up.device_ms + st.down.device_ms) / n_tokens
    return hit, worker, dev


def _decode_sample(llm: Any, prompt: Sequence[int], steps: Sequence[int]) -> tuple[float, float, float, float]:
    llm.reset()
    llm.eval(prompt)
    llm.overlap_stats(reset=True)
    llm.expert_cache.stats(reset=True)
    step_ms = []
    for t in steps:
        t0 = time.perf_counter()
        llm.eval([t])
        step_ms.append(1e3 * (time.perf_counter() - t0))
    return (statistics.median(step_ms), *_stage_sums(llm, len(steps)))


def _prefill_sample(llm: Any, batch: Sequence[int]) -> tuple[float, float, float, float]:
    llm.reset()
    llm.overlap_stats(reset=True)
    llm.expert_cache.stats(reset=True)
    t0 = time.perf_counter()
    llm.eval(batch)
    ms = 1e3 * (time.perf_counter() - t0) / len(batch)
    return (ms, *_stage_sums(llm, len(batch)))


def device_latency_model(wq_path: str | os.PathLike[str], wr_path: str | os.PathLike[str], *,
                         machine: str | None = None, device: str | None = None, rpc_servers: Sequence[str] = (),
                         threads: int | None = None, cache_fractions: Sequence[float] = (0.5, 1.0),
                         preset_name: str = "paper", repeats: int = 2, decode_tokens: int = 16,
                         prefill_batch: int = 64, progress: bool = True) -> LatencyModel:
    """A latency model whose device part is priced from a machine profile (`machine`) or measured on `device`
    (the hit rate of the first cache fraction prices `calibrate`'s candidates). Its CPU-only part holds the same
    costs in R(c, a) form (hits and misses blended by the hit rate), for readers that know only that form."""
    shapes = read_gguf_shapes(wq_path)
    n_moe, k = len(shapes.moe_layers), shapes.n_expert_used
    info: dict[str, Any] = {"wq": str(wq_path), "wr": str(wr_path)}
    if machine is not None:
        prof = load_machine(machine)
        t = profile_terms(shapes, prof, get_preset(preset_name), prefill_batch=prefill_batch)
        dev = DeviceModel(f"profile {prof.name}", t["hit_rate"], True, t["decode"], t["prefill"])
        info.update(stream_threshold=t["stream_threshold"], preset=preset_name)
        described: dict[str, Any] = {"profile": prof.to_dict()}
    elif device is not None:
        points, n_moe, k = measure_device_points(
            wq_path, wr_path, device=device, rpc_servers=rpc_servers, threads=threads,
            cache_fractions=cache_fractions, decode_tokens=decode_tokens, prefill_batch=prefill_batch,
            repeats=repeats, progress=progress)
        dec, dec_pts = fit_stage_terms([p for p in points if p.phase == "decode"], n_moe, k)
        pre, pre_pts = fit_stage_terms([p for p in points if p.phase == "prefill"], n_moe, k)
        first = [p.hit_rate for p in dec_pts if p.overlap][: 1] or [0.0]
        dev = DeviceModel(f"measured on {device}", first[0], True, dec, pre, dec_pts + pre_pts)
        info.update(cache_fractions=list(cache_fractions), repeats=repeats)
        described = describe_machine(threads)
    else:
        raise RapidMoEError("a device latency model needs a machine profile or a device to measure on")

    def blended(c: DeviceCosts) -> PhaseCosts:
        h = dev.hit_rate
        return PhaseCosts(c.fixed_ms + n_moe * (c.xfer_ms + c.sync_ms), h * c.hit_ms + (1 - h) * c.miss_ms,
                          c.wr_ms, c.active_ms)

    return LatencyModel(n_moe, k, blended(dev.decode), blended(dev.prefill) if dev.prefill else None,
                        prefill_batch if device is not None else PREFILL_BATCH, [], described, info, device=dev)
