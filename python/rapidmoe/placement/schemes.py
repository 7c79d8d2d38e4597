"""Which expert-caching scheme to use on a machine: every scheme priced by the cost model from the plan's frequency
table (expected values, no trace), the fastest decode chosen unless the user names one.

Schemes (rapidmoe.placement.cache.simulator has their replayable form):
  stock     llama.cpp's `-ot exps=CPU` with an all-Q4 model: every routed expert on the CPU, run after the GPU
  static    RESplit's planner cache: the hottest WQ experts on the GPU, misses + critical residuals on the CPU
  lru       GPU-centric on-demand loading of Q4 experts, LRU per layer (hit rate estimated from the frequency table:
            the share of the `capacity` hottest experts, an upper bound for LRU under independent routing)
  moepic    MoEpic: split experts, top segments cached, next-layer prefetch (moepic_config, prediction accuracy
            assumed, default 0.8 as measured on tiny-moe-a's deeper layers)
  rapidmoe  static + refresh from running frequencies: priced as static here (with a fixed frequency table the
            refresh has nothing to gain; bench/bench_cache.py replays traces where it does)

The runtime realizes all five (`ExpertCacheConfig(policy=...)`, `run`/`serve --cache-policy` where --gpu-mem
realizes a per-expert cache): lru and moepic on the file's own experts, e.g. WQ, where the comparison prices them
with Q4 experts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from ..resplit.presets import Preset
from .cache.config import CachePolicy
from .cache.moepic import hit_curve, moepic_config
from .cost import CostModel, ModelCosts
from .frequency import ExpertFrequency
from .machine import MachineProfile
from .planner import DEFAULT_RESERVE, Plan, PlanError, plan
from .tensors import ModelShapes

# stock llama.cpp and each cache policy, in the order the comparison lists them
CACHE_POLICIES = ("stock", *(p.value for p in (CachePolicy.static, CachePolicy.lru, CachePolicy.moepic,
                                               CachePolicy.rapidmoe)))
REALIZED = ("stock", *(p.value for p in CachePolicy))  # run/serve --gpu-mem --cache-policy
PREFILL_BATCH = 512


@dataclass(frozen=True)
class SchemeEstimate:
    scheme: str
    form: str  # the experts' type mixture
    hit_rate: float  # expected share of expert slots served by GPU-resident weights (moepic: top segment resident)
    moved_per_token: float  # host -> device bytes per decoded token
    decode_tok_s: float
    prefill_tok_s: float
    realized: bool  # whether `run --gpu-mem` places the scheme as priced (lru, moepic: priced on Q4 experts)
    fits: bool
    note: str = ""


@dataclass(frozen=True)
class SchemeChoice:
    estimates: tuple[SchemeEstimate, ...]
    chosen: str
    forced: bool  # chosen with --cache-policy rather than by speed

    def table(self) -> str:
        rows = [f"{'scheme':<10}{'experts':<26}{'hit rate':>9}{'MB moved/tok':>14}{'decode tok/s':>14}"
                f"{'prefill tok/s':>15}  runtime"]
        for e in self.estimates:
            mark = " <- chosen" + (" (--cache-policy)" if self.forced else "") if e.scheme == self.chosen else ""
            rows.append(f"{e.scheme:<10}{e.form[:25]:<26}{e.hit_rate:>9.1%}{e.moved_per_token / 1e6:>14.1f}"
                        f"{e.decode_tok_s:>14.2f}{e.prefill_tok_s:>15.1f}  "
                        + ("realized" if e.realized else "as priced: simulated only")
                        + ("" if e.fits else ", DOES NOT FIT") + mark)
        chosen = next(e for e in self.estimates if e.scheme == self.chosen)
        if not chosen.realized:
            rows.append(f"note: run/serve --gpu-mem --cache-policy {self.chosen} run it on the file's own experts, not "
                        "the Q4 model priced here; the "
                        "run flags printed with the plans are the static RESplit plan's")
        rows += [f"note ({e.scheme}): {e.note}" for e in self.estimates if e.note]
        return "\n".join(rows)


def _distinct(p_tok: NDArray[np.float64], n_tokens: int) -> NDArray[np.float64]:
    """Per expert, the probability a batch of n_tokens uses it (each token picks it with probability p_tok)."""
    return 1.0 - np.power(1.0 - np.clip(p_tok, 0.0, 1.0), n_tokens)


def compare_schemes(model: ModelShapes, machine: MachineProfile, preset: Preset, *,
                    frequency: ExpertFrequency | None = None, n_ctx: int = 4096, reserve: int = DEFAULT_RESERVE,
                    r_critical: int = 2, prediction_accuracy: float = 0.8,
                    cache_policy: str | None = None) -> tuple[SchemeChoice, Plan]:
    """Every scheme's expected decode and prefill tok/s on `machine` (its GPU memory is the budget), the fastest
    decode chosen (or `cache_policy`), and the static RESplit plan that `run` realizes."""
    if cache_policy is not None and cache_policy not in CACHE_POLICIES:
        raise PlanError(f"unknown cache policy {cache_policy!r}; choose one of {', '.join(CACHE_POLICIES)}")
    layers, k, n_expert = model.moe_layers, model.n_expert_used, model.n_expert
    freq = (frequency or ExpertFrequency.uniform(layers, n_expert)).for_model(layers, n_expert)
    shares = [freq.share[il] for il in layers]
    p_res = plan(model, "resplit", preset=preset, gpu_mem=machine.gpu_mem, n_ctx=n_ctx, reserve=reserve,
                 frequency=freq)
    p_q4 = plan(model, "cpu-offload", gpu_mem=machine.gpu_mem, n_ctx=n_ctx, reserve=reserve, frequency=freq)
    c_res, c_q4 = CostModel(machine, ModelCosts.of(model, preset)), CostModel(machine, ModelCosts.of(model))
    n_moe = len(layers)
    out: list[SchemeEstimate] = []

    def cpu_centric(cost: CostModel, cached: list[np.ndarray], r: int, overlap: bool, batch: int) -> float:
        t = cost.resident_s(batch)
        for sh, cm in zip(shares, cached, strict=True):
            p = k * sh  # per token
            d = _distinct(p, batch)
            hit_d, hit_u = float(d[cm].sum()), float(batch * p[cm].sum())
            miss_d, miss_u = float(d.sum()) - hit_d, batch * k - hit_u
            crit = (min(float(d.sum()), r * batch), float(r * batch)) if r else (0.0, 0.0)
            t += cost.layer_cpu_centric((hit_d, hit_u), (miss_d, miss_u), crit, overlap=overlap)
        return t / batch

    def mask(ids: tuple[int, ...]) -> np.ndarray:
        m = np.zeros(n_expert, dtype=bool)
        m[list(ids)] = True
        return m

    # stock: all experts on the CPU, serial
    none = [np.zeros(n_expert, dtype=bool)] * n_moe
    out.append(SchemeEstimate("stock", c_q4.model.form, 0.0, 0.0, 1 / cpu_centric(c_q4, none, 0, False, 1),
                              1 / cpu_centric(c_q4, none, 0, False, PREFILL_BATCH), True, p_q4.fits))
    static = [mask(p_res.cached.get(il, ())) for il in layers]
    for name in ("static", "rapidmoe"):
        out.append(SchemeEstimate(name, c_res.model.form, p_res.hit_rate, 0.0,
                                  1 / cpu_centric(c_res, static, r_critical, True, 1),
                                  1 / cpu_centric(c_res, static, r_critical, True, PREFILL_BATCH),
                                  name in REALIZED, p_res.fits,
                                  "priced as static: with a fixed frequency table there is nothing to refresh"
                                  if name == "rapidmoe" else ""))
    # GPU-centric: the Q4 model's experts in whatever GPU memory the rest leaves
    eb = c_q4.model.expert_bytes
    free = max(0, machine.gpu_mem - p_q4.vram) if p_q4.fits else 0
    cap = int(free // eb // max(1, n_moe))
    curves = [hit_curve(sh) for sh in shares]

    def gpu_centric(cost: CostModel, capacity: list[float], split: list[float], acc: float,
                    batch: int) -> tuple[float, float, float]:
        t, moved, hits = cost.resident_s(batch), 0.0, 0.0
        window = cost.resident_s(1) / max(1, n_moe)
        for sh, n, s in zip(shares, capacity, split, strict=True):
            p = k * sh
            order = np.argsort(-sh, kind="stable")
            cached = np.zeros(n_expert, dtype=bool)
            cached[order[: math.floor(n + 1e-9)]] = True
            d = _distinct(p, batch)
            need = float((d * np.where(cached, (1.0 - s) * eb, eb)).sum())
            hits += float(p[cached].sum()) / k
            pref = acc * need if batch == 1 else 0.0
            t += cost.layer_gpu_centric(float(d.sum()), batch * k, need - pref, pref, window)
            window = cost.window_s(float(d.sum()), batch * k)
            moved += need
        return t / batch, moved / batch, hits / n_moe

    dec = gpu_centric(c_q4, [cap] * n_moe, [1.0] * n_moe, 0.0, 1)
    pre = gpu_centric(c_q4, [cap] * n_moe, [1.0] * n_moe, 0.0, PREFILL_BATCH)
    out.append(SchemeEstimate("lru", c_q4.model.form, dec[2], dec[1], 1 / dec[0], 1 / pre[0], False, p_q4.fits,
                              f"{cap} Q4 experts per layer; hit rate of the {cap} hottest (an upper bound for LRU)"))
    cfg = moepic_config(curves, float(free), n_expert=n_expert, k=k, expert_bytes=eb, pcie_bw=machine.pcie_bw,
                        windows_s=[c_q4.window_s(k, k)] * n_moe, accuracy=[prediction_accuracy] * n_moe)
    caps = [float(c) for c in cfg.capacity]
    dec = gpu_centric(c_q4, caps, cfg.splits, prediction_accuracy, 1)
    pre = gpu_centric(c_q4, caps, cfg.splits, 0.0, PREFILL_BATCH)
    out.append(SchemeEstimate("moepic", c_q4.model.form, dec[2], dec[1], 1 / dec[0], 1 / pre[0], False, p_q4.fits,
                              f"split {min(cfg.splits):.2f}-{max(cfg.splits):.2f}, {min(cfg.capacity)}-"
                              f"{max(cfg.capacity)} tops per layer, prediction accuracy {prediction_accuracy:g} "
                              "(assumed)"))
    fitting = [e for e in out if e.fits]
    if cache_policy is not None:
        chosen, forced = cache_policy, True
    else:
        chosen, forced = max(fitting or out, key=lambda e: e.decode_tok_s).scheme, False
    return SchemeChoice(tuple(out), chosen, forced), p_res
