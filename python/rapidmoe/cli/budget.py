"""`--gpu-mem` for `run` and `serve`: the placement the planner computes for the model, instead of -ngl /
--n-cpu-moe / -ot by hand; refuses both at once, and logs one line saying what was placed."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from ..placement.cache.config import CachePolicy, ExpertCacheConfig

if TYPE_CHECKING:
    from ..placement.realize import LlamaPlacement

log = logging.getLogger(__name__)

# the hand placement flags: command parameter name -> how the user spells it
_MANUAL = {"n_gpu_layers": "-ngl/--n-gpu-layers", "n_cpu_moe": "--n-cpu-moe", "override_tensor": "-ot/--override-tensor"}
_PLAN_ONLY = {"reserve": "--reserve", "freq": "--freq"}


def _given(ctx: typer.Context, names: dict[str, str]) -> list[str]:
    """The options of `names` that the command line (or an environment variable) set, as the user spells them."""
    given = []
    for name, flag in names.items():
        source = ctx.get_parameter_source(name)  # typer's own (vendored) click enum: compared by name
        if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP"):
            given.append(flag)
    return given


def check_cache_policy(policy: CachePolicy, place: LlamaPlacement) -> CachePolicy:
    """The cache policy for rapidmoe.Llama; a refreshing one needs the per-expert cache a GPU realizes."""
    if policy is not CachePolicy.static and "expert_cache" not in place:
        raise typer.BadParameter(f"{policy.value} refreshes a per-expert WQ cache, which --gpu-mem realizes only on "
                                 "a machine with a GPU and a budget below the model's WQ (here there is none)",
                                 param_hint="--cache-policy")
    return policy


def cache_placement(model: Path, place: LlamaPlacement, policy: CachePolicy, freq: Path | None) -> LlamaPlacement:
    """The placement with --cache-policy applied to the per-expert cache --gpu-mem realized (a refused policy is a
    usage error: check_cache_policy). moepic spends that cache's device memory on MoEpic's split experts instead
    (no experts listed, MoEpic's fixed point on the 24gb profile), logged in one line."""
    check_cache_policy(policy, place)
    cache = place.get("expert_cache")
    if cache is None:
        return place
    if policy is not CachePolicy.moepic:
        return {**place, "expert_cache": dataclasses.replace(cache, policy=policy)}
    from ..placement.cache.moepic import moepic_for_cache  # noqa: PLC0415  (lazy: keeps --help fast)

    settings = moepic_for_cache(model, cache.experts or {}, frequency_path=freq)
    log.info("moepic: split %s, tops per layer %s (the device memory of the planned cache, MoEpic's fixed point on "
             "the 24gb profile)", settings.split, settings.capacity)
    moepic = ExpertCacheConfig(device=cache.device, policy=CachePolicy.moepic, moepic=settings,
                               async_copies=cache.async_copies)
    return {**place, "expert_cache": moepic}


def gpu_devices() -> list[str]:
    """Names of the GPU devices llama.cpp would offload to here (none on a CPU-only machine or build)."""
    from .._runtime import _core  # noqa: PLC0415  (compiled part, loaded only when --gpu-mem asks for devices)

    return [name for name, _, kind, reg, _ in _core.devices() if reg != "RPC" and kind in ("gpu", "igpu")]


def placement(ctx: typer.Context, *, model: Path, residual: Path | None, ctx_size: int, gpu_mem: int | None,
              reserve: int | None, freq: Path | None, n_gpu_layers: int, n_cpu_moe: int,
              override_tensor: Sequence[str] | None) -> LlamaPlacement:
    """rapidmoe.Llama's n_ctx, n_gpu_layers, n_cpu_moe and override_tensor: the hand flags as given, or, with
    --gpu-mem, those of the planner's plan for MODEL (+ its sidecar), logged in one line."""
    if gpu_mem is None:
        extra = _given(ctx, _PLAN_ONLY)
        if extra:
            raise typer.BadParameter(f"{' and '.join(extra)} only appl{'y' if len(extra) > 1 else 'ies'} with "
                                     "--gpu-mem", param_hint=extra[0])
        return {"n_ctx": ctx_size, "n_gpu_layers": n_gpu_layers, "n_cpu_moe": n_cpu_moe,
                "override_tensor": list(override_tensor) if override_tensor else None}
    manual = _given(ctx, _MANUAL)
    if manual:
        raise typer.BadParameter(f"--gpu-mem computes the placement itself and cannot be combined with "
                                 f"{', '.join(manual)}; give either the budget or the flags", param_hint="--gpu-mem")
    from ..placement.planner import DEFAULT_RESERVE  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..placement.realize import describe, plan_for_model, realize  # noqa: PLC0415  (lazy: keeps --help fast)

    p = plan_for_model(model, residual, gpu_mem=gpu_mem, n_ctx=ctx_size,
                       reserve=DEFAULT_RESERVE if reserve is None else reserve, frequency_path=freq)
    devices = gpu_devices()
    # a GPU realizes a per-expert cache exactly (rapidmoe's expert cache); without one the flags coarsen it
    kw = realize(p, cache_device=devices[0] if devices else None)
    line = describe(p, kw)
    if kw["n_gpu_layers"] and not gpu_devices():
        line += ("; no GPU device here: llama.cpp runs every layer on the CPU, as it does with -ngl and no GPU "
                 "(no warning from llama.cpp)")
    log.setLevel(min(log.getEffectiveLevel(), logging.INFO))  # the line is part of the command's output
    log.info(line)
    return kw
