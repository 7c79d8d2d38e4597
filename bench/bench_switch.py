#!/usr/bin/env python3
"""Decode speed with our flash attention for one decode token (patch 0011) against llama.cpp's kernel, in one
process: RAPIDMOE_FA_DECODE is read at each call, so the two kernels alternate on one loaded model (pairs of
timed runs in alternating order, each after the same context), which cancels most of a shared machine's drift.

  python bench/bench_fa_decode.py [--preset cpu-fast] [--r 1] [--depths 8,1024,3072] [--reps 6] [--tg 32]

Uses a split pair bench_frontier.py made (bench/out/frontier-work/STEM.PRESET/); prints, per context length, both
kernels' median decode tokens/s and the median of the per-pair ratios, and writes them to --out as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / "out" / "frontier-work"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-stem", default="synthetic-qwen3moe-bench")
    ap.add_argument("--preset", default="cpu-fast")
    ap.add_argument("--r", type=int, default=1)
    ap.add_argument("--depths", default="8,1024,3072", help="context lengths before the timed decode steps")
    ap.add_argument("--reps", type=int, default=6, help="timed pairs per context length")
    ap.add_argument("--tg", type=int, default=32, help="decode steps a timed run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "fa-decode.json")
    args = ap.parse_args()
    from rapidmoe import Llama  # noqa: PLC0415  (loads the compiled library: after --help)

    pair = WORK / f"{args.model_stem}.{args.preset}"
    depths = [int(x) for x in args.depths.split(",") if x]
    wq, wr = pair / f"{args.model_stem}.wq.gguf", pair / f"{args.model_stem}.wr.gguf"
    llm = Llama(model_path=str(wq), residual_path=str(wr), n_critical=args.r, n_ctx=max(depths) + args.tg + 16,
                n_batch=512, n_ubatch=512, n_threads=args.threads, n_threads_batch=args.threads, verbose=False,
                flash_attn="auto")
    rows = []
    for depth in depths:
        tps: dict[str, list[float]] = {"ours": [], "upstream": []}
        for rep in range(args.reps):
            for kernel in ("ours", "upstream") if rep % 2 == 0 else ("upstream", "ours"):
                if kernel == "ours":
                    os.environ.pop("RAPIDMOE_FA_DECODE", None)
                else:
                    os.environ["RAPIDMOE_FA_DECODE"] = "0"
                llm.reset()
                llm._ctx.kv_cache_clear()
                context = [1000 + i % 4000 for i in range(depth)]
                for i in range(0, depth, 512):
                    llm.eval(context[i:i + 512])
                llm.eval([5])  # one untimed step, as llama-bench warms up
                t0 = time.perf_counter()
                for _ in range(args.tg):
                    llm.eval([5])
                tps[kernel].append(args.tg / (time.perf_counter() - t0))
        os.environ.pop("RAPIDMOE_FA_DECODE", None)
        ratio = statistics.median(a / b for a, b in zip(tps["ours"], tps["upstream"], strict=True))
        rows.append({"depth": depth, "ours_tps": statistics.median(tps["ours"]),
                     "upstream_tps": statistics.median(tps["upstream"]), "ratio": ratio, "all": tps})
        print(f"context {depth}: ours {rows[-1]['ours_tps']:.1f} tok/s, llama.cpp's kernel "
              f"{rows[-1]['upstream_tps']:.1f}, per-pair median ratio {ratio:.3f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"preset": args.preset, "r": args.r, "tg": args.tg, "reps": args.reps,
                                    "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
