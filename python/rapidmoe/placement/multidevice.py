"""A plan across several devices (GPUs, or rpc-servers on other hosts: `run --rpc A,B`): llama.cpp gives each device a
contiguous run of layers (`-ngl` with `-ts`), each device needs its own reserve, and the output head goes with the
last layer. This splits a plan made for the devices' total budget into such runs, sized per layer from the tensor
shapes, and says which `-ts` realizes it. Pure planning, like the rest of the package.

Per layer, a device holds the layer's non-expert tensors (sized from the plan's GPU rows, shared out by each
layer's element count), its share of the KV cache, and the layer's routed experts where the plan's flags keep them
on the GPU (`-ngl 999`: every layer; `--n-cpu-moe N`: layers >= N; a per-expert cache has no multi-device
realization and is coarsened to whole layers as the flags are).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .footprint import Footprint
from .planner import GPU, Plan, PlanError
from .tensors import EMBEDDINGS, OUTPUT, ROUTED, ModelShapes
from .units import format_size


@dataclass(frozen=True)
class DeviceShare:
    index: int
    budget: int
    layers: tuple[int, ...]  # the contiguous run of layers it holds (empty: none)
    bytes: int  # planned bytes, its reserve included
    output_head: bool

    @property
    def fits(self) -> bool:
        return self.bytes <= self.budget


@dataclass(frozen=True)
class MultiDevicePlan:
    plan: Plan  # the single-budget plan that was split (made for the total, less the extra reserves and slack)
    shares: tuple[DeviceShare, ...]
    tensor_split: tuple[int, ...]  # -ts: layers per device, the output head counted with the last device's

    @property
    def fits(self) -> bool:
        return self.plan.fits and all(s.fits for s in self.shares)

    @property
    def args(self) -> tuple[str, ...]:
        """`run` flags: the plan's own (-ngl, --n-cpu-moe, -c) and -ts."""
        ts = ("-ts", ",".join(str(n) for n in self.tensor_split)) if self.tensor_split else ()
        return (*self.plan.realization.args, *ts)

    def table(self) -> str:
        lines = [f"across {len(self.shares)} devices (in -ts order: the --rpc servers as given, then local GPUs):",
                 f"{'device':<8}{'budget':>12}{'planned':>12}  layers"]
        for s in self.shares:
            run = f"{s.layers[0]}-{s.layers[-1]}" if s.layers else "none"
            lines.append(f"{s.index:<8}{format_size(s.budget):>12}{format_size(s.bytes):>12}  {run}"
                         + (" + output head" if s.output_head else "") + ("" if s.fits else "  DOES NOT FIT"))
        lines.append(f"flags: {' '.join(self.args)}")
        return "\n".join(lines)


def gpu_layer_bytes(model: ModelShapes, p: Plan, fp: Footprint) -> tuple[list[int], int]:
    """Bytes each layer puts on its device under plan p, and the output head's bytes."""
    n = model.n_layer
    per_layer_elems = [0] * n
    for t in model.tensors:
        if t.layer is not None and t.part not in (ROUTED, EMBEDDINGS, OUTPUT) and t.layer < n:
            per_layer_elems[t.layer] += t.n_elements
    shared = sum(r.bytes for r in p.rows if r.device == GPU and r.part not in (ROUTED, OUTPUT, "KV cache", "reserve"))
    total_elems = sum(per_layer_elems) or 1
    kv = model.kv_cache_bytes(p.n_ctx)
    args = dict(zip(p.realization.args[::2], p.realization.args[1::2], strict=False))
    first_gpu_experts = int(args.get("--n-cpu-moe", "0"))
    out = []
    for il in range(n):
        experts = fp.expert_bytes.get(il, 0) * model.n_expert if il >= first_gpu_experts else 0
        out.append(shared * per_layer_elems[il] // total_elems + kv // n + experts)
    return out, p.device_bytes(GPU, OUTPUT)


def split_layers(layer_bytes: Sequence[int], output_bytes: int, budgets: Sequence[int],
                 reserve: int) -> list[list[int]]:
    """Contiguous runs of layers, one per device in order: each device takes layers while they fit in its budget
    less its reserve (the last device also holds the output head); the last device takes whatever is left."""
    runs: list[list[int]] = [[] for _ in budgets]
    d, used = 0, reserve
    for il, b in enumerate(layer_bytes):
        while d < len(budgets) - 1 and used + b > budgets[d]:
            d, used = d + 1, reserve
        runs[d].append(il)
        used += b
    return runs


def plan_across(model: ModelShapes, budgets: Sequence[int], make_plan: Callable[[int], Plan], fp: Footprint,
                reserve: int) -> MultiDevicePlan:
    """Split `make_plan(total_budget) -> Plan` over devices with these budgets (bytes, in -ts order). The total
    planned for is the sum less one reserve per extra device and one largest layer per extra device (a device
    boundary wastes at most that), so the runs fit wherever the plan does."""
    if len(budgets) < 2:
        raise PlanError("a plan across devices needs at least two budgets")
    if any(b <= reserve for b in budgets):
        raise PlanError(f"every device budget must exceed the reserve ({format_size(reserve)})")
    total = sum(budgets) - (len(budgets) - 1) * reserve
    p = make_plan(total)
    if p.realization.args[:2] == ("-ngl", "0"):  # CPU-only: no layer on any device
        return MultiDevicePlan(p, tuple(DeviceShare(i, b, (), 0, False) for i, b in enumerate(budgets)), ())
    layer_bytes, head = gpu_layer_bytes(model, p, fp)
    slack = (len(budgets) - 1) * max(layer_bytes, default=0)
    if slack and total - slack > 0:
        p = make_plan(total - slack)
        layer_bytes, head = gpu_layer_bytes(model, p, fp)
    runs = split_layers(layer_bytes, head, budgets, reserve)
    shares = []
    for i, (run, budget) in enumerate(zip(runs, budgets, strict=True)):
        last = i == len(budgets) - 1
        shares.append(DeviceShare(i, budget, tuple(run), reserve + sum(layer_bytes[il] for il in run)
                                  + (head if last else 0), last))
    ts = [len(r) for r in runs]
    ts[-1] += 1  # llama.cpp counts the output layer as one more offloaded layer, on the last device
    return MultiDevicePlan(p, tuple(shares), tuple(ts))
