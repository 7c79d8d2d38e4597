"""From a plan to a loaded model: the plan for a model file as `run` and `serve` load it (its own tensor types, its
sidecar's preset), the plan's flags (Realization.args) as `rapidmoe.Llama` keyword arguments, and the one line
that says what was placed. Pure planning like the rest of the package: GGUF headers only, no device access.
"""
from __future__ import annotations

import os
from dataclasses import MISSING, fields
from typing import Any, TypedDict

from typing_extensions import NotRequired  # typing has it from Python 3.11

from ..errors import ModelFileError
from ..resplit.presets import Preset
from ..resplit.sidecar import read_sidecar_meta
from .cache.config import ExpertCacheConfig
from .frequency import load_frequency
from .planner import DEFAULT_RESERVE, NOT_EXPRESSIBLE, Plan, PlanError, plan
from .tensors import read_gguf_shapes
from .units import format_size

# Realization.args flag -> Llama keyword (the spellings `rapidmoe-cli run` accepts)
_INT_FLAGS = {"-ngl": "n_gpu_layers", "--n-gpu-layers": "n_gpu_layers", "--n-cpu-moe": "n_cpu_moe",
              "-ncmoe": "n_cpu_moe", "-c": "n_ctx", "--ctx-size": "n_ctx"}
_OT_FLAGS = ("-ot", "--override-tensor")


class LlamaPlacement(TypedDict):
    """rapidmoe.Llama keyword arguments that place a model (pass them with **)."""

    n_ctx: int
    n_gpu_layers: int
    n_cpu_moe: int
    override_tensor: list[str] | None
    expert_cache: NotRequired[ExpertCacheConfig]  # per-expert WQ cache (rapidmoe.Llama): experts and device


def realize(p: Plan, cache_device: str | None = None) -> LlamaPlacement:
    """The plan as rapidmoe.Llama keyword arguments: n_ctx, n_gpu_layers, n_cpu_moe and override_tensor (a list,
    or None), always all four, with llama.cpp's defaults (0, 0, None) where a flag is absent. A plan that does
    not fit, or a flag this function does not know, is a PlanError (never ignored).

    A per-expert cache that flags can only coarsen to whole layers is realized exactly when `cache_device` (a
    device name such as "CUDA0", or a buffer type) is given: every layer on the device except the stacked
    routed-expert tensors (`-ngl 999 -ot exps=CPU`), and the planned experts' WQ copied to the device
    (`expert_cache`, an ExpertCacheConfig of the static policy); misses run on the CPU from the stacked tensors."""
    if not p.fits:
        raise PlanError(f"the placement plan for {p.model} does not fit: {'; '.join(p.problems)}")
    if cache_device is not None and not p.realization.exact and p.cached:
        return LlamaPlacement(n_ctx=p.n_ctx, n_gpu_layers=999, n_cpu_moe=0, override_tensor=["exps=CPU"],
                              expert_cache=ExpertCacheConfig(
                                  experts={il: list(v) for il, v in sorted(p.cached.items()) if v},
                                  device=cache_device))
    args = p.realization.args
    if len(args) % 2:
        raise PlanError(f"placement flags must come in flag/value pairs: {' '.join(args)}")
    ints = {"n_ctx": p.n_ctx, "n_gpu_layers": 0, "n_cpu_moe": 0}
    overrides: list[str] = []
    for flag, value in zip(args[::2], args[1::2], strict=True):
        if flag in _OT_FLAGS:
            overrides.append(value)
        elif flag in _INT_FLAGS:
            try:
                ints[_INT_FLAGS[flag]] = int(value)
            except ValueError:
                raise PlanError(f"placement flag {flag} needs an integer, got {value!r}") from None
        else:
            raise PlanError(f"cannot realize placement flag {flag!r} (known: "
                            f"{', '.join([*_INT_FLAGS, *_OT_FLAGS])})")
    return LlamaPlacement(n_ctx=ints["n_ctx"], n_gpu_layers=ints["n_gpu_layers"], n_cpu_moe=ints["n_cpu_moe"],
                          override_tensor=overrides or None)


def sidecar_preset(residual_path: str | os.PathLike[str]) -> Preset:
    """The preset a RESplit sidecar was made with, from its metadata (ModelFileError if it has none)."""
    meta = read_sidecar_meta(residual_path)
    names = [f.name for f in fields(Preset) if f"preset.{f.name}" in meta]
    # fields added later (mix) have defaults: a sidecar from before them records none
    missing = [f.name for f in fields(Preset) if f"preset.{f.name}" not in meta and f.default is MISSING]
    if missing:
        raise ModelFileError(f"sidecar {residual_path} does not record its preset ({', '.join(missing)} missing)")
    try:
        # optional fields (token_embd, output) are written as the string "None" when unset
        values: dict[str, Any] = {}
        for n in names:
            v = str(meta[f"preset.{n}"])
            values[n] = None if v == "None" else v
        return Preset(**values)
    except ValueError as e:
        raise ModelFileError(f"sidecar {residual_path} records an unusable preset: {e}") from None


def plan_for_model(model_path: str | os.PathLike[str], residual_path: str | os.PathLike[str] | None = None, *,
                   gpu_mem: int | None, n_ctx: int, reserve: int = DEFAULT_RESERVE,
                   frequency_path: str | os.PathLike[str] | None = None, cpu_mem: int | None = None) -> Plan:
    """The RESplit plan (expert cache, CPU-only fallback) for a model file as it will be loaded: tensors in the
    types the file stores, the sidecar sized from its recorded preset when one is attached, expert frequencies
    from `frequency_path` (uniform without)."""
    m = read_gguf_shapes(model_path)
    preset = sidecar_preset(residual_path) if residual_path is not None else None
    freq = load_frequency(frequency_path, m.moe_layers, m.n_layer, m.n_expert)
    return plan(m, "resplit", preset=preset, gpu_mem=gpu_mem, cpu_mem=cpu_mem, n_ctx=n_ctx, reserve=reserve,
                frequency=freq, as_stored=True)


def describe(p: Plan, placed: LlamaPlacement | None = None) -> str:
    """One line: scheme, budget, VRAM/DRAM planned, hit rate (planned and realized when the per-expert cache was
    coarsened to whole layers), the planner's notes and the flags; with `placed` from realize(p, cache_device),
    the per-expert cache as realized."""
    r = p.realization
    budget = "unbounded" if p.gpu_mem is None else format_size(p.gpu_mem)
    head = (f"placement: {p.scheme} plan for GPU budget {budget} ({p.types}; expert frequencies "
            f"{p.frequency_source}): VRAM {format_size(p.vram)}, DRAM {format_size(p.dram)} planned, "
            f"{p.experts_on_gpu}/{p.n_moe_layers * p.n_expert} experts on the GPU")
    parts = [head]
    if placed is not None and "expert_cache" in placed:
        cache_config = placed["expert_cache"]
        cache = cache_config.experts or {}
        parts += [f"GPU hit rate {p.hit_rate:.1%} planned: per-expert WQ cache on {cache_config.device} "
                  f"({sum(map(len, cache.values()))} experts in {len(cache)} layers; the stacked expert tensors "
                  "stay whole in host memory, so DRAM also holds the cached experts' WQ)",
                  "flags -ngl 999 -ot exps=CPU + expert cache"]
        return "; ".join(parts)
    if r.exact:
        parts.append(f"GPU hit rate {r.hit_rate:.1%}")
    else:
        parts.append(f"GPU hit rate {p.hit_rate:.1%} planned, {r.hit_rate:.1%} realized: the per-expert cache is "
                     "coarsened to whole layers (one stacked ffn_*_exps tensor per layer)")
    if r.note:
        parts.append(r.note)
    parts += [n for n in p.notes if not n.startswith(NOT_EXPRESSIBLE)]
    parts.append(f"flags {' '.join(r.args)}")
    return "; ".join(parts)
