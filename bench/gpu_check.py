#!/usr/bin/env python3
"""The Python driver of bench/gpu_check.sh: GPU-path correctness and speed against stock-style CPU offload.

On a machine with one NVIDIA GPU (package built with CUDA): makes a synthetic qwen3moe, its Q4_K_M (the stock
baseline) and a RESplit pair (preset cpu-q8: Q8_0 attention, one CPU kernel for every placement), then
  1. correctness: logits of the GPU path (WQ on the GPU with -ngl, sidecar in CPU memory) vs the CPU path
     (-ngl 0), at r = 0, 1, 2 and under a UMIA policy; and of stock-graph Q4_K_M with `-ot exps=CPU` vs CPU;
  2. speed: prefill and decode tokens/s of "stock" (our build on the plain Q4_K_M file: no sidecar, so every
     hook returns its input and the graph is stock llama.cpp's) with -ngl 99 -ot exps=CPU, vs ours with all
     WQ on the GPU at fixed r = 0, 1, 2 and with a UMIA policy;
  3. overlap: ours at each r twice, with the residual work after the GPU's (overlap "off") and on the residual
     worker while the GPU computes ("auto"), the decode overlap timing (worker, device, wall per token) and the
     serial CPU residual cost (decode time at r minus at r = 0, overlap off; docs/execution.md).
It writes a markdown table and JSON. `--cpu` runs the same steps with -ngl 0 (tiny sizes, no GPU): the test.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

PROMPT = ("The mixture of experts routes every token to a few experts; the rest of the network is dense. " * 40)


def quantize_q4_k_m(src: Path, dst: Path, threads: int) -> Path:
    from rapidmoe._runtime import llama_cpp

    if not dst.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = threads
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize failed ({rc})")
    return dst


def logits(path: Path, toks: list[int], threads: int, **kw) -> np.ndarray:  # type: ignore[no-untyped-def]
    from rapidmoe import Llama

    llm = Llama(path, n_ctx=512, logits_all=True, verbose=False, n_threads=threads, **kw)
    try:
        llm.eval(toks)
        return np.array(llm.scores[: len(toks)], dtype=np.float64)
    finally:
        llm.close()


def speed(path: Path, n_prompt: int, n_gen: int, threads: int, **kw) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Prefill tokens/s over n_prompt tokens, then decode tokens/s over n_gen greedy tokens (wall clock)."""
    from rapidmoe import Llama

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
        if kw.get("expert_cache"):
            out["cache_hit_rate"] = llm.expert_cache_stats().hit_rate  # prompt and generated tokens
            policy = kw.get("expert_cache_policy", "static")
            if policy == "lru":  # experts copied host -> device per decoded token (prompt copies included)
                out["cache_copies_per_token"] = sum(llm.expert_cache_copies().values()) / (len(toks) + n_gen)
            elif policy == "rapidmoe":
                out["cache_copies_per_token"] = llm.expert_cache_refresh_stats().swaps / (len(toks) + n_gen)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "bench" / "out" / "gpu-check")
    ap.add_argument("--size", default="bench", help="synthetic size (tiny/small/bench)")
    ap.add_argument("--n-layer", type=int, default=12, help="layers of the synthetic model (0: the size's own)")
    ap.add_argument("--gpu-budget-gib", type=float, default=1.5, help="the GPU memory budget imposed (GiB)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--cpu", action="store_true", help="no GPU: the same steps with -ngl 0 (the driver's test)")
    ap.add_argument("--out", type=Path, default=None, help="markdown table (default: WORKDIR/gpu_check.md)")
    args = ap.parse_args()

    from common import ensure_synthetic, kl_stats

    from rapidmoe.resplit import convert, get_preset
    from rapidmoe.umia import Policy

    wd = args.workdir
    wd.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    over = {"n_layer": args.n_layer} if args.n_layer else {}
    f16 = ensure_synthetic(wd / f"qwen3moe-{args.size}-{args.n_layer}.gguf", "qwen3moe", args.size, **over)
    q4 = quantize_q4_k_m(f16, wd / f"{f16.stem}.q4_k_m.gguf", args.threads)
    split_dir = wd / f"{f16.stem}.cpu-q8"
    wq, wr = split_dir / f"{f16.stem}.wq.gguf", split_dir / f"{f16.stem}.wr.gguf"
    if not (wq.exists() and wr.exists()):
        res = convert(f16, split_dir, get_preset("cpu-q8"), progress=False)
        wq, wr = res.wq_path, res.wr_path
    t_prep = time.time() - t0
    budget = int(args.gpu_budget_gib * 2**30)
    sizes = {p.name: p.stat().st_size for p in (f16, q4, wq, wr)}

    gpu = 0 if args.cpu else 99
    from rapidmoe import Llama

    vocab = Llama(wq, n_ctx=64, vocab_only=True, verbose=False)
    toks = vocab.tokenize(PROMPT.encode(), add_bos=False)[:64]
    vocab.close()
    policy = Policy(theta=0.6, alpha=0.5, beta=0.25)
    k = 8 if args.size == "bench" else 4

    checks: list[dict[str, object]] = []
    ref = logits(f16, toks, args.threads)
    # with -ngl 0 (the dry run) "auto" would not overlap: force the overlapped graph there
    overlapped = "on" if args.cpu else "auto"
    for label, cfg in [("r=0", {"n_critical": 0}), ("r=1", {"n_critical": 1}), ("r=2", {"n_critical": 2}),
                       ("UMIA", {"policy": policy})]:
        cpu = logits(wq, toks, args.threads, residual_path=wr, overlap="off", **cfg)
        for mode in ("off", overlapped):
            dev = logits(wq, toks, args.threads, residual_path=wr, n_gpu_layers=gpu, overlap=mode, **cfg)
            checks.append({"variant": f"ours {label}, overlap {mode}", "rel_gpu_vs_cpu": rel(dev, cpu),
                           **kl_stats(ref, dev)})
    # per-expert WQ cache: the planner's cache for a budget holding about half the routed WQ, realized per expert on
    # the GPU (the dry run: on the CPU device) with --gpu-mem's function, misses from the stacked tensors on the CPU
    from rapidmoe.placement import GPU as PLAN_GPU
    from rapidmoe.placement.realize import plan_for_model, realize
    from rapidmoe.placement.tensors import ROUTED

    whole = plan_for_model(wq, wr, gpu_mem=None, n_ctx=512, reserve=0)
    half = plan_for_model(wq, wr, gpu_mem=whole.vram - whole.device_bytes(PLAN_GPU, ROUTED) // 2, n_ctx=512,
                          reserve=0)
    cache_kw = {k2: v for k2, v in realize(half, cache_device="CPU" if args.cpu else "CUDA0").items() if k2 != "n_ctx"}
    cache_label = f"ours r=2, per-expert WQ cache ({half.hit_rate:.0%} planned hits), misses on CPU"
    # the runtime cache policies on the same cache (docs/execution.md, "Expert caching"): refreshed from running
    # counts, and GPU-centric LRU loading of each ubatch's missing experts
    policy_labels = {"rapidmoe": "ours r=2, WQ cache refreshed (rapidmoe policy), misses on CPU",
                     "lru": "ours r=2, WQ cache loaded on demand (lru policy), overflow on CPU"}
    if "expert_cache" in cache_kw:
        cpu = logits(wq, toks, args.threads, residual_path=wr, overlap="off", n_critical=2)
        dev = logits(wq, toks, args.threads, residual_path=wr, n_critical=2, **cache_kw)
        checks.append({"variant": cache_label, "rel_gpu_vs_cpu": rel(dev, cpu), **kl_stats(ref, dev)})
        for pol, label in policy_labels.items():
            dev = logits(wq, toks, args.threads, residual_path=wr, n_critical=2, expert_cache_policy=pol, **cache_kw)
            checks.append({"variant": label, "rel_gpu_vs_cpu": rel(dev, cpu), **kl_stats(ref, dev)})
    cpu = logits(q4, toks, args.threads)
    dev = logits(q4, toks, args.threads, n_gpu_layers=gpu, override_tensor="exps=CPU")
    checks.append({"variant": "stock Q4_K_M -ot exps=CPU", "rel_gpu_vs_cpu": rel(dev, cpu), **kl_stats(ref, dev)})

    runs: list[dict[str, object]] = []
    runs.append({"variant": "stock Q4_K_M, -ngl 99 -ot exps=CPU",
                 **speed(q4, args.prompt, args.gen, args.threads, n_gpu_layers=gpu, override_tensor="exps=CPU")})
    for label, cfg in [("r=0", {"n_critical": 0}), ("r=1", {"n_critical": 1}), ("r=2", {"n_critical": 2}),
                       (f"r={k}", {"n_critical": k}), ("UMIA", {"policy": policy})]:
        for mode in ("off", overlapped):
            runs.append({"variant": f"ours {label}, WQ -ngl 99, sidecar CPU, overlap {mode}", "overlap": mode,
                         **speed(wq, args.prompt, args.gen, args.threads, residual_path=wr, n_gpu_layers=gpu,
                                 overlap=mode, **cfg)})
    if "expert_cache" in cache_kw:
        runs.append({"variant": cache_label,
                     **speed(wq, args.prompt, args.gen, args.threads, residual_path=wr, n_critical=2, **cache_kw)})
        for pol, label in policy_labels.items():
            runs.append({"variant": label, "cache_policy": pol,
                         **speed(wq, args.prompt, args.gen, args.threads, residual_path=wr, n_critical=2,
                                 expert_cache_policy=pol, **cache_kw)})
    base = float(runs[1]["decode_ms_per_token"])  # type: ignore[arg-type]  # ours r=0, overlap off
    for r in runs[1:]:
        if r.get("overlap") == "off":
            r["serial_cpu_residual_ms"] = float(r["decode_ms_per_token"]) - base  # type: ignore[arg-type]

    md = [f"# gpu_check ({'CPU dry run, -ngl 0' if args.cpu else 'GPU'}; {args.size} qwen3moe, "
          f"{args.n_layer or 'all'} layers; prep {t_prep:.0f} s)", "",
          f"GPU budget imposed: {args.gpu_budget_gib} GiB. Files: "
          + ", ".join(f"{n} {s / 2**30:.2f} GiB{' (> budget)' if s > budget else ''}" for n, s in sizes.items()), "",
          "| variant | rel. logits GPU path vs CPU path | KL vs F16 | top-1 same |", "|---|---|---|---|"]
    md += [f"| {c['variant']} | {c['rel_gpu_vs_cpu']:.2e} | {c['kl_mean']:.4f} | {c['top1_same']:.2f} |" for c in checks]
    nan = float("nan")
    md += ["", f"| variant | prefill tok/s ({args.prompt}) | decode tok/s ({args.gen}) | decode ms/token | "
           "serial CPU residual ms/token (vs r=0) | overlap worker / device / wall / hidden ms/token |",
           "|---|---|---|---|---|---|"]
    md += [f"| {r['variant']}{' (%.0f%% realized)' % (100 * r['cache_hit_rate']) if 'cache_hit_rate' in r else ''}"
           f"{', %.2f experts copied/token' % r['cache_copies_per_token'] if 'cache_copies_per_token' in r else ''} | {r['prefill_tps']:.1f} | {r['decode_tps']:.1f} | {r['decode_ms_per_token']:.2f} | "
           f"{r.get('serial_cpu_residual_ms', nan):.2f} | "
           + (" / ".join(f"{r[f'overlap_{f}_ms']:.2f}" for f in ("cpu", "device", "wall", "hidden"))
              if r.get("overlap_pairs") else "-") + " |" for r in runs]
    md += ["", "Overlap off: the CPU residual work runs after the GPU's work of each layer (serial column). Overlap "
           f"{overlapped}: on the residual worker while the GPU computes WQ (worker = its matmuls, device = begin "
           "returned to join started, wall = the two stages as the layers saw them, hidden = worker + device - "
           "wall; docs/execution.md)."]
    out = args.out or wd / "gpu_check.md"
    out.write_text("\n".join(md) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"checks": checks, "runs": runs, "sizes": sizes}, indent=1))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
