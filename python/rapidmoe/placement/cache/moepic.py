"""MoEpic's cache configuration: per-layer hit-rate curves, the split-ratio fixed point under a byte budget, the
budget's division among layers, and the top segment's rows; and what a model file tells the cache (its MoE layers,
an expert's bytes, each layer's top segment in whole rows, the settings for a planned cache's memory)."""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ...ggml_types import block_bytes, block_size
from ...ggufio import GGUFFile
from ...moe_tensors import DOWN, GATE, GATE_UP, UP, expert_name, moe_layers, parse_expert
from ..cost import CostModel, ModelCosts
from ..frequency import load_frequency
from ..machine import MACHINES
from ..tensors import read_gguf_shapes
from .config import CachePolicyError, MoEpicConfig, MoEpicSettings

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
    measured: nothing counted as prefetched). What the simulator and the runtime (ExpertCacheConfig(policy=
    "moepic")) use."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 2 or counts.shape[0] == 0:
        raise CachePolicyError(f"routing counts must be [MoE layers, experts], got shape {counts.shape}")
    n_moe, n_expert = counts.shape
    acc = [0.0] * n_moe if accuracy is None else [float(a) if np.isfinite(a) else 0.0 for a in accuracy]
    return moepic_config([hit_curve(c) for c in counts], float(budget), n_expert=n_expert, k=k,
                         expert_bytes=expert_bytes, pcie_bw=cost.machine.pcie_bw,
                         windows_s=[cost.window_s(k, k)] * n_moe, accuracy=acc)



def top_rows(split: float, n_ff: int, block: int) -> int:
    """Rows of the intermediate dimension in the top segment: split x n_ff rounded down to a multiple of block."""
    return math.floor(split * n_ff / block + 1e-9) * block


# --- the cache on a model file -----------------------------------------------------------------------------------

def moe_layers_of(model_path: str | os.PathLike[str]) -> list[int]:
    """Layers with routed experts (gate, up and down, or merged gate_up and down) in the file."""
    return moe_layers(t.name for t in GGUFFile(model_path).tensors)


def wq_expert_bytes(model_path: str | os.PathLike[str], layers: Sequence[int]) -> dict[int, int]:
    """Bytes of one expert's gate + up + down (or gate_up + down) slices per layer, as stored in the file (what a
    swap copies)."""
    per_layer: dict[int, int] = {}
    for t in GGUFFile(model_path).tensors:
        if (e := parse_expert(t.name)) is not None:
            per_layer[e.layer] = per_layer.get(e.layer, 0) + int(t.n_bytes) // int(t.shape[2])
    return {il: per_layer[il] for il in layers}


@dataclass(frozen=True)
class MoEpicLayer:
    """One MoE layer under the moepic policy at run time."""

    layer: int
    n_ff: int  # the intermediate dimension
    n_top: int  # its leading rows in the top segment
    capacity: int  # top segments resident
    work_slots: int  # experts the device computes per ubatch (the work area)
    expert_bytes: int  # one expert's gate + up + down
    top_bytes: int  # its top segment

    @property
    def split(self) -> float:
        """The top's share of the intermediate dimension (= of the expert's bytes)."""
        return self.n_top / self.n_ff if self.n_ff else 0.0


def moepic_for_cache(model_path: str | os.PathLike[str], cache: Mapping[int, Sequence[int]], *,
                     frequency_path: str | os.PathLike[str] | None = None, machine: str = "24gb",
                     accuracy: float = 0.8) -> MoEpicSettings:
    """MoEpicSettings for the device memory a per-expert cache plan would use (the experts it lists, in the file's
    types): per-layer split and tops from MoEpic's fixed point (plan_moepic) over hit-rate
    curves of the frequency table (--freq's formats; uniform without) and the `machine` profile's link and windows,
    with the next-layer predictor's accuracy assumed (0.8, as plan --machine assumes)."""
    layers = moe_layers_of(model_path)
    eb = wq_expert_bytes(model_path, layers)
    gf = GGUFFile(model_path)
    n_expert = int(gf.tensor(expert_name(layers[0], DOWN)).shape[2])  # down: in every layout
    n_layer = int(gf.get(f"{gf.get('general.architecture')}.block_count"))
    share = load_frequency(frequency_path, layers, n_layer, n_expert).share
    freq = np.stack([share[il] for il in layers])
    budget = float(sum(len(cache.get(il, ())) * eb[il] for il in layers))
    shapes = read_gguf_shapes(model_path)
    cost = CostModel(MACHINES[machine], ModelCosts.of(shapes))
    cfg = plan_moepic(freq, budget, expert_bytes=float(eb[layers[0]]), k=shapes.n_expert_used, cost=cost,
                      accuracy=[accuracy] * len(layers))
    return MoEpicSettings.from_config(cfg)


def moepic_layers(model_path: str | os.PathLike[str], layers: Sequence[int], splits: Sequence[float],
                  capacities: Sequence[int], work_slots: int) -> list[MoEpicLayer]:
    """Each layer's split rounded to whole rows of the intermediate dimension and to the down projection's
    quantization block (down's top is the leading columns of its rows), with the bytes that decides."""
    tensors = {t.name: t for t in GGUFFile(model_path).tensors}
    out = []
    for il, split, cap in zip(layers, splits, capacities, strict=True):
        if expert_name(il, GATE_UP) in tensors:
            raise CachePolicyError(f"layer {il} has merged gate_up experts: the moepic policy splits gate and up as "
                                   "separate tensors (the expert cache does not take merged gate_up yet)")
        up, gate, down = (tensors[expert_name(il, r)] for r in (UP, GATE, DOWN))
        n_embd, n_ff = int(up.shape[0]), int(up.shape[1])
        block, tsize = block_size(down.tensor_type.name), block_bytes(down.tensor_type.name)
        n_top = top_rows(split, n_ff, block)
        per_expert = [int(t.n_bytes) // int(t.shape[2]) for t in (up, gate, down)]
        row_up, row_gate = per_expert[0] // n_ff, per_expert[1] // n_ff
        top = n_top * (row_up + row_gate) + n_top // block * tsize * n_embd
        out.append(MoEpicLayer(il, n_ff, n_top, int(cap), work_slots, sum(per_expert), top))
    return out
