"""The cost model: how long a step (one batch of tokens through the model) takes under a placement, on a machine.

One model for the planner (`plan --machine`: tok/s of each scheme), the cache simulator (placement.cache.simulator,
which prices every replayed step with it) and UMIA (`umia_costs`: the projected per-slot costs of its latency model R).

Every part is a roofline: the time to read its bytes or to do its FLOPs, whichever is longer, on the device that
runs it (machine.py). Per step of T tokens:

    resident   attention, dense FFN, shared experts, router, norms, head: GPU, read once per step
    expert     one routed expert used by u tokens of the step: bytes once, 2 * params * u FLOPs, on the GPU (a
               cache hit, or after a host->device copy) or the CPU (a miss in a CPU-centric scheme)
    residual   RESplit: a critical slot's WR residual + high-precision down, on the CPU
    copy       host->device bytes over PCIe
    sync       one CPU <-> GPU hand-over per layer that has CPU work

and how a layer combines them depends on the scheme (`layer_ms`): CPU-centric layers overlap GPU and CPU work
(max), GPU-centric layers wait for their on-demand copies (sum), MoEpic hides prefetched copies behind the previous
layer's compute. Not modelled: attention's dependence on the context length (KV cache reads), kernel launch
overheads beyond `sync`, contention between PCIe copies and the CPU's DRAM reads. These are projections.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..resplit.presets import Preset
from .footprint import footprint
from .machine import MachineProfile
from .tensors import EMBEDDINGS, ROUTED, ModelShapes
from .typeplan import q4_k_m_types, resplit_types


@dataclass(frozen=True)
class ModelCosts:
    """What the cost model needs of a model in one type mixture."""

    name: str
    form: str  # "WQ (preset paper)", "Q4_K_M-like", ...
    n_moe: int
    n_expert: int
    k: int
    resident_bytes: int  # non-expert tensors on the GPU (everything but routed experts and token embeddings)
    resident_flops: float  # per token: 2 x their parameters
    expert_bytes: float  # one routed expert (gate + up + down), mean over MoE layers, main form
    expert_flops: float  # per token using it: 2 x its parameters
    residual_bytes: float = 0.0  # one expert's sidecar part (WR gate/up + down copy or residual); 0 without

    @staticmethod
    def of(model: ModelShapes, preset: Preset | None = None) -> ModelCosts:
        """RESplit's WQ + sidecar with a preset, else the Q4_K_M-like all-Q4 model of the baselines."""
        rule = resplit_types(preset, model) if preset is not None else q4_k_m_types(model)
        fp = footprint(model, rule, preset)
        n_moe = len(fp.expert_bytes)
        resident = sum(b for part, b in fp.parts.items() if part not in (ROUTED, EMBEDDINGS))
        params = sum(t.n_elements for t in model.tensors if t.part not in (ROUTED, EMBEDDINGS))
        routed_params = sum(t.n_elements for t in model.tensors if t.part == ROUTED)
        per_expert = routed_params / max(1, n_moe * model.n_expert)
        side = sum(fp.sidecar.values()) / max(1, n_moe * model.n_expert)
        form = f"WQ {preset.wq} (preset {preset.name})" if preset is not None else "Q4_K_M-like"
        return ModelCosts(model.name, form, n_moe, model.n_expert, model.n_expert_used, resident, 2.0 * params,
                          fp.routed_bytes / max(1, n_moe * model.n_expert), 2.0 * per_expert, side)


@dataclass(frozen=True)
class CostModel:
    machine: MachineProfile
    model: ModelCosts

    # --- parts ---
    def resident_s(self, n_tokens: int) -> float:
        """The GPU-resident parts for a step of n_tokens (all layers)."""
        m, c = self.machine, self.model
        return max(c.resident_bytes / m.gpu_bw, n_tokens * c.resident_flops / m.gpu_flops)

    def gpu_experts_s(self, n_distinct: float, n_uses: float) -> float:
        m, c = self.machine, self.model
        return max(n_distinct * c.expert_bytes / m.gpu_bw, n_uses * c.expert_flops / m.gpu_flops)

    def cpu_experts_s(self, n_distinct: float, n_uses: float) -> float:
        m, c = self.machine, self.model
        return max(n_distinct * c.expert_bytes / m.cpu_bw, n_uses * c.expert_flops / m.cpu_flops)

    def cpu_residual_s(self, n_distinct: float, n_uses: float) -> float:
        """Critical slots' residual work: WR gate/up and the high-precision down, about the expert's FLOPs again."""
        m, c = self.machine, self.model
        if c.residual_bytes <= 0:
            return 0.0
        return max(n_distinct * c.residual_bytes / m.cpu_bw, n_uses * c.expert_flops / m.cpu_flops)

    def copy_s(self, n_bytes: float) -> float:
        return n_bytes / self.machine.pcie_bw

    # --- layers, per scheme ---
    def layer_cpu_centric(self, gpu: tuple[float, float], cpu: tuple[float, float],
                          critical: tuple[float, float] = (0.0, 0.0), *, overlap: bool = True) -> float:
        """Hits on the GPU, misses (and critical residuals) on the CPU: (distinct experts, token uses) each. With
        overlap the two run at the same time (RESplit's design), else one after the other (stock llama.cpp)."""
        g = self.gpu_experts_s(*gpu) if gpu[0] else 0.0
        c = (self.cpu_experts_s(*cpu) if cpu[0] else 0.0) + (self.cpu_residual_s(*critical) if critical[0] else 0.0)
        sync = 2 * self.machine.sync_s if c > 0 else 0.0
        return (max(g, c) if overlap else g + c) + sync

    def layer_gpu_centric(self, distinct: float, uses: float, demand_bytes: float, prefetch_bytes: float = 0.0,
                          window_s: float = 0.0) -> float:
        """Every expert computed on the GPU; demand copies wait in line before compute; prefetched copies are free up
        to the window (the previous layer's compute) and stall beyond it."""
        stall = max(0.0, self.copy_s(prefetch_bytes) - window_s) + self.copy_s(demand_bytes)
        return stall + self.gpu_experts_s(distinct, uses)

    def window_s(self, distinct: float, uses: float) -> float:
        """What a prefetch for layer l+1 can hide behind: layer l's expert compute and layer l+1's share of the
        resident parts (attention, router)."""
        return self.gpu_experts_s(distinct, uses) + self.resident_s(1) / max(1, self.model.n_moe)


def umia_costs(cost: CostModel, hit_rate: float) -> dict[str, float]:
    """The projected decode costs of UMIA's latency model R (umia/latency.py PhaseCosts fields, ms): one expert slot
    on the WQ path (a hit on the GPU, a miss on the CPU, weighted by hit_rate) and one critical slot's residual
    work; fixed_ms is the resident parts. For planning before any measurement; a calibrated model replaces it."""
    k = cost.model.k
    wq = hit_rate * cost.gpu_experts_s(1, 1) + (1 - hit_rate) * cost.cpu_experts_s(1, 1)
    return {"fixed_ms": 1e3 * cost.resident_s(1), "wq_ms": 1e3 * wq, "wr_ms": 1e3 * cost.cpu_residual_s(1, 1),
            "active_ms": 1e3 * 2 * cost.machine.sync_s / max(1, k)}
