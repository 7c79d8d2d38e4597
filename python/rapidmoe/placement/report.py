"""Plans as a readable side-by-side table (GPU and CPU bytes per part for each scheme) and as JSON."""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..atomic import write_text
from .planner import CPU, GPU, Plan
from .tensors import ModelShapes
from .units import format_size, gib


def _title(p: Plan) -> str:
    return {"resplit": "RESplit", "cpu-only": "RESplit CPU-only", "cpu-offload": "CPU offload",
            "full-gpu": "full GPU"}[p.scheme]


def _budget(v: int | None) -> str:
    return "unbounded" if v is None else format_size(v)


def _files(model: ModelShapes, p: Plan) -> str:
    stem = Path(model.name).name.removesuffix(".gguf").removesuffix(".wq")
    if p.scheme in ("resplit", "cpu-only"):
        return f"{stem}.wq.gguf --residual {stem}.wr.gguf -r 2"
    return f"{stem}-Q4_K_M.gguf"


def format_plans(model: ModelShapes, plans: list[Plan]) -> str:
    """One table: a row per part, GPU and CPU GiB per plan; then totals, fit, hit rate, notes and flags."""
    p0 = plans[0]
    lines = [f"{model.name}: {model.arch}, {model.params() / 1e9:.1f} B parameters ({model.active_params() / 1e9:.1f}"
             f" B active), {model.n_layer} layers ({p0.n_moe_layers} MoE) x {model.n_expert} experts, "
             f"top-{model.n_expert_used}",
             f"budgets: GPU {_budget(p0.gpu_mem)}, CPU {_budget(p0.cpu_mem)}; context {p0.n_ctx} tokens; "
             f"expert frequencies: {p0.frequency_source}; sizes in GiB"]
    parts: list[str] = []
    for p in plans:
        for r in p.rows:
            if r.part not in parts:
                parts.append(r.part)
    w = max(len(x) for x in [*parts, "GPU hit rate"]) + 2
    col = 20
    lines.append(" " * w + "".join(f"{_title(p)[:col - 2]:>{col}}" for p in plans))
    lines.append(" " * w + "".join(f"{'GPU':>{col // 2}}{'CPU':>{col // 2}}" for _ in plans))

    def cell(v: float) -> str:
        return f"{v:>{col // 2}.1f}" if v else f"{'-':>{col // 2}}"

    for part in parts:
        lines.append(f"{part:<{w}}" + "".join(cell(gib(p.device_bytes(GPU, part)))
                                            + cell(gib(p.device_bytes(CPU, part))) for p in plans))
    lines.append(f"{'total':<{w}}" + "".join(cell(gib(p.vram)) + cell(gib(p.dram)) for p in plans))
    lines.append(f"{'fits':<{w}}" + "".join(f"{'yes' if p.fits else 'NO':>{col}}" for p in plans))
    lines.append(f"{'experts on GPU':<{w}}" + "".join(
        f"{f'{p.experts_on_gpu}/{p.n_moe_layers * p.n_expert}':>{col}}" for p in plans))
    lines.append(f"{'GPU hit rate':<{w}}" + "".join(f"{p.hit_rate:>{col}.1%}" for p in plans))
    for p in plans:
        lines.append(f"{_title(p)}, {p.types}:")
        for msg in p.problems:
            lines.append(f"  does not fit: {msg}")
        lines.append(f"  host memory after load (RSS): {gib(p.resident):.2f} GiB = {gib(p.dram_anon + p.runtime):.2f} "
                     f"anonymous (repacked weights, KV cache, tokenizer) + {gib(p.dram_file):.2f} file-backed "
                     "(weights used in place from the mapped .gguf files: clean pages, which a cgroup's limit counts)")
        if p.cache_dram:
            lines.append(f"  with the per-expert cache (run --gpu-mem on a GPU): {gib(p.resident_cached):.2f} GiB, "
                         f"{gib(p.cache_dram_file):.2f} of them file-backed (every expert stays in host memory, plain)")
        for note in p.notes:
            lines.append(f"  note: {note}")
        real = p.realization
        lines.append(f"  rapidmoe-cli run {_files(model, p)} {' '.join(real.args)}"
                     + (f"  ({real.note})" if real.note else "")
                     + ("" if real.exact else f"  [GPU hit rate {real.hit_rate:.1%}]"))
    return "\n".join(lines)


def write_json(plans: list[Plan], model: ModelShapes, path: str | os.PathLike[str],
               extra: dict[str, object] | None = None) -> Path:
    doc = {"model": model.name, "arch": model.arch, "params": model.params(), "active_params": model.active_params(),
           "plans": [p.to_dict() for p in plans], **(extra or {})}
    return write_text(path, json.dumps(doc, indent=1) + "\n")
