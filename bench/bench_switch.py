#!/usr/bin/env python3
"""Decode (and prefill) speed with one of our kernel switches on and off, in one process: the switch (an
environment variable such as RAPIDMOE_FA_DECODE or RAPIDMOE_MOE_SUM) is read by its op at each call, so both
settings alternate on one loaded model (pairs of timed runs in alternating order, each after the same context),
which cancels most of a shared machine's drift.

  python bench/bench_switch.py [--switch RAPIDMOE_FA_DECODE] [--preset cpu-fast] [--r 1] [--depths 8,1024,3072]
      [--reps 6] [--tg 32] [--pp 512]

Uses a split pair bench_frontier.py made (bench/out/frontier-work/STEM.PRESET/, or --work's); prints, per context
length, both settings' median decode tokens/s and the median of the per-pair ratios (on / off), with --pp also a
prompt batch's tokens/s, and writes them to --out as JSON. The switch's "off" value is --off (default 0); "on" is the
variable unset (our default), or --on's value (two settings of a threshold: --switch RAPIDMOE_TINY_RUN --on 8192
--off 4096).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / "out" / "frontier-work"


def _set(var: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(var, None)
    else:
        os.environ[var] = value


def _pairs(reps: int, on: str | None, off: str) -> list[tuple[str, str | None]]:
    """The settings of each timed pair, in alternating order: (label, value of the variable)."""
    order: list[tuple[str, str | None]] = []
    for rep in range(reps):
        pair: list[tuple[str, str | None]] = [("on", on), ("off", off)]
        order += pair if rep % 2 == 0 else pair[::-1]
    return order


def _summary(tps: dict[str, list[float]]) -> dict[str, Any]:
    ratio = statistics.median(a / b for a, b in zip(tps["on"], tps["off"], strict=True))
    return {"on_tps": statistics.median(tps["on"]), "off_tps": statistics.median(tps["off"]), "ratio": ratio,
            "all": tps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch", default="RAPIDMOE_FA_DECODE", help="the environment variable our op reads per call")
    ap.add_argument("--off", default="0", help="the variable's value that switches our op off")
    ap.add_argument("--on", default=None, help="the variable's value for 'on' (default: unset)")
    ap.add_argument("--model-stem", default="synthetic-qwen3moe-bench")
    ap.add_argument("--work", type=Path, default=WORK, help="the folder of the pairs (STEM.PRESET/STEM.wq.gguf)")
    ap.add_argument("--preset", default="cpu-fast")
    ap.add_argument("--r", type=int, default=1)
    ap.add_argument("--depths", default="8,1024,3072", help="context lengths before the timed decode steps")
    ap.add_argument("--reps", type=int, default=6, help="timed pairs per context length")
    ap.add_argument("--tg", type=int, default=32, help="decode steps a timed run")
    ap.add_argument("--pp", type=int, default=0, help="also time prompt batches of this many tokens (0: no)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="JSON (default bench/out/switch-VAR.json)")
    args = ap.parse_args()
    from rapidmoe import Llama  # noqa: PLC0415  (loads the compiled library: after --help)

    pair = args.work / f"{args.model_stem}.{args.preset}"
    depths = [int(x) for x in args.depths.split(",") if x]
    wq, wr = pair / f"{args.model_stem}.wq.gguf", pair / f"{args.model_stem}.wr.gguf"
    llm = Llama(model_path=str(wq), residual_path=str(wr), n_critical=args.r,
                n_ctx=max(max(depths) + args.tg, args.pp) + 16, n_batch=512, n_ubatch=512, n_threads=args.threads,
                n_threads_batch=args.threads, verbose=False, flash_attn="auto")
    rows = []
    for depth in depths:
        tps: dict[str, list[float]] = {"on": [], "off": []}
        for label, value in _pairs(args.reps, args.on, args.off):
            _set(args.switch, value)
            llm.reset()
            llm._ctx.kv_cache_clear()
            context = [1000 + i % 4000 for i in range(depth)]
            for i in range(0, depth, 512):
                llm.eval(context[i:i + 512])
            llm.eval([5])  # one untimed step, as llama-bench warms up
            t0 = time.perf_counter()
            for _ in range(args.tg):
                llm.eval([5])
            tps[label].append(args.tg / (time.perf_counter() - t0))
        _set(args.switch, None)
        rows.append({"depth": depth, **_summary(tps)})
        print(f"context {depth}: {args.switch} on {rows[-1]['on_tps']:.1f} tok/s, off {rows[-1]['off_tps']:.1f}, "
              f"per-pair median ratio {rows[-1]['ratio']:.3f}", flush=True)
    prefill = None
    if args.pp:
        tps = {"on": [], "off": []}
        llm._logits_all = False  # as llama-bench's pp: the prompt's last logits only
        toks = [1000 + i for i in range(args.pp)]
        warm_up = [("on", args.on), ("off", args.off)]  # the first pair: dropped below
        for label, value in [*warm_up, *_pairs(args.reps, args.on, args.off)]:
            _set(args.switch, value)
            llm.reset()
            llm._ctx.kv_cache_clear()
            t0 = time.perf_counter()
            llm.eval(toks)
            tps[label].append(args.pp / (time.perf_counter() - t0))
        _set(args.switch, None)
        prefill = _summary({k: v[1:] for k, v in tps.items()})
        print(f"prefill pp{args.pp}: on {prefill['on_tps']:.1f} tok/s, off {prefill['off_tps']:.1f}, "
              f"per-pair median ratio {prefill['ratio']:.3f}", flush=True)
    out = args.out or ROOT / "bench" / "out" / f"switch-{args.switch}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"switch": args.switch, "preset": args.preset, "r": args.r, "tg": args.tg,
                               "reps": args.reps, "rows": rows, "prefill": prefill}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
