#!/usr/bin/env python3
"""Where a decode step's growth with context depth goes: tools/profile_nodes.py at each depth, ours (a split pair)
and the same .wq.gguf the stock way (no sidecar, repack=False, every RAPIDMOE_* switch off), in alternating order,
each run under the cpu lock; per variant and depth the wall ms a token, the attention nodes' share (FLASH_ATTN_EXT,
or without flash attention the KQ / KQV matmuls and the softmax), the KV cache writes, and the rest of the graph,
each with its growth over depth 0.

Usage: python tools/profile_depth.py PAIR_DIR/STEM.wq.gguf [--residual WR -r 1] [--depths 0,4096,16384,32768]
       [-t 2] [--steps 32] [-ctk f16 -ctv f16] [--fa auto] [--reps 1] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

TOOL = Path(__file__).resolve().parent / "profile_nodes.py"
LOCK = Path("/work/cpu.lock")

# the attention of a decode step: flash attention's one node, or without it the KQ and KQV matmuls (f16/q8_0 cache
# views: no weight type of a model tensor) and their softmax
ATTENTION = {("MUL_MAT", "kq"), ("MUL_MAT", "kqv"), ("SOFT_MAX", "kq_soft_max")}
KV_WRITES = {"SET_ROWS", "CPY"}


def split(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Thread 0's us a token (compute + wait) in attention, KV writes and the rest."""
    out = {"attention": 0.0, "kv_write": 0.0, "rest": 0.0}
    for r in rows:
        us = r["compute0_us"] + r["wait0_us"]
        if r["op"] == "FLASH_ATTN_EXT" or (r["op"], r["name"]) in ATTENTION:
            out["attention"] += us
        elif r["op"] in KV_WRITES:
            out["kv_write"] += us
        else:
            out["rest"] += us
    return out


def run_one(model: Path, args: argparse.Namespace, depth: int, stock_way: bool,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "nodes.json"
        cmd = [sys.executable, str(TOOL), str(model), "-t", str(args.threads), "--steps", str(args.steps),
               "--depth", str(depth), "-ctk", args.cache_type_k, "-ctv", args.cache_type_v, "--fa", args.fa,
               "--top", "1000", "--json", str(out)]
        cmd += ["--stock-way"] if stock_way else ["--residual", str(args.residual), "-r", str(args.r)]
        if LOCK.exists() and not args.no_lock:
            cmd = ["flock", str(LOCK), *cmd]
        run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
        if run.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
        res = json.loads(out.read_text())
    return {"ms": res["ms_per_token"], **{k: v / 1e3 for k, v in split(res["rows"]).items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--residual", type=Path, default=None, help="our sidecar (default: the .wr.gguf beside MODEL)")
    ap.add_argument("-r", type=int, default=1)
    ap.add_argument("--depths", default="0,4096,16384,32768")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("-ctk", "--cache-type-k", default="f16")
    ap.add_argument("-ctv", "--cache-type-v", default="f16")
    ap.add_argument("--fa", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--ab", action="append", default=[], metavar="VAR",
                    help="also ours with this RAPIDMOE_* switch off (VAR=0), e.g. RAPIDMOE_FA_DECODE; repeatable")
    ap.add_argument("--no-stock-way", action="store_true", help="ours only")
    ap.add_argument("--reps", type=int, default=1, help="alternating passes over variants and depths (medians)")
    ap.add_argument("--no-lock", action="store_true", help="do not take /work/cpu.lock for each run")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.residual is None:
        args.residual = args.model.with_name(args.model.name.replace(".wq.gguf", ".wr.gguf"))
    depths = [int(x) for x in args.depths.split(",") if x]
    variants: dict[str, tuple[bool, dict[str, str]]] = {"ours": (False, {})}
    variants.update({f"ours, {var}=0": (False, {var: "0"}) for var in args.ab})
    if not args.no_stock_way:
        variants["stock way"] = (True, {})
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        order = [(v, d) for d in depths for v in variants]
        for v, d in order if rep % 2 == 0 else order[::-1]:
            res = run_one(args.model, args, d, *variants[v])
            runs.setdefault((v, d), []).append(res)
            print(f"rep {rep} {v} depth {d}: {res['ms']:.2f} ms a token (attention {res['attention']:.2f}, KV writes "
                  f"{res['kv_write']:.2f}, rest {res['rest']:.2f})", flush=True)
    table = {k: {f: statistics.median(r[f] for r in rs) for f in rs[0]} for k, rs in runs.items()}
    print(f"\n{args.model.name}, {args.threads} threads, KV {args.cache_type_k}/{args.cache_type_v}, fa {args.fa}, "
          f"{args.steps} steps, median of {args.reps}: ms a token (growth over depth 0)")
    print("| variant | depth | step ms | attention ms | KV writes ms | rest of the graph ms |")
    print("|---|---|---|---|---|---|")
    for v in variants:
        base = table[(v, depths[0])]
        for d in depths:
            x = table[(v, d)]
            cells = [f"{x[f]:.2f} (+{x[f] - base[f]:.2f})" if d != depths[0] else f"{x[f]:.2f}"
                     for f in ("ms", "attention", "kv_write", "rest")]
            print(f"| {v} | {d} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "threads": args.threads, "steps": args.steps,
                                         "kv": [args.cache_type_k, args.cache_type_v], "fa": args.fa,
                                         "runs": {f"{v}@{d}": rs for (v, d), rs in runs.items()},
                                         "median": {f"{v}@{d}": x for (v, d), x in table.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
