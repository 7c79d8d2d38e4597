"""UMIA's device terms from a machine profile: what `calibrate-latency --machine` prints and `plan` reports.

For a model shape (or a GGUF's header) and a machine profile (placement/machine.py: GPU memory and bandwidth, PCIe
bandwidth, CPU bandwidth, FLOP/s and cores), the planner's static per-expert cache for the profile's GPU memory
gives the hit rate; placement/cost.py's roofline gives the terms of umia/device.py for decode (one token per step)
and prefill (a batch per step); R follows for fixed r, serial and concurrent, with the prefill streaming
threshold. Projections, not measurements: a measured profile (or `calibrate-latency --device`,
calibration/measure.py's device_latency_model) replaces them.
"""
from __future__ import annotations

from typing import Any

from ..placement.cost import CostModel, ModelCosts
from ..placement.machine import MachineProfile, load_machine
from ..placement.planner import plan
from ..placement.shapes import get_shape_set
from ..placement.tensors import ModelShapes
from ..resplit.presets import Preset, get_preset
from .device import DeviceCosts, predict_ms, profile_costs, stream_threshold

PREFILL_BATCH = 512


def profile_terms(model: ModelShapes, machine: MachineProfile, preset: Preset, *, r: float = 2.0,
                  prefill_batch: int = PREFILL_BATCH, **plan_kw: Any) -> dict[str, Any]:
    """Hit rate (the planner's static cache on this machine; plan_kw: n_ctx, reserve, frequency as for `plan`),
    the decode and prefill terms and the streaming threshold at r critical slots per token."""
    p = plan(model, "resplit", preset=preset, gpu_mem=machine.gpu_mem, **plan_kw)
    cost = CostModel(machine, ModelCosts.of(model, preset))
    n_embd = next((t.shape[0] for t in model.tensors if t.name == "token_embd.weight"), 0)
    dec = profile_costs(cost, p.hit_rate, 1, n_embd)
    pre = profile_costs(cost, p.hit_rate, prefill_batch, n_embd)
    return {"machine": machine, "hit_rate": p.hit_rate, "decode": dec, "prefill": pre, "cost": cost,
            "n_moe": len(model.moe_layers), "k": model.n_expert_used, "prefill_batch": prefill_batch,
            "stream_threshold": stream_threshold(cost, p.hit_rate, r, n_embd), "n_embd": n_embd}


def _rows(t: dict[str, Any]) -> list[dict[str, Any]]:
    n_moe, k, h = t["n_moe"], t["k"], t["hit_rate"]
    rows = []
    for r in range(4):
        row: dict[str, Any] = {"r": r}
        for phase in ("decode", "prefill"):
            c: DeviceCosts = t[phase]
            rl = [float(r)] * n_moe
            row[f"{phase}_serial_ms"] = predict_ms(c, k, h, rl, overlap=False)
            row[f"{phase}_concurrent_ms"] = predict_ms(c, k, h, rl, overlap=True)
        row["prefill_stream_ms"] = predict_ms(t["prefill"], k, h, [float(r)] * n_moe, stream=True)
        rows.append(row)
    return rows


def profile_report(machine_spec: str, shapes: str, preset_name: str = "paper") -> dict[str, Any]:
    """The report for one profile (a built-in name or a JSON file) and a named shape set."""
    machine = load_machine(machine_spec)
    model = get_shape_set(shapes).model_shapes()
    t = profile_terms(model, machine, get_preset(preset_name))
    rows = _rows(t)
    md = [f"**{machine.name}** ({machine.gpu_mem / 2**30:.0f} GiB GPU at {machine.gpu_bw / 1e9:.0f} GB/s, PCIe "
          f"{machine.pcie_bw / 1e9:.0f} GB/s, CPU {machine.cpu_bw / 1e9:.0f} GB/s, {machine.cpu_cores} cores): "
          f"{shapes}, preset {preset_name}: planner's static cache hit rate {t['hit_rate']:.1%}; prefill streaming "
          f"from {t['stream_threshold'] or 'never'} tokens per ubatch (at r = 2).", "",
          "Terms (ms per token; hit/miss/wr per slot and layer): decode "
          + ", ".join(f"{k} {v:.4g}" for k, v in t["decode"].to_dict().items() if v is not None)
          + f"; prefill ({t['prefill_batch']}-token batches) "
          + ", ".join(f"{k} {v:.4g}" for k, v in t["prefill"].to_dict().items() if v is not None), "",
          "| r | decode ms/token serial | concurrent | tok/s concurrent | prefill ms/token serial | concurrent | "
          "streamed | prefill tok/s best |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        best = min(row["prefill_concurrent_ms"], row["prefill_stream_ms"])
        md.append(f"| {row['r']} | {row['decode_serial_ms']:.2f} | {row['decode_concurrent_ms']:.2f} | "
                  f"{1e3 / row['decode_concurrent_ms']:.1f} | {row['prefill_serial_ms']:.3f} | "
                  f"{row['prefill_concurrent_ms']:.3f} | {row['prefill_stream_ms']:.3f} | {1e3 / best:.0f} |")
    return {"machine": machine.to_dict(), "shapes": shapes, "preset": preset_name, "hit_rate": t["hit_rate"],
            "stream_threshold": t["stream_threshold"], "decode": t["decode"].to_dict(),
            "prefill": t["prefill"].to_dict(), "rows": rows, "markdown": "\n".join(md)}
