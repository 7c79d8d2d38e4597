#!/usr/bin/env python3
"""The Python driver of bench/gpu_check.sh: GPU-path correctness and speed against stock-style CPU offload.

On a machine with one NVIDIA GPU (the package built with CUDA, tools/cuda_build_check.sh): makes a synthetic
qwen3moe, its Q4_K_M (the stock baseline) and a RESplit pair (preset cpu-q8: Q8_0 attention, one CPU kernel for
every placement), then runs SECTIONS in order, each adding exactness checks and/or speed runs:

  exactness   logits of the GPU path (WQ on the GPU with -ngl, sidecar in CPU memory) vs the CPU path (-ngl 0), at
              r = 0, 1, 2 and under a UMIA policy, residual work serial (overlap off) and overlapped; and of
              stock-graph Q4_K_M with `-ot exps=CPU` vs CPU (the yardstick: how far a GPU moves stock's logits)
  stock       prefill and decode tokens/s of "stock" (our build on the plain Q4_K_M file: no sidecar, so every hook
              returns its input and the graph is stock llama.cpp's) with -ngl 99 -ot exps=CPU
  ours        ours with all WQ on the GPU at r = 0, 1, 2, k and UMIA, overlap off and on, with the overlap timing
  cache       the planner's per-expert WQ cache for a budget of half the routed WQ (realized as --gpu-mem does),
              misses on the CPU: logits vs the CPU path and speed, under the static, rapidmoe and lru policies;
              moepic (split experts, tops up to half the WQ) and lru with its copies waited for at once
  concurrent  the half-WQ cache's hits (GPU), misses and residuals (CPU) serial vs concurrent: exactness, speed
  streaming   prefill with the cached layers' WQ streamed to the GPU from the latency model's threshold, on vs off
  umia-gpu    UMIA calibrated against this GPU's measured device terms (beta searched too) vs fixed r = 1, 2

A section is a function of Ctx listed in SECTIONS: it appends to ctx.checks / ctx.runs with the same keys as the other
sections (raising SectionSkipped where it does not apply to the model), and the --cpu assertions in
tests/ci/test_gpu_check.py cover it. Sections run in order within --budget-s: once the budget is spent the rest are
recorded as "skipped (time budget)". Writes gpu_check.md and gpu_check.json (checks, runs, sections, meta); exit
status 1 when an exactness check fails its tolerance. `--cpu` runs the same steps with -ngl 0 (tiny sizes, no GPU):
the test. `--site DIR` imports rapidmoe from the CUDA build installed there (tools/cuda_build_check.sh's
build/cuda/site) ahead of the interpreter's own install, normal or editable (tools/cuda_import_check.py's use_site),
and without --cpu requires a CUDA device; meta.rapidmoe records which package ran. rapidmoe and common (which imports
it) are therefore imported inside the functions, after use_package.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

PROMPT = ("The mixture of experts routes every token to a few experts; the rest of the network is dense. " * 40)


def quantize_q4_k_m(src: Path, dst: Path, threads: int) -> Path:
    from rapidmoe._runtime import llama_cpp  # noqa: PLC0415  (after use_package, for --site)

    if not dst.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = threads
        tmp = dst.with_suffix(".tmp")
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize failed ({rc})")
        tmp.replace(dst)
    return dst


def logits(path: Path, toks: list[int], threads: int, **kw: Any) -> np.ndarray:
    from rapidmoe import Llama  # noqa: PLC0415  (after use_package, for --site)

    llm = Llama(path, n_ctx=512, logits_all=True, verbose=False, n_threads=threads, **kw)
    try:
        llm.eval(toks)
        return np.array(llm.scores[: len(toks)], dtype=np.float64)
    finally:
        llm.close()


def speed(path: Path, n_prompt: int, n_gen: int, threads: int, **kw: Any) -> dict[str, float]:
    """Prefill tokens/s over n_prompt tokens, then decode tokens/s over n_gen greedy tokens (wall clock)."""
    from rapidmoe import Llama  # noqa: PLC0415  (after use_package, for --site)

    llm = Llama(path, n_ctx=n_prompt + n_gen + 8, n_batch=512, verbose=False, n_threads=threads, **kw)
    try:
        toks = llm.tokenize(PROMPT.encode(), add_bos=False)[:n_prompt]
        llm.eval(toks[:16])  # warm-up (first CUDA graphs, page faults)
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(toks)
        t1 = time.perf_counter()
        if llm.residual is not None:
            llm.overlap_stats(reset=True)
        for _ in range(n_gen):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        t2 = time.perf_counter()
        out: dict[str, float] = {"prefill_tps": len(toks) / (t1 - t0), "decode_tps": n_gen / (t2 - t1),
                                 "decode_ms_per_token": 1e3 * (t2 - t1) / n_gen}
        cache = llm.expert_cache
        if cache is not None:
            out["cache_hit_rate"] = cache.stats().hit_rate  # prompt and generated tokens
            policy = cache.policy
            if policy == "lru":  # experts copied host -> device per decoded token (prompt copies included)
                out["cache_copies_per_token"] = sum(cache.copies().values()) / (len(toks) + n_gen)
            elif policy == "rapidmoe":
                out["cache_copies_per_token"] = cache.refresh_stats().swaps / (len(toks) + n_gen)
            if policy in ("lru", "moepic"):  # host -> device MB per token, time the compute waited for copies
                n_all = len(toks) + n_gen
                out["cache_mb_per_token"] = sum(d + p for d, p in cache.bytes().values()) / n_all / 1e6
                out["cache_wait_ms_per_token"] = sum(cache.wait_us().values()) / n_all / 1e3
        if llm.residual is not None:  # per decoded token, both stages together
            st = llm.overlap_stats()
            stages = (st.gate_up, st.down)
            out.update({f"overlap_{f}_ms": sum(getattr(x, f"{f}_ms") for x in stages) / n_gen
                        for f in ("cpu", "device", "wall", "hidden")})
            out["overlap_pairs"] = st.pairs
        return out
    finally:
        llm.close()


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@dataclass
class Ctx:
    """What every section reads (models, tokens, reference logits, placement) and appends to (checks, runs)."""

    args: argparse.Namespace
    f16: Path
    q4: Path
    wq: Path
    wr: Path
    toks: list[int]
    ref: np.ndarray  # F16 logits on the CPU: the KL reference
    gpu: int  # -ngl of the "GPU path": 99, or 0 in the dry run
    overlapped: str  # the overlap mode compared with "off": "auto" on a GPU; "on" in the dry run (-ngl 0)
    k: int
    policy: Any  # rapidmoe.umia.Policy
    cache_device: str  # where the per-expert cache lives: "CUDA0", or "CPU" in the dry run
    checks: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)

    def check(self, variant: str, dev: np.ndarray, cpu: np.ndarray, **extra: Any) -> None:
        from common import kl_stats  # noqa: PLC0415  (after use_package, for --site)

        self.checks.append({"variant": variant, "rel_gpu_vs_cpu": rel(dev, cpu), **kl_stats(self.ref, dev), **extra})

    def speed(self, variant: str, path: Path, **kw: Any) -> dict[str, Any]:
        a = self.args
        row = {"variant": variant, **speed(path, a.prompt, a.gen, a.threads, **kw)}
        self.runs.append(row)
        return row


def section_exactness(ctx: Ctx) -> None:
    t = ctx.args.threads
    for label, cfg in [("r=0", {"n_critical": 0}), ("r=1", {"n_critical": 1}), ("r=2", {"n_critical": 2}),
                       ("UMIA", {"policy": ctx.policy})]:
        cpu = logits(ctx.wq, ctx.toks, t, residual_path=ctx.wr, overlap="off", **cfg)
        for mode in ("off", ctx.overlapped):
            dev = logits(ctx.wq, ctx.toks, t, residual_path=ctx.wr, n_gpu_layers=ctx.gpu, overlap=mode, **cfg)
            ctx.check(f"ours {label}, overlap {mode}", dev, cpu)
    cpu = logits(ctx.q4, ctx.toks, t)
    dev = logits(ctx.q4, ctx.toks, t, n_gpu_layers=ctx.gpu, override_tensor="exps=CPU")
    ctx.check("stock Q4_K_M -ot exps=CPU", dev, cpu, yardstick=True)


def section_stock(ctx: Ctx) -> None:
    ctx.speed("stock Q4_K_M, -ngl 99 -ot exps=CPU", ctx.q4, n_gpu_layers=ctx.gpu, override_tensor="exps=CPU")


def section_ours(ctx: Ctx) -> None:
    rows = []
    for label, cfg in [("r=0", {"n_critical": 0}), ("r=1", {"n_critical": 1}), ("r=2", {"n_critical": 2}),
                       (f"r={ctx.k}", {"n_critical": ctx.k}), ("UMIA", {"policy": ctx.policy})]:
        for mode in ("off", ctx.overlapped):
            rows.append(ctx.speed(f"ours {label}, WQ -ngl 99, sidecar CPU, overlap {mode}", ctx.wq, overlap=mode,
                                  residual_path=ctx.wr, n_gpu_layers=ctx.gpu, **cfg))
            rows[-1]["overlap"] = mode
    base = float(rows[0]["decode_ms_per_token"])  # ours r=0, overlap off
    for r in rows:
        if r["overlap"] == "off":
            r["serial_cpu_residual_ms"] = float(r["decode_ms_per_token"]) - base


def _half_cache(ctx: Ctx) -> tuple[dict[str, Any], str]:
    """The planner's per-expert WQ cache for a budget holding about half the routed WQ, realized per expert on the
    GPU (the dry run: on the CPU device) with --gpu-mem's function, and its planned hit rate; SectionSkipped when the
    plan keeps no per-expert cache."""
    from rapidmoe.placement import GPU as PLAN_GPU  # noqa: PLC0415  (after use_package, for --site)
    from rapidmoe.placement.realize import plan_for_model, realize  # noqa: PLC0415  (after use_package, for --site)
    from rapidmoe.placement.tensors import ROUTED  # noqa: PLC0415  (after use_package, for --site)

    whole = plan_for_model(ctx.wq, ctx.wr, gpu_mem=None, n_ctx=512, reserve=0)
    half = plan_for_model(ctx.wq, ctx.wr, gpu_mem=whole.vram - whole.device_bytes(PLAN_GPU, ROUTED) // 2, n_ctx=512,
                          reserve=0)
    kw = {k: v for k, v in realize(half, cache_device=ctx.cache_device).items() if k != "n_ctx"}
    if "expert_cache" not in kw:
        raise SectionSkipped("the half-WQ plan keeps no per-expert cache for this model")
    return kw, f"{half.hit_rate:.0%}"


def section_cache(ctx: Ctx) -> None:
    cache_kw, planned = _half_cache(ctx)
    t = ctx.args.threads
    variants = {"static": f"ours r=2, per-expert WQ cache ({planned} planned hits), misses on CPU",
                # the runtime cache policies on the same cache (docs/execution.md, "Expert caching"): refreshed from
                # running counts, and GPU-centric LRU loading of each ubatch's missing experts
                "rapidmoe": "ours r=2, WQ cache refreshed (rapidmoe policy), misses on CPU",
                "lru": "ours r=2, WQ cache loaded on demand (lru policy), overflow on CPU"}
    cpu = logits(ctx.wq, ctx.toks, t, residual_path=ctx.wr, overlap="off", n_critical=2)
    cache = cache_kw["expert_cache"]
    for pol, label in variants.items():
        kw = {**cache_kw, "expert_cache": dataclasses.replace(cache, policy=pol)}
        ctx.check(label, logits(ctx.wq, ctx.toks, t, residual_path=ctx.wr, n_critical=2, **kw), cpu)
    for pol, label in variants.items():
        kw = {**cache_kw, "expert_cache": dataclasses.replace(cache, policy=pol)}
        row = ctx.speed(label, ctx.wq, residual_path=ctx.wr, n_critical=2, **kw)
        if pol != "static":
            row["cache_policy"] = pol
    # MoEpic: experts split vertically, tops resident up to half the routed WQ bytes, the rest fetched
    # per ubatch with the next layer's predicted experts assembled ahead; and lru with its copies waited for at
    # once (ExpertCacheConfig(async_copies=False)): the transfer queue's overlap, as the compute's copy wait per token
    moepic_kw = _moepic_half(ctx, cache.device)
    label = "ours r=2, MoEpic split experts, tops up to half the WQ (moepic policy), overflow on CPU"
    ctx.check(label, logits(ctx.wq, ctx.toks, t, residual_path=ctx.wr, n_critical=2, **moepic_kw), cpu)
    row = ctx.speed(label, ctx.wq, residual_path=ctx.wr, n_critical=2, **moepic_kw)
    row["cache_policy"] = "moepic"
    row = ctx.speed("ours r=2, lru policy, copies waited for at once", ctx.wq, residual_path=ctx.wr, n_critical=2,
                    **{**cache_kw, "expert_cache": dataclasses.replace(cache, policy="lru", async_copies=False)})
    row["cache_policy"] = "lru-sync"


def _moepic_half(ctx: Ctx, device: str) -> dict[str, Any]:
    """moepic at half the routed WQ: split 0.5 (rounded to the down type's blocks), as many tops per layer as half
    the layer's expert bytes hold (every expert's at most)."""
    from rapidmoe.cache import ExpertCacheConfig, MoEpicSettings  # noqa: PLC0415  (after use_package, for --site)
    from rapidmoe.modelfile import read_model_info  # noqa: PLC0415  (after use_package, for --site)
    from rapidmoe.placement.cache.moepic import moe_layers_of, moepic_layers  # noqa: PLC0415  (after use_package, for --site)

    n_expert = read_model_info(ctx.wq).n_expert
    layers = moe_layers_of(ctx.wq)
    ml = moepic_layers(ctx.wq, layers, [0.5] * len(layers), [0] * len(layers), 0)
    caps = [min(n_expert, m.expert_bytes * n_expert // 2 // m.top_bytes) if m.top_bytes else 0 for m in ml]
    settings = MoEpicSettings([m.split for m in ml] or 0.5, caps)
    return {"n_gpu_layers": ctx.gpu, "override_tensor": "exps=CPU",
            "expert_cache": ExpertCacheConfig(device=device, policy="moepic", moepic=settings)}


def section_concurrent(ctx: Ctx) -> None:
    """In the layers with the per-expert cache (section cache's static half-WQ cache, r=2), the device's hits, the
    CPU's misses and the CPU's residuals serial (overlap off) vs concurrent (auto on a GPU; "on" in the dry run,
    whose cache is on the CPU): one exactness check per mode against the CPU path, one speed run per mode
    ("cache_concurrency": "serial" | "concurrent")."""
    cache_kw, planned = _half_cache(ctx)
    t = ctx.args.threads
    cpu = logits(ctx.wq, ctx.toks, t, residual_path=ctx.wr, overlap="off", n_critical=2)
    for mode, name in (("off", "serial"), (ctx.overlapped, "concurrent")):
        label = f"ours r=2, half-WQ cache ({planned} planned hits), hits/misses/residuals {name}"
        dev = logits(ctx.wq, ctx.toks, t, residual_path=ctx.wr, n_critical=2, overlap=mode, **cache_kw)
        ctx.check(label, dev, cpu, cache_concurrency=name)
        row = ctx.speed(label, ctx.wq, residual_path=ctx.wr, n_critical=2, overlap=mode, **cache_kw)
        row["cache_concurrency"] = name


def _stream_threshold(ctx: Ctx) -> tuple[int, str]:
    """The latency model's prefill streaming threshold for this model on the H200-like profile (r = 2), or stock
    llama.cpp's op-offload batch (32) when the model says streaming never pays."""
    from rapidmoe.placement.machine import load_machine  # noqa: PLC0415  (after use_package, for --site)
    from rapidmoe.placement.tensors import read_gguf_shapes  # noqa: PLC0415  (after use_package, for --site)
    from rapidmoe.resplit.presets import get_preset  # noqa: PLC0415  (after use_package, for --site)
    from rapidmoe.umia.profile import profile_terms  # noqa: PLC0415  (after use_package, for --site)

    prof = load_machine(ROOT / "bench" / "machines" / "h200.json")
    shapes = read_gguf_shapes(ctx.wq)
    thr = int(profile_terms(shapes, prof, get_preset("cpu-q8"), r=2.0)["stream_threshold"])
    if thr > 0:
        return thr, "latency model (h200 profile, r = 2)"
    return 32, "stock op offload's batch (the latency model says streaming never pays for this model)"


def section_streaming(ctx: Ctx) -> None:
    """Prefill of --prompt tokens with the half-WQ cache (r=2), the cached layers' WQ streamed to the GPU from the
    stacked experts for ubatches from the threshold on vs misses kept on the CPU: exactness vs the CPU path, prefill
    tok/s per mode ("prefill_streaming": "on" | "off"), and the threshold with its source."""
    cache_kw, planned = _half_cache(ctx)
    thr, source = _stream_threshold(ctx)
    n_stream = min(thr, max(2, ctx.args.prompt // 2))  # the prompt must reach it for the "on" run to stream
    t = ctx.args.threads
    cpu = logits(ctx.wq, ctx.toks, t, residual_path=ctx.wr, overlap="off", n_critical=2)
    for mode, n in (("off", 0), ("on", n_stream)):
        label = f"ours r=2, half-WQ cache ({planned} planned hits), prefill streaming {mode}"
        dev = logits(ctx.wq, ctx.toks, t, residual_path=ctx.wr, n_critical=2, prefill_stream=n, **cache_kw)
        ctx.check(label, dev, cpu, prefill_streaming=mode)
        row = ctx.speed(label, ctx.wq, residual_path=ctx.wr, n_critical=2, prefill_stream=n, **cache_kw)
        row.update(prefill_streaming=mode, stream_min_batch=n, stream_threshold=thr, stream_threshold_source=source)


def section_umia_gpu(ctx: Ctx) -> None:
    """calibrate-latency on this GPU (the device terms measured with half and all of the WQ cached), calibrate
    against it (beta searched too) on the driver's text, then decode/prefill tok/s and KL of the chosen policy vs
    fixed r = 1, 2, all with the half-WQ cache ("umia": "gpu-calibrated" | "fixed")."""
    from rapidmoe.calibration.measure import device_latency_model  # noqa: PLC0415  (after use_package, for --site)
    from rapidmoe.calibration.umia import calibrate  # noqa: PLC0415  (after use_package, for --site)

    cache_kw, planned = _half_cache(ctx)
    t = ctx.args.threads
    small = ctx.args.cpu
    lm = device_latency_model(ctx.wq, ctx.wr, device=cache_kw["expert_cache"].device, threads=t,
                              cache_fractions=(0.5, 1.0), repeats=1, decode_tokens=4 if small else 16,
                              prefill_batch=16 if small else 64, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "calib.txt"
        text.write_text(PROMPT)
        res = calibrate(ctx.wq, ctx.wr, text, lm, n_tokens=64 if small else 512, chunk=32 if small else 128,
                        alphas=(0.0, 0.5), levels=(1.5, 2.0), fixed_r=(1, 2), drop_r=(), cutoffs=(), refine=False,
                        threads=t, progress=False, betas=(0.0, 0.5, 1.0))
    chosen = res.policy
    cpu_cfg: dict[str, Any] = {"residual_path": ctx.wr, "overlap": "off"}
    for label, cfg, kind in (("UMIA calibrated on this device", {"policy": chosen}, "gpu-calibrated"),
                             ("fixed r=1", {"n_critical": 1}, "fixed"), ("fixed r=2", {"n_critical": 2}, "fixed")):
        name = f"ours {label}, half-WQ cache ({planned} planned hits)"
        cpu = logits(ctx.wq, ctx.toks, t, **cpu_cfg, **cfg)
        ctx.check(name, logits(ctx.wq, ctx.toks, t, residual_path=ctx.wr, **cfg, **cache_kw), cpu, umia=kind)
        row = ctx.speed(name, ctx.wq, residual_path=ctx.wr, **cfg, **cache_kw)
        row.update(umia=kind, policy=chosen.describe() if kind != "fixed" else label,
                   predicted_decode_ms=res.evaluations[res.chosen].predicted_ms if kind != "fixed" else None,
                   device_latency=lm.device.to_dict() if lm.device is not None else None)


class SectionSkipped(Exception):  # noqa: N818  (a section's outcome, recorded as its status; not an error)
    """A section that does not apply to this model or machine."""


SECTIONS: list[tuple[str, Callable[[Ctx], None]]] = [
    ("exactness", section_exactness), ("stock", section_stock), ("ours", section_ours), ("cache", section_cache),
    ("concurrent", section_concurrent), ("streaming", section_streaming), ("umia-gpu", section_umia_gpu)]


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "none"
    except (OSError, subprocess.TimeoutExpired):
        return "none"


def check_tolerance(checks: list[dict[str, Any]], cpu: bool) -> float:
    """Each check's ok: the dry run computes the same thing on both paths (rel == 0); on a GPU the kernels differ,
    so ours may move the logits as far as the GPU moves stock's (its yardstick check), times 3, at least 1e-3."""
    yard = [c["rel_gpu_vs_cpu"] for c in checks if c.get("yardstick")]
    tol = 0.0 if cpu else max(1e-3, 3 * max(yard, default=1e-2))
    for c in checks:
        c["ok"] = bool(c["rel_gpu_vs_cpu"] <= tol)
    return tol


def _variant_cell(r: dict[str, Any]) -> str:
    """A run's variant, with the cache's realized hit rate and experts copied per token where the run has them."""
    cell = str(r["variant"])
    if "cache_hit_rate" in r:
        cell += f" ({100 * r['cache_hit_rate']:.0f}% realized)"
    if "cache_copies_per_token" in r:
        cell += f", {r['cache_copies_per_token']:.2f} experts copied/token"
    return cell


def write_report(ctx: Ctx | None, args: argparse.Namespace, sections: list[dict[str, Any]], meta: dict[str, Any],
                 tol: float | None) -> Path:
    checks = ctx.checks if ctx else []
    runs = ctx.runs if ctx else []
    md = [f"# gpu_check ({'CPU dry run, -ngl 0' if args.cpu else 'GPU: ' + meta['gpu']}; {args.size} qwen3moe, "
          f"{args.n_layer or 'all'} layers; prep {meta.get('prep_s', 0):.0f} s, total {meta['total_s']:.0f} s)", ""]
    if meta.get("build"):
        b = meta["build"]
        md += [f"CUDA build: sm_{b.get('arch')}, nvcc {b.get('cuda')}, cuBLAS {b.get('cublas')}, compile+link "
               f"{b.get('build_s')} s ({b.get('jobs')} jobs), libggml-cuda.so {b.get('libggml_cuda_mb')} MB.", ""]
    if meta.get("sizes"):
        budget = int(args.gpu_budget_gib * 2**30)
        md += [f"GPU budget imposed: {args.gpu_budget_gib} GiB. Files: "
               + ", ".join(f"{n} {s / 2**30:.2f} GiB{' (> budget)' if s > budget else ''}"
                           for n, s in meta["sizes"].items()), ""]
    md += ["| section | status | seconds |", "|---|---|---|"]
    md += [f"| {s['name']} | {s['status']} | {s['seconds']:.1f} |" for s in sections]
    if checks:
        md += ["", f"| variant | rel. logits GPU path vs CPU path | ok (tol {tol:.1e}) | KL vs F16 | top-1 same |",
               "|---|---|---|---|---|"]
        md += [f"| {c['variant']} | {c['rel_gpu_vs_cpu']:.2e} | {'yes' if c['ok'] else 'NO'} | {c['kl_mean']:.4f} | "
               f"{c['top1_same']:.2f} |" for c in checks]
    nan = float("nan")
    if runs:
        md += ["", f"| variant | prefill tok/s ({args.prompt}) | decode tok/s ({args.gen}) | decode ms/token | "
               "serial CPU residual ms/token (vs r=0) | overlap worker / device / wall / hidden ms/token |",
               "|---|---|---|---|---|---|"]
        md += [f"| {_variant_cell(r)} | {r['prefill_tps']:.1f} | {r['decode_tps']:.1f} | "
               f"{r['decode_ms_per_token']:.2f} | {r.get('serial_cpu_residual_ms', nan):.2f} | "
               + (" / ".join(f"{r[f'overlap_{f}_ms']:.2f}" for f in ("cpu", "device", "wall", "hidden"))
                  if r.get("overlap_pairs") else "-") + " |" for r in runs]
        overlapped = ctx.overlapped if ctx else "auto"
        md += ["", "Overlap off: the CPU residual work runs after the GPU's work of each layer (serial column). "
               f"Overlap {overlapped}: on the residual worker while the GPU computes WQ (worker = its matmuls, device "
               "= begin returned to join started, wall = the two stages as the layers saw them, hidden = worker + "
               "device - wall; docs/execution.md)."]
    out = args.out or args.workdir / "gpu_check.md"
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text("\n".join(md) + "\n")
    tmp.replace(out)
    js = out.with_suffix(".json")
    tmp = js.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "sections": sections, "checks": checks, "runs": runs,
                               "sizes": meta.get("sizes", {}), "tolerance": tol}, indent=1))
    tmp.replace(js)
    print("\n".join(md))
    return out


def use_package(site: Path | None, need_cuda: bool) -> str:
    """Import rapidmoe (from site when given: tools/cuda_import_check.py's use_site) and return its folder;
    SystemExit when it is not the one asked for or, with need_cuda, when it sees no CUDA device."""
    if site is not None:
        sys.path.insert(0, str(ROOT / "tools"))
        from cuda_import_check import under, use_site  # noqa: PLC0415  (tools/, on sys.path only with --site)

        use_site(site)
    import rapidmoe  # noqa: PLC0415  (after use_package, for --site)
    from rapidmoe._runtime import _core  # noqa: PLC0415  (after use_package, for --site)

    where = Path(rapidmoe.__file__ or "?").resolve().parent
    if site is not None and not under(where, site.resolve()):
        raise SystemExit(f"gpu_check: imported rapidmoe from {where}, not from {site}")
    if need_cuda and not any(r == "CUDA" for _, _, _, r, _ in _core.devices()):
        raise SystemExit(f"gpu_check: the rapidmoe in {where} sees no CUDA device (is it the CUDA build?)")
    print(f"gpu_check: rapidmoe from {where}", file=sys.stderr, flush=True)
    return str(where)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "bench" / "out" / "gpu-check")
    ap.add_argument("--size", default="bench", help="synthetic size (tiny/small/bench)")
    ap.add_argument("--n-layer", type=int, default=12, help="layers of the synthetic model (0: the size's own)")
    ap.add_argument("--gpu-budget-gib", type=float, default=1.5, help="the GPU memory budget imposed (GiB)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--cpu", action="store_true", help="no GPU: the same steps with -ngl 0 (the driver's test)")
    ap.add_argument("--sections", default=",".join(n for n, _ in SECTIONS),
                    help=f"comma-separated subset of: {', '.join(n for n, _ in SECTIONS)}")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds for all sections together (those not started in time are skipped)")
    ap.add_argument("--build-info", type=Path, default=None, help="tools/cuda_build_check.sh's build_check.json")
    ap.add_argument("--site", type=Path, default=None,
                    help="import rapidmoe from this install prefix (the CUDA build's build/cuda/site), ahead of the "
                         "interpreter's own install")
    ap.add_argument("--out", type=Path, default=None, help="markdown table (default: WORKDIR/gpu_check.md)")
    args = ap.parse_args()
    known = dict(SECTIONS)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in wanted if s not in known]
    if bad:
        ap.error(f"unknown section {bad[0]!r} (known: {', '.join(known)})")

    # cpu-q8's Q8_0 attention stays plain, as it was when the preset was chosen for this check ("one CPU kernel for
    # every placement"): patch 0016 repacks Q8_0 on x86 in CPU_REPACK buffers only (another summation order), and
    # the exact --cpu checks of the cache modes then differ from the CPU path; Q6_K and Q3_K likewise (0017, 0021)
    os.environ.setdefault("RAPIDMOE_Q8_0_REPACK", "0")
    os.environ.setdefault("RAPIDMOE_Q6_K_REPACK", "0")
    os.environ.setdefault("RAPIDMOE_Q3_K_REPACK", "0")
    package = use_package(args.site, need_cuda=not args.cpu)

    from common import ensure_synthetic  # noqa: PLC0415  (after use_package, for --site)

    from rapidmoe import Llama  # noqa: PLC0415  (after use_package, for --site)
    from rapidmoe.resplit import convert, get_preset  # noqa: PLC0415  (after use_package, for --site)
    from rapidmoe.umia import Policy  # noqa: PLC0415  (after use_package, for --site)

    t_start = time.time()
    meta: dict[str, Any] = {"gpu": "none (dry run)" if args.cpu else gpu_name(), "host": platform.node(),
                            "cores": os.cpu_count(), "threads": args.threads, "python": platform.python_version(),
                            "argv": sys.argv[1:], "rapidmoe": package}
    try:
        meta["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    if args.build_info is not None and args.build_info.exists():
        meta["build"] = json.loads(args.build_info.read_text())
    wd = args.workdir
    wd.mkdir(parents=True, exist_ok=True)
    over = {"n_layer": args.n_layer} if args.n_layer else {}
    f16 = ensure_synthetic(wd / f"qwen3moe-{args.size}-{args.n_layer}.gguf", "qwen3moe", args.size, **over)
    q4 = quantize_q4_k_m(f16, wd / f"{f16.stem}.q4_k_m.gguf", args.threads)
    split_dir = wd / f"{f16.stem}.cpu-q8"
    wq, wr = split_dir / f"{f16.stem}.wq.gguf", split_dir / f"{f16.stem}.wr.gguf"
    if not (wq.exists() and wr.exists()):
        res = convert(f16, split_dir, get_preset("cpu-q8"), progress=False)
        wq, wr = res.wq_path, res.wr_path
    meta["prep_s"] = time.time() - t_start
    meta["sizes"] = {p.name: p.stat().st_size for p in (f16, q4, wq, wr)}
    vocab = Llama(wq, n_ctx=64, vocab_only=True, verbose=False)
    toks = vocab.tokenize(PROMPT.encode(), add_bos=False)[:64]
    vocab.close()
    ctx = Ctx(args=args, f16=f16, q4=q4, wq=wq, wr=wr, toks=toks, ref=logits(f16, toks, args.threads),
              gpu=0 if args.cpu else 99, overlapped="on" if args.cpu else "auto",
              k=8 if args.size == "bench" else 4, policy=Policy(theta=0.6, alpha=0.5, beta=0.25),
              cache_device="CPU" if args.cpu else "CUDA0")

    deadline = t_start + args.budget_s
    sections: list[dict[str, Any]] = []
    for name, fn in SECTIONS:
        t0 = time.time()
        if name not in wanted:
            status = "not selected"
        elif t0 > deadline:
            status = "skipped (time budget)"
        else:
            try:
                fn(ctx)
                status = "done"
            except SectionSkipped as e:
                status = f"skipped: {e}"
        sections.append({"name": name, "status": status, "seconds": time.time() - t0})
        print(f"gpu_check: section {name}: {status} ({time.time() - t0:.1f} s)", file=sys.stderr, flush=True)
    tol = check_tolerance(ctx.checks, args.cpu)
    meta["total_s"] = time.time() - t_start
    write_report(ctx, args, sections, meta, tol)
    failed = [c["variant"] for c in ctx.checks if not c["ok"]]
    if failed:
        print(f"gpu_check: {len(failed)} exactness check(s) beyond tolerance {tol:.1e}: {'; '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
