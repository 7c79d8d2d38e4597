"""Expert-cache policies and a trace-driven replay that prices every step with the planner's cost model.

Routing is a token matrix `ids` [N, n_moe, k] (expert ids, -1 where a layer did not route the token), optionally
with `pred` [N, n_moe, k]: the experts a predictor expected in that layer before it ran (MoEpic's next-layer
prediction), from a trace (rapidmoe.trace) or made for a model shape (`scale_routing`).

Policies (one interface, `access` per layer per step, `end_step` after each step):

  static    the planner's cache: a fixed set per layer (greedy by calibration frequency), misses run on the CPU
            from DRAM (CPU-centric), nothing is copied at run time.
  lru       GPU-centric on-demand loading: every expert runs on the GPU; a miss is copied host->device into the
            least recently used slot of its layer before the layer computes.
  moepic    MoEpic: experts split vertically; the top segment (the leading `split` fraction of the intermediate
            dimension) of up to `capacity` experts per layer stays resident (LRU), a needed expert's missing part
            (the bottom if its top is cached, else all of it) is copied; experts predicted for the next layer are
            prefetched while this layer computes, the rest fetched on demand. Per-layer capacity and split come
            from `moepic_config` (fixed point over the latency model and hit-rate curves).
  rapidmoe  RapidMoE's WQ cache refreshed at run time: starts as `static`, keeps decayed routing counts, and after
            each step swaps in the hottest uncached expert of a layer for its coldest cached one (when hotter by a
            margin), at most `copies_per_step` experts per step over PCIe on their own queue; misses and the
            critical slots' residuals run on the CPU.

Counters per layer: slots and hits (a slot hits when its expert, or its top segment for moepic, was on the GPU at
the start of the step) and bytes copied host->device. A replay's times are projections of the cost model.
"""
from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..errors import RapidMoEError
from .cost import CostModel

log = logging.getLogger(__name__)

POLICIES = ("static", "lru", "moepic", "rapidmoe")


class CachePolicyError(RapidMoEError, ValueError):
    """Arguments a cache policy or the replay cannot work with."""


@dataclass
class Access:
    """What one layer of one step needed and got."""

    distinct: int  # experts the step's tokens used in this layer
    uses: int  # slots (token x expert)
    hit_distinct: int = 0
    hit_uses: int = 0
    demand_bytes: float = 0.0  # copied before the layer can compute (GPU-centric)
    prefetch_bytes: float = 0.0  # copied ahead, during the previous layer (moepic)
    background_bytes: float = 0.0  # copied on a separate queue, off the critical path (rapidmoe refresh)


class Policy:
    name = "policy"
    kind = "cpu"  # "cpu": misses on the CPU (CPU-centric); "gpu": everything on the GPU after copies

    def access(self, m: int, experts: np.ndarray, uses: np.ndarray, predicted: set[int] | None) -> Access:
        raise NotImplementedError

    def end_step(self, n_tokens: int) -> float:
        """Called after every step; returns background bytes copied for the next step."""
        return 0.0

    def resident(self, m: int) -> set[int]:
        raise NotImplementedError


class StaticCache(Policy):
    name = "static"

    def __init__(self, cached: Sequence[set[int] | Sequence[int]]) -> None:
        self.cached = [{int(e) for e in c} for c in cached]

    def access(self, m: int, experts: np.ndarray, uses: np.ndarray, predicted: set[int] | None) -> Access:
        hit = np.fromiter((int(e) in self.cached[m] for e in experts), bool, len(experts))
        return Access(len(experts), int(uses.sum()), int(hit.sum()), int(uses[hit].sum()))

    def resident(self, m: int) -> set[int]:
        return self.cached[m]


class LRUCache(Policy):
    """GPU-centric on-demand loading with per-layer LRU eviction.

    initial: the experts resident at the start per layer, least recently used first. overflow_on_cpu: the runtime's
    rule (Llama(expert_cache_policy="lru")): a step's missing experts are loaded in id order into the slots of the
    least recently used experts the step does not need, and those finding no such slot are not loaded (they run
    on the CPU); without it every missing expert is loaded, evicting as it goes (a GPU-centric system stages
    them)."""

    name, kind = "lru", "gpu"

    def __init__(self, capacity: Sequence[int], expert_bytes: float, *,
                 initial: Sequence[Sequence[int]] | None = None, overflow_on_cpu: bool = False) -> None:
        if any(c < 0 for c in capacity):
            raise CachePolicyError("cache capacities must be >= 0")
        if initial is not None and (len(initial) != len(capacity) or
                                    any(len(i) > c for i, c in zip(initial, capacity, strict=True))):
            raise CachePolicyError("the initial experts must fit each layer's capacity")
        self.capacity = list(capacity)
        self.eb = expert_bytes
        self.overflow_on_cpu = overflow_on_cpu
        start: Sequence[Sequence[int]] = initial if initial is not None else [()] * len(capacity)
        self.slots: list[OrderedDict[int, None]] = [OrderedDict((int(e), None) for e in ids) for ids in start]

    def _touch(self, m: int, e: int) -> None:
        s = self.slots[m]
        s[e] = None
        s.move_to_end(e)
        while len(s) > self.capacity[m]:
            s.popitem(last=False)

    def access(self, m: int, experts: np.ndarray, uses: np.ndarray, predicted: set[int] | None) -> Access:
        s = self.slots[m]
        hit = np.fromiter((int(e) in s for e in experts), bool, len(experts))
        a = Access(len(experts), int(uses.sum()), int(hit.sum()), int(uses[hit].sum()))
        if self.overflow_on_cpu:
            need = {int(e) for e in experts}
            for e in (int(x) for x in experts):
                if e in s:
                    s.move_to_end(e)
                    continue
                if len(s) >= self.capacity[m]:
                    victim = next((x for x in s if x not in need), None)
                    if victim is None:
                        continue  # no slot: runs on the CPU this step, not loaded
                    del s[victim]
                s[e] = None
                a.demand_bytes += self.eb
            return a
        a.demand_bytes = float((~hit).sum()) * self.eb
        for e in experts:  # in use order: the step's experts are the most recent
            self._touch(m, int(e))
        return a

    def resident(self, m: int) -> set[int]:
        return set(self.slots[m])


class MoEpicCache(Policy):
    """Top segments of up to capacity[m] experts resident (LRU); bottoms and uncached experts copied, predicted
    ones ahead of time.

    work_slots: the runtime's rule (Llama(expert_cache_policy="moepic")): a layer computes on the device only the
    experts its work area holds, work_slots[m] of them: the predicted ones (the first work_slots in id order) are
    assembled there ahead, the step's other experts on demand in id order while slots last, and the rest run on the
    CPU (no copy, no top admitted). Tops are admitted for the experts the device computed. None: every expert is
    computed on the device (a GPU-centric system stages them all)."""

    name, kind = "moepic", "gpu"

    def __init__(self, capacity: Sequence[int], split: Sequence[float], expert_bytes: float, *,
                 work_slots: Sequence[int] | None = None) -> None:
        if len(capacity) != len(split) or any(not 0.0 <= s <= 1.0 for s in split):
            raise CachePolicyError("moepic needs one capacity and one split ratio in [0, 1] per layer")
        if work_slots is not None and (len(work_slots) != len(capacity) or any(w < 1 for w in work_slots)):
            raise CachePolicyError("moepic needs one work area size >= 1 per layer")
        self.capacity, self.split, self.eb = list(capacity), list(split), expert_bytes
        self.work_slots = list(work_slots) if work_slots is not None else None
        self.tops: list[OrderedDict[int, None]] = [OrderedDict() for _ in capacity]

    def _admit(self, m: int, experts: Sequence[int]) -> None:
        tops = self.tops[m]
        for e in experts:
            tops[int(e)] = None
            tops.move_to_end(int(e))
            while len(tops) > self.capacity[m]:
                tops.popitem(last=False)

    def access(self, m: int, experts: np.ndarray, uses: np.ndarray, predicted: set[int] | None) -> Access:
        tops, s = self.tops[m], self.split[m]
        hit = np.fromiter((int(e) in tops for e in experts), bool, len(experts))
        a = Access(len(experts), int(uses.sum()), int(hit.sum()), int(uses[hit].sum()))
        need = np.where(hit, (1.0 - s) * self.eb, self.eb)
        if self.work_slots is not None:
            w = self.work_slots[m]
            ahead = sorted(predicted or ())[:w]  # assembled in the work area during the previous layer
            a.prefetch_bytes = sum((1.0 - s) * self.eb if e in tops else self.eb for e in ahead)
            there = set(ahead)
            on_device = [int(e) for e in experts if int(e) in there]
            rest = [i for i, e in enumerate(experts) if int(e) not in there][: max(0, w - len(on_device))]
            a.demand_bytes = float(sum(need[i] for i in rest))
            if s > 0:
                self._admit(m, sorted(on_device + [int(experts[i]) for i in rest]))
            return a
        if predicted is None:
            a.demand_bytes = float(need.sum())
        else:
            pred = np.fromiter((int(e) in predicted for e in experts), bool, len(experts))
            a.demand_bytes = float(need[~pred].sum())
            wasted = sum((1.0 - s) * self.eb if e in tops else self.eb for e in predicted
                         if e not in {int(x) for x in experts})
            a.prefetch_bytes = float(need[pred].sum()) + wasted
        if s > 0:
            self._admit(m, [int(e) for e in experts])
        return a

    def resident(self, m: int) -> set[int]:
        return set(self.tops[m])


@dataclass(frozen=True)
class RefreshSettings:
    """The rapidmoe policy's refresh: decayed routing counts (half-life in tokens), at most copies_per_step swaps after
    each step over all layers, a swap only when the incoming expert's score beats the outgoing one's by `margin`."""

    half_life_tokens: float = 64.0
    copies_per_step: int = 2
    margin: float = 0.25

    def __post_init__(self) -> None:
        if self.copies_per_step < 0 or not self.half_life_tokens > 0 or self.margin < 0:
            raise CachePolicyError("rapidmoe refresh needs copies_per_step >= 0, half_life_tokens > 0, margin >= 0")

    @property
    def decay_per_token(self) -> float:
        return 0.5 ** (1.0 / self.half_life_tokens)


def refresh_swaps(score: np.ndarray, cached: Sequence[set[int]],
                  settings: RefreshSettings) -> list[tuple[int, int, int]]:
    """The swaps (layer index, expert in, expert out) after a step: per layer, the hottest uncached expert for the
    coldest cached one when hotter by the margin; the largest gains first, at most copies_per_step. Shared by the
    simulator and the runtime (rapidmoe.expert_cache.CacheRefresher), so both make the same choices."""
    n_expert = score.shape[1]
    cands = []
    for m, c in enumerate(cached):
        if not c or len(c) == n_expert:
            continue
        sc = score[m]
        members = np.fromiter(sorted(c), int, len(c))
        out = int(members[np.argmin(sc[members])])
        free = np.setdiff1d(np.arange(n_expert), members)
        inn = int(free[np.argmax(sc[free])])
        if sc[inn] > (1.0 + settings.margin) * sc[out] + 1e-12:
            cands.append((float(sc[inn] - sc[out]), -m, inn, out))
    cands.sort(reverse=True)
    return [(-neg_m, inn, out) for _, neg_m, inn, out in cands[: settings.copies_per_step]]


class RapidMoECache(Policy):
    """The static cache refreshed from decayed running counts, a bounded number of copies per step."""

    name = "rapidmoe"

    def __init__(self, initial: Sequence[set[int] | Sequence[int]], n_expert: int, expert_bytes: float, *,
                 half_life_tokens: float = 64.0, copies_per_step: int = 2, margin: float = 0.25,
                 prior: np.ndarray | None = None) -> None:
        self.settings = RefreshSettings(half_life_tokens, copies_per_step, margin)
        self.cached = [{int(e) for e in c} for c in initial]
        self.n_expert, self.eb = n_expert, expert_bytes
        n_moe = len(self.cached)
        # counts start from the calibration frequencies (what chose the initial set), scaled to one half-life
        self.score = (np.zeros((n_moe, n_expert)) if prior is None else
                      np.asarray(prior, dtype=np.float64) * half_life_tokens)
        self._pending = np.zeros((n_moe, n_expert))
        self.swaps = 0

    def access(self, m: int, experts: np.ndarray, uses: np.ndarray, predicted: set[int] | None) -> Access:
        hit = np.fromiter((int(e) in self.cached[m] for e in experts), bool, len(experts))
        self._pending[m, experts] += uses
        return Access(len(experts), int(uses.sum()), int(hit.sum()), int(uses[hit].sum()))

    def end_step(self, n_tokens: int) -> float:
        self.score = self.score * self.settings.decay_per_token ** n_tokens + self._pending
        self._pending[:] = 0
        moved = 0.0
        for m, inn, out in refresh_swaps(self.score, self.cached, self.settings):
            self.cached[m].discard(out)
            self.cached[m].add(inn)
            moved += self.eb
            self.swaps += 1
        return moved

    def resident(self, m: int) -> set[int]:
        return self.cached[m]


@dataclass
class ReplayResult:
    policy: str
    phase: str  # "decode" (one token per step) or "prefill" (batch tokens per step)
    batch: int
    n_tokens: int
    slots: int
    hits: int
    bytes_moved: float  # host->device, all kinds
    seconds: float  # projected
    layer_hits: list[int] = field(default_factory=list)
    layer_slots: list[int] = field(default_factory=list)
    layer_bytes: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.slots if self.slots else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_moved / self.n_tokens if self.n_tokens else 0.0

    @property
    def tok_s(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else 0.0

    def layer_hit_rates(self) -> list[float]:
        return [h / s if s else 0.0 for h, s in zip(self.layer_hits, self.layer_slots, strict=True)]

    def to_dict(self) -> dict[str, object]:
        return {"policy": self.policy, "phase": self.phase, "batch": self.batch, "n_tokens": self.n_tokens,
                "slots": self.slots, "hits": self.hits, "hit_rate": self.hit_rate, "bytes_moved": self.bytes_moved,
                "bytes_per_token": self.bytes_per_token, "seconds": self.seconds, "tok_s": self.tok_s,
                "layer_hit_rates": self.layer_hit_rates()}


def replay(ids: np.ndarray, policy: Policy, cost: CostModel | None = None, *, batch: int = 1,
           pred: np.ndarray | None = None, r_critical: int = 0, overlap: bool = True,
           steps: Sequence[int] | None = None) -> ReplayResult:
    """Run the tokens through `policy` in steps of `batch` tokens (or of the given `steps` sizes, e.g. a trace's own
    batches); price each step with `cost` (None: counters only).

    CPU-centric policies compute misses (and the first r_critical experts of every token, the critical slots, as
    residual work) on the CPU, overlapped with the GPU's hits unless overlap=False (stock llama.cpp's order)."""
    if ids.ndim != 3:
        raise CachePolicyError(f"routing must be [tokens, MoE layers, k], got shape {ids.shape}")
    if batch < 1:
        raise CachePolicyError(f"batch must be >= 1, got {batch}")
    n, n_moe, _ = ids.shape
    if steps is not None and (sum(steps) != n or min(steps, default=1) < 1):
        raise CachePolicyError(f"step sizes must be >= 1 and add up to the {n} tokens, got {sum(steps)}")
    starts = list(np.cumsum([0, *steps[:-1]])) if steps is not None else list(range(0, n, batch))
    sizes = list(steps) if steps is not None else [min(batch, n - t) for t in starts]
    res = ReplayResult(policy.name, "trace" if steps is not None else "decode" if batch == 1 else "prefill", batch, n,
                       0, 0, 0.0, 0.0, [0] * n_moe, [0] * n_moe, [0.0] * n_moe)
    background = 0.0  # copies queued by the previous step
    for t0, size in zip(starts, sizes, strict=True):
        t0 = int(t0)
        blk = ids[t0:t0 + size]
        step_s = cost.resident_s(len(blk)) if cost is not None else 0.0
        prev_window = cost.resident_s(1) / max(1, n_moe) if cost is not None else 0.0
        for m in range(n_moe):
            col = blk[:, m, :]
            valid = col[col >= 0]
            if valid.size == 0:
                continue
            experts, uses = np.unique(valid, return_counts=True)
            predicted = None
            if pred is not None and m > 0:
                pc = pred[t0:t0 + size, m, :]
                predicted = {int(e) for e in pc[pc >= 0].reshape(-1)}
            a = policy.access(m, experts, uses, predicted)
            res.slots += a.uses
            res.hits += a.hit_uses
            res.layer_slots[m] += a.uses
            res.layer_hits[m] += a.hit_uses
            moved = a.demand_bytes + a.prefetch_bytes
            res.layer_bytes[m] += moved
            res.bytes_moved += moved
            if cost is None:
                continue
            if policy.kind == "gpu":
                step_s += cost.layer_gpu_centric(a.distinct, a.uses, a.demand_bytes, a.prefetch_bytes, prev_window)
                prev_window = cost.window_s(a.distinct, a.uses)
            else:
                miss_d, miss_u = a.distinct - a.hit_distinct, a.uses - a.hit_uses
                crit = (0.0, 0.0)
                if r_critical > 0:
                    cv = col[:, :r_critical]
                    cv = cv[cv >= 0]
                    crit = (float(len(np.unique(cv))), float(cv.size))
                step_s += cost.layer_cpu_centric((a.hit_distinct, a.hit_uses), (miss_d, miss_u), crit,
                                                 overlap=overlap)
        if cost is not None and background > 0:
            step_s = max(step_s, cost.copy_s(background))  # refresh copies run beside the step, bounded by it
        res.seconds += step_s
        background = policy.end_step(len(blk))
        res.bytes_moved += background
    return res


# --- MoEpic's cache configuration -------------------------------------------------------------------------------

HitCurve = Callable[[float], float]


def hit_curve(counts: np.ndarray) -> HitCurve:
    """H(n): the share of slots served by the n most used experts (linear between whole experts), from counts."""
    c = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
    total = c.sum()
    cum = np.concatenate([[0.0], np.cumsum(c) / total]) if total > 0 else np.linspace(0, 1, c.size + 1)
    xs = np.arange(c.size + 1, dtype=np.float64)
    return lambda n: float(np.interp(n, xs, cum))


@dataclass(frozen=True)
class SplitSolution:
    split: float  # resident fraction of each cached expert (top segment)
    n_cached: float  # experts whose top segment fits: budget / (split x expert bytes), capped at n_expert
    stall_s: float  # expected transfer stall per token of this layer
    iterations: int
    converged: bool


def layer_stall_s(split: float, hit: float, *, k: float, expert_bytes: float, pcie_bw: float, window_s: float,
                  accuracy: float) -> float:
    """MoEpic's per-layer latency model (decode, one token): expected bytes to fetch E = k x eb x (1 - split x H);
    the predicted share `accuracy` of them is prefetched and stalls only beyond the window; the rest is fetched on
    demand."""
    e = k * expert_bytes * (1.0 - split * hit)
    return max(0.0, accuracy * e / pcie_bw - window_s) + (1.0 - accuracy) * e / pcie_bw


def split_fixed_point(curve: HitCurve, budget: float, *, n_expert: int, k: float, expert_bytes: float,
                      pcie_bw: float, window_s: float, accuracy: float, tol: float = 1e-6,
                      max_iter: int = 100) -> SplitSolution:
    """The split ratio of one layer under a byte budget, by fixed-point iteration:

        s <- clip((1 - c) / H(n(s)), 0, 1),  n(s) = min(n_expert, budget / (s x eb)),  c = window x pcie / (a x k x eb)

    i.e. keep just enough of each cached expert resident that the prefetched rest fits in the window, and spend
    the remaining memory on more experts (a higher hit rate H). The map is monotone in s, so the iteration from
    s = 1 converges; it is damped once it starts to alternate (n is capped at n_expert)."""
    eb = expert_bytes
    kw = {"k": k, "expert_bytes": eb, "pcie_bw": pcie_bw, "window_s": window_s, "accuracy": accuracy}
    if budget <= 0:
        return SplitSolution(0.0, 0.0, layer_stall_s(0.0, 0.0, **kw), 0, True)
    c = window_s * pcie_bw / (max(accuracy, 1e-9) * k * eb)
    if c >= 1.0:  # the whole prefetch already fits in the window: cache whole experts against mispredictions
        n = min(n_expert, budget / eb)
        return SplitSolution(1.0, n, layer_stall_s(1.0, curve(n), **kw), 0, True)

    def n_of(s: float) -> float:
        return min(float(n_expert), budget / (s * eb)) if s > 0 else float(n_expert)

    def _finish(s: float, it: int, ok: bool) -> SplitSolution:
        if n_of(s) >= n_expert:  # every expert's top fits: spend what is left on larger tops
            s = max(s, min(1.0, budget / (n_expert * eb)))
        return SplitSolution(s, n_of(s), layer_stall_s(s, curve(n_of(s)), **kw), it, ok)

    s, damp = 1.0, 1.0
    prev_step = 0.0
    for it in range(1, max_iter + 1):
        h = curve(n_of(s))
        target = 1.0 if h <= 0 else min(1.0, max(1e-6, (1.0 - c) / h))
        step = target - s
        if prev_step * step < 0:
            damp *= 0.5
        s_new = s + damp * step
        prev_step = step
        if abs(s_new - s) < tol:
            return _finish(s_new, it, True)
        s = s_new
    return _finish(s, max_iter, False)


@dataclass(frozen=True)
class MoEpicConfig:
    budgets: list[float]  # bytes per layer
    splits: list[float]
    capacity: list[int]  # top segments per layer (whole experts)
    stall_s: float  # expected stall per token, all layers
    all_converged: bool


def moepic_config(curves: Sequence[HitCurve], budget: float, *, n_expert: int, k: float, expert_bytes: float,
                  pcie_bw: float, windows_s: Sequence[float], accuracy: Sequence[float],
                  quanta: int | None = None) -> MoEpicConfig:
    """Per-layer budget and split ratio. Divide: each layer's split for any budget by `split_fixed_point` (a table
    over budgets in equal quanta). Conquer: the quanta split among layers to minimise the summed expected stall,
    exactly over that grid (dynamic programming over layers)."""
    n_moe = len(curves)
    if budget < 0 or n_moe == 0 or len(windows_s) != n_moe or len(accuracy) != n_moe:
        raise CachePolicyError("moepic_config needs a budget >= 0 and one curve, window and accuracy per layer")
    q_n = quanta if quanta is not None else 8 * n_moe
    q = budget / q_n if q_n else 0.0
    # a layer never needs more than all its experts whole
    j_max = q_n if q == 0 else min(q_n, math.ceil(n_expert * expert_bytes / q))
    table = [[split_fixed_point(curves[m], j * q, n_expert=n_expert, k=k, expert_bytes=expert_bytes, pcie_bw=pcie_bw,
                                window_s=windows_s[m], accuracy=accuracy[m]) for j in range(j_max + 1)]
             for m in range(n_moe)]
    stall = np.array([[s.stall_s for s in row] for row in table])  # [n_moe, j_max + 1]
    best = np.full(q_n + 1, np.inf)  # best[j]: least stall of the layers so far with j quanta
    best[: j_max + 1] = stall[0]
    choice = [np.minimum(np.arange(q_n + 1), j_max)]
    for m in range(1, n_moe):
        new = np.full(q_n + 1, np.inf)
        arg = np.zeros(q_n + 1, dtype=np.int64)
        for j in range(j_max + 1):  # j quanta to layer m
            cand = np.full(q_n + 1, np.inf)
            cand[j:] = best[: q_n + 1 - j] + stall[m, j]
            better = cand < new - 1e-15
            new[better], arg[better] = cand[better], j
        best = new
        choice.append(arg)
    given = [0] * n_moe
    j = int(np.argmin(best))
    for m in range(n_moe - 1, 0, -1):
        given[m] = int(choice[m][j])
        j -= given[m]
    given[0] = j
    sols = [table[m][given[m]] for m in range(n_moe)]
    return MoEpicConfig([g * q for g in given], [s.split for s in sols],
                        [int(min(n_expert, math.floor(s.n_cached + 1e-9))) for s in sols],
                        sum(s.stall_s for s in sols), all(s.converged for s in sols))


def plan_moepic(counts: np.ndarray, budget: float, *, expert_bytes: float, k: int, cost: CostModel,
                accuracy: Sequence[float] | None = None) -> MoEpicConfig:
    """MoEpic's configuration for a model: per-layer hit-rate curves from routing counts [n_moe, n_expert] (a
    calibration trace), windows and link from the cost model (`cost.window_s(k, k)`: the previous layer's compute
    for one token; `cost.machine.pcie_bw`), the next-layer predictor's measured accuracy per layer (0 where not
    measured: nothing counted as prefetched). What the simulator and the runtime (Llama(expert_cache_policy=
    "moepic")) use."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 2 or counts.shape[0] == 0:
        raise CachePolicyError(f"routing counts must be [MoE layers, experts], got shape {counts.shape}")
    n_moe, n_expert = counts.shape
    acc = [0.0] * n_moe if accuracy is None else [float(a) if np.isfinite(a) else 0.0 for a in accuracy]
    return moepic_config([hit_curve(c) for c in counts], float(budget), n_expert=n_expert, k=k,
                         expert_bytes=expert_bytes, pcie_bw=cost.machine.pcie_bw,
                         windows_s=[cost.window_s(k, k)] * n_moe, accuracy=acc)


@dataclass(frozen=True)
class MoEpicSettings:
    """The moepic policy at run time (Llama(expert_cache_policy="moepic", expert_cache_moepic=...)): per MoE layer
    (in layer order) the top segment's share of the intermediate dimension (rounded down to whole rows and to the
    down projection's quantization block) and how many tops stay resident; work_slots experts per layer computed on
    the device per ubatch (0: the model's top-k). One value applies to every layer."""

    split: float | Sequence[float]
    capacity: int | Sequence[int]
    work_slots: int = 0

    def __post_init__(self) -> None:
        splits = [self.split] if isinstance(self.split, (int, float)) else list(self.split)
        caps = [self.capacity] if isinstance(self.capacity, int) else list(self.capacity)
        if any(not 0.0 <= float(x) <= 1.0 for x in splits) or any(int(c) < 0 for c in caps) or self.work_slots < 0:
            raise CachePolicyError("moepic settings need splits in [0, 1], capacities >= 0 and work_slots >= 0")

    @classmethod
    def from_config(cls, cfg: MoEpicConfig, work_slots: int = 0) -> MoEpicSettings:
        return cls(list(cfg.splits), list(cfg.capacity), work_slots)

    def per_layer(self, n_moe: int) -> tuple[list[float], list[int]]:
        splits = [float(self.split)] * n_moe if isinstance(self.split, (int, float)) else [float(x) for x in self.split]
        caps = [int(self.capacity)] * n_moe if isinstance(self.capacity, int) else [int(c) for c in self.capacity]
        if len(splits) != n_moe or len(caps) != n_moe:
            raise CachePolicyError(f"moepic settings give {len(splits)} splits and {len(caps)} capacities for "
                                   f"{n_moe} MoE layers")
        return splits, caps


def top_rows(split: float, n_ff: int, block: int) -> int:
    """Rows of the intermediate dimension in the top segment: split x n_ff rounded down to a multiple of block."""
    return math.floor(split * n_ff / block + 1e-9) * block


# --- routing for shapes we cannot run -----------------------------------------------------------------------------

@dataclass(frozen=True)
class RoutingStats:
    """Per MoE layer of a real trace: expert popularity, token-to-token reuse, next-layer prediction accuracy."""

    popularity: np.ndarray  # [n_moe, n_expert] shares
    reuse: np.ndarray  # [n_moe] mean share of a token's experts the previous token also used
    accuracy: np.ndarray  # [n_moe] share of a layer's experts the predictor named (nan without predictions)
    chance: np.ndarray  # [n_moe] the reuse independent draws by popularity would give
    k: int = 1

    @property
    def excess_reuse(self) -> np.ndarray:
        """Reuse beyond chance, (reuse - chance) / (1 - chance), >= 0: the locality that carries over to a shape
        with more experts (where chance reuse is much smaller)."""
        return np.clip((self.reuse - self.chance) / np.maximum(1e-12, 1.0 - self.chance), 0.0, 1.0)


def chance_reuse(popularity: np.ndarray, k: int) -> float:
    """Expected share of a token's experts found among the previous token's, both drawn independently: sum over
    experts of p_e x P(e among k draws) ~ sum p_e min(1, k p_e)."""
    p = np.asarray(popularity, dtype=np.float64)
    return float(np.sum(p * np.minimum(1.0, k * p)))


def routing_stats(ids: np.ndarray, n_expert: int, pred: np.ndarray | None = None) -> RoutingStats:
    _, n_moe, k = ids.shape
    pop = np.zeros((n_moe, n_expert))
    reuse = np.zeros(n_moe)
    chance = np.zeros(n_moe)
    acc = np.full(n_moe, np.nan)
    for m in range(n_moe):
        col = ids[:, m, :]
        ok = (col >= 0).all(axis=1)
        c = col[ok]
        pop[m] = np.bincount(c.reshape(-1), minlength=n_expert)[:n_expert]
        pop[m] /= max(1.0, pop[m].sum())
        chance[m] = chance_reuse(pop[m], k)
        if len(c) > 1:
            same = [(np.isin(c[i], c[i - 1])).mean() for i in range(1, len(c))]
            reuse[m] = float(np.mean(same))
        if pred is not None and m > 0:
            p = pred[:, m, :][ok]
            if len(p):
                acc[m] = float(np.mean([np.isin(c[i], p[i]).mean() for i in range(len(c))]))
    return RoutingStats(pop, reuse, acc, chance, k)


def scale_routing(stats: RoutingStats, *, n_tokens: int, n_moe: int, n_expert: int, k: int,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Routing [n_tokens, n_moe, k] (and predictions) for a larger shape from a real trace's per-layer statistics:
    big layer L takes small layer L x n_small // n_moe; small expert e becomes n_expert / n_small big experts that
    share its popularity equally; each token reuses a Binomial(k, excess reuse) number of the previous token's
    experts (the small model's reuse beyond chance) and draws the rest by popularity, without repeats; the
    predictor names each chosen expert with the small layer's measured accuracy (0.5 where none was measured) and
    fills the rest by popularity. A projection of
    the small model's skew and locality onto the big shape, not the big model's routing."""
    small_moe, small_e = stats.popularity.shape
    if n_expert % small_e:
        raise CachePolicyError(f"cannot map {small_e} experts onto {n_expert} (not a multiple)")
    g = n_expert // small_e
    rng = np.random.default_rng(seed)
    ids = np.empty((n_tokens, n_moe, k), dtype=np.int64)
    pred = np.empty_like(ids)
    for lm in range(n_moe):
        sm = lm * small_moe // n_moe
        p = np.repeat(stats.popularity[sm] / g, g)
        p = p / p.sum()
        rho = float(stats.excess_reuse[sm])
        a = float(stats.accuracy[sm]) if np.isfinite(stats.accuracy[sm]) else 0.5
        prev: np.ndarray | None = None
        for t in range(n_tokens):
            chosen: list[int] = []
            if prev is not None:
                n_re = min(k, int(rng.binomial(k, rho)))
                chosen = list(rng.choice(prev, size=n_re, replace=False)) if n_re else []
            chosen += _draw(rng, p, k - len(chosen), chosen)
            row = np.array(chosen, dtype=np.int64)
            ids[t, lm] = row
            keep = [int(e) for e in row if rng.random() < a]
            pred[t, lm] = np.array(keep + _draw(rng, p, k - len(keep), keep), dtype=np.int64)
            prev = row
    return ids, pred


def _draw(rng: np.random.Generator, p: np.ndarray, n: int, exclude: Sequence[int]) -> list[int]:
    if n <= 0:
        return []
    q = p.copy()
    q[list(exclude)] = 0.0
    q /= q.sum()
    return [int(x) for x in rng.choice(q.size, size=n, replace=False, p=q)]
