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
            from `cache.moepic.moepic_config` (fixed point over the latency model and hit-rate curves).
  rapidmoe  RapidMoE's WQ cache refreshed at run time: starts as `static`, keeps decayed routing counts, and after
            each step swaps in the hottest uncached expert of a layer for its coldest cached one (when hotter by a
            margin), at most `copies_per_step` experts per step over PCIe on their own queue; misses and the
            critical slots' residuals run on the CPU.

Counters per layer: slots and hits (a slot hits when its expert, or its top segment for moepic, was on the GPU at
the start of the step) and bytes copied host->device. A replay's times are projections of the cost model.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..cost import CostModel
from .config import CachePolicyError, RefreshSettings


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


class ReplayPolicy:
    name = "policy"
    kind = "cpu"  # "cpu": misses on the CPU (CPU-centric); "gpu": everything on the GPU after copies

    def access(self, m: int, experts: np.ndarray, uses: np.ndarray, predicted: set[int] | None) -> Access:
        raise NotImplementedError

    def end_step(self, n_tokens: int) -> float:
        """Called after every step; returns background bytes copied for the next step."""
        return 0.0

    def resident(self, m: int) -> set[int]:
        raise NotImplementedError


class StaticCache(ReplayPolicy):
    name = "static"

    def __init__(self, cached: Sequence[set[int] | Sequence[int]]) -> None:
        self.cached = [{int(e) for e in c} for c in cached]

    def access(self, m: int, experts: np.ndarray, uses: np.ndarray, predicted: set[int] | None) -> Access:
        hit = np.fromiter((int(e) in self.cached[m] for e in experts), bool, len(experts))
        return Access(len(experts), int(uses.sum()), int(hit.sum()), int(uses[hit].sum()))

    def resident(self, m: int) -> set[int]:
        return self.cached[m]


class LRUCache(ReplayPolicy):
    """GPU-centric on-demand loading with per-layer LRU eviction.

    initial: the experts resident at the start per layer, least recently used first. overflow_on_cpu: the runtime's
    rule (ExpertCacheConfig(policy="lru")): a step's missing experts are loaded in id order into the slots of the
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


class MoEpicCache(ReplayPolicy):
    """Top segments of up to capacity[m] experts resident (LRU); bottoms and uncached experts copied, predicted
    ones ahead of time.

    work_slots: the runtime's rule (ExpertCacheConfig(policy="moepic")): a layer computes on the device only the
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



def refresh_swaps(score: np.ndarray, cached: Sequence[set[int]],
                  settings: RefreshSettings) -> list[tuple[int, int, int]]:
    """The swaps (layer index, expert in, expert out) after a step: per layer, the hottest uncached expert for the
    coldest cached one when hotter by the margin; the largest gains first, at most copies_per_step. Shared by the
    simulator and the runtime (rapidmoe.cache.runtime.CacheRefresher), so both make the same choices."""
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


class RapidMoECache(ReplayPolicy):
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


def replay(ids: np.ndarray, policy: ReplayPolicy, cost: CostModel | None = None, *, batch: int = 1,
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
