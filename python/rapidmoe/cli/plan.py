"""`rapidmoe-cli plan`: where each part of an MoE model goes under GPU/CPU memory budgets, for RESplit and the
all-Q4 baselines, from a GGUF's tensor shapes or a named shape set (deepseek-v3, qwen3-235b-a22b, ...)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import RapidMoEError


def plan(
    model: Annotated[Optional[Path], typer.Argument(help="MoE GGUF whose tensor shapes to plan for.",
                                                    show_default=False)] = None,
    shapes: Annotated[Optional[str], typer.Option("--shapes", help="Plan for a named shape set instead of a file: "
                                                  "deepseek-v3, deepseek-r1, qwen3-235b-a22b, qwen3-30b-a3b.")] = None,
    preset: Annotated[str, typer.Option("--preset", help="RESplit preset: paper, paper-residual, iq2, cpu, cpu-fast, cpu-q8, dense, refine, refine-hq, refine-q8.")] = "paper",
    gpu_mem: Annotated[Optional[str], typer.Option("--gpu-mem", help="GPU memory budget, e.g. 24GiB, 80GB, 0 "
                                                   "(default: unbounded, i.e. show what is needed); several "
                                                   "devices: one budget each, 24GiB,16GiB (in -ts order: --rpc "
                                                   "servers, then local GPUs).")] = None,
    cpu_mem: Annotated[Optional[str], typer.Option("--cpu-mem", help="CPU memory (DRAM) budget, e.g. 256GiB.")] = None,
    ctx_size: Annotated[int, typer.Option("--ctx-size", "--ctx", "-c", help="Context size (KV cache).", min=1)] = 4096,
    reserve: Annotated[str, typer.Option("--reserve", help="GPU memory kept free for compute buffers.")] = "1GiB",
    freq: Annotated[Optional[Path], typer.Option("--freq", help="Expert frequencies: .npy/.json counts "
                                                 "[layers, experts] or a GGUF imatrix (default: uniform).")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Also write the plans as JSON here.")] = None,
    machine: Annotated[Optional[str], typer.Option("--machine", help="Machine profile (24gb, 48gb, or a JSON file "
                                                   "of placement.machine.MachineProfile fields): also compare the "
                                                   "expert-caching schemes (stock, static, lru, moepic, rapidmoe) "
                                                   "by projected tok/s and pick one. Its GPU memory is the budget "
                                                   "unless --gpu-mem is given.")] = None,
    cache_policy: Annotated[Optional[str], typer.Option("--cache-policy", help="With --machine: use this scheme "
                                                        "instead of the fastest (stock, static, lru, moepic, "
                                                        "rapidmoe). The runtime realizes all but moepic, which is simulated "
                                                        "only.")] = None,
    r_critical: Annotated[int, typer.Option("--n-critical", "-r", help="With --machine: critical slots per token "
                                            "priced for the RESplit schemes.", min=0)] = 2,
) -> None:
    """Plan placement under memory budgets: VRAM and DRAM per part for RESplit (all WQ on the GPU if it fits, else
    the most frequently routed experts' WQ, misses on the CPU) and for the baselines (all-Q4 CPU-centric offload
    as with --n-cpu-moe, and full GPU), with the GPU hit rate and the `run` flags that realize each plan."""
    from ..placement import get_shape_set, load_frequency, parse_size, plan_all, read_gguf_shapes  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..placement.report import format_plans, write_json  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..resplit.presets import get_preset  # noqa: PLC0415  (lazy: keeps --help fast)

    if (model is None) == (shapes is None):
        raise RapidMoEError("give either a MODEL.gguf or --shapes NAME (not both)")
    try:
        p = get_preset(preset)
    except ValueError as e:
        raise RapidMoEError(str(e)) from e
    if cache_policy is not None and machine is None:
        raise typer.BadParameter("--cache-policy chooses among the schemes --machine compares; give --machine too",
                                 param_hint="--cache-policy")
    device_mems = [parse_size(v) for v in gpu_mem.split(",")] if gpu_mem is not None and "," in gpu_mem else None
    if device_mems is not None and machine is not None:
        raise typer.BadParameter("--machine compares schemes for one GPU; give one --gpu-mem", param_hint="--gpu-mem")
    if device_mems is not None:
        gpu_mem = None
    budgets = {k: None if v is None else parse_size(v) for k, v in (("gpu_mem", gpu_mem), ("cpu_mem", cpu_mem))}
    profile = None
    if machine is not None:
        from ..placement.machine import load_machine  # noqa: PLC0415  (lazy: keeps --help fast)

        profile = load_machine(machine)
        if budgets["gpu_mem"] is None:
            budgets["gpu_mem"] = profile.gpu_mem
        else:
            profile = profile.with_gpu_mem(budgets["gpu_mem"])
    m = read_gguf_shapes(model) if model is not None else get_shape_set(shapes or "").model_shapes()
    frequency = load_frequency(freq, m.moe_layers, m.n_layer, m.n_expert)
    extra: dict[str, object] = {}
    multi = None
    if device_mems is not None:
        from ..placement.footprint import footprint  # noqa: PLC0415  (lazy: keeps --help fast)
        from ..placement.multidevice import plan_across  # noqa: PLC0415  (lazy: keeps --help fast)
        from ..placement.planner import plan as plan_one  # noqa: PLC0415  (lazy: keeps --help fast)
        from ..placement.typeplan import resplit_types  # noqa: PLC0415  (lazy: keeps --help fast)

        multi = plan_across(m, device_mems, lambda total: plan_one(
            m, "resplit", preset=p, gpu_mem=total, cpu_mem=budgets["cpu_mem"], n_ctx=ctx_size,
            reserve=parse_size(reserve), frequency=frequency), footprint(m, resplit_types(p, m), p), parse_size(reserve))
        budgets["gpu_mem"] = multi.plan.gpu_mem  # the tables below: the plans for the budget that was split
        extra["devices"] = {"budgets": device_mems, "tensor_split": list(multi.tensor_split), "fits": multi.fits,
                            "args": list(multi.args), "shares": [s.__dict__ for s in multi.shares]}
    plans = plan_all(m, p, n_ctx=ctx_size, reserve=parse_size(reserve), frequency=frequency, **budgets)
    typer.echo(format_plans(m, plans))
    if multi is not None:
        typer.echo("RESplit " + multi.table())
    if profile is not None:
        from ..placement.schemes import compare_schemes  # noqa: PLC0415  (lazy: keeps --help fast)

        choice, _ = compare_schemes(m, profile, p, frequency=frequency, n_ctx=ctx_size, reserve=parse_size(reserve),
                                    r_critical=r_critical, cache_policy=cache_policy)
        typer.echo(f"expert caching on machine {profile.name} (GPU {profile.gpu_mem / (1 << 30):.1f} GiB, PCIe "
                   f"{profile.pcie_bw / 1e9:.0f} GB/s, CPU {profile.cpu_bw / 1e9:.0f} GB/s): PROJECTED by the cost "
                   "model (placement/cost.py), not measured")
        typer.echo(choice.table())
        extra = {"machine": profile.to_dict(), "cache_schemes": [e.__dict__ for e in choice.estimates],
                 "cache_policy": choice.chosen, "cache_policy_forced": choice.forced}
        from ..umia.profile import profile_terms  # noqa: PLC0415  (lazy: keeps --help fast)

        stream = profile_terms(m, profile, p, r=r_critical, n_ctx=ctx_size, reserve=parse_size(reserve),
                               frequency=frequency)["stream_threshold"]
        typer.echo(f"prefill streaming (latency model, r = {r_critical}): " + (
            f"ubatches of >= {stream} tokens compute the cached layers' WQ on the GPU from streamed experts "
            f"(Llama(prefill_stream={stream}))" if stream else "never pays on this machine (up to 4096 tokens)"))
        extra["prefill_stream"] = stream
    if json_out is not None:
        typer.echo(f"wrote {write_json(plans, m, json_out, extra)}")
