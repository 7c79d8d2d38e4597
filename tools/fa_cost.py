#!/usr/bin/env python3
"""The flash-attention node alone, at context depth: our kernel against llama.cpp's, per KV cache type.

Compiles tools/fa_cost.cpp against our build's ggml (or --lib DIR, e.g. a copy of an older build's libraries for an
A/B) and times GGML_OP_FLASH_ATTN_EXT with the KV cache read from memory, the way a decode step (or a prompt batch
with --rows) at depth finds it. Each cell is the median of --reps runs taken in alternating order (the machines are
shared: read the ratios); "ours" is our kernel, "llama.cpp" the same library with RAPIDMOE_FA_DECODE=0.

  python tools/fa_cost.py [--depths 4096,16384] [--types f16,q8_0] [-t 2] [--reps 5] [--rows 1]
                          [--heads 16,4,128] [--lib DIR [--lib-name old]] [--no-upstream] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rapidmoe._runtime import LIB_DIR

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "tools" / "fa_cost.cpp"
INCLUDE = ROOT / "vendor" / "llama.cpp" / "ggml" / "include"


def compile_against(lib: Path, out: Path) -> Path:
    """fa_cost linked (rpath) to the ggml libraries in lib."""
    subprocess.run(["g++", "-O2", "-std=c++17", str(SRC), f"-I{INCLUDE}", f"-L{lib}", "-lggml", "-lggml-cpu",
                    "-lggml-base", f"-Wl,-rpath,{lib}", "-o", str(out)], check=True)
    return out


def run_once(exe: Path, depth: int, rows: int, kv: str, threads: int, heads: list[str], ours: bool) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "RAPIDMOE_FA_DECODE"}
    if not ours:
        env["RAPIDMOE_FA_DECODE"] = "0"
    reps = "3"
    out = subprocess.run([str(exe), str(depth), str(rows), kv, kv, str(threads), reps, *heads], capture_output=True,
                         text=True, env=env, check=True).stdout.split()
    return {"us": float(out[1]), "gb_per_s": float(out[3])}


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="4096,16384")
    ap.add_argument("--types", default="f16,q8_0", help="KV cache types (K and V alike): f16, q8_0")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=1, help="query rows: 1 a decode step, more a causal prompt batch")
    ap.add_argument("--heads", default="16,4,128", help="query heads, KV heads, head size (the bench model's)")
    ap.add_argument("--lib", type=Path, default=None, help="also time this ggml library folder (e.g. an older build)")
    ap.add_argument("--lib-name", default="other")
    ap.add_argument("--no-upstream", action="store_true", help="leave out llama.cpp's kernel")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    heads = args.heads.split(",")
    if len(heads) != 3:
        ap.error("--heads takes three numbers: query heads, KV heads, head size")
    with tempfile.TemporaryDirectory() as tmp:
        exes = {"ours": (compile_against(Path(LIB_DIR), Path(tmp) / "ours"), True)}
        if args.lib is not None:
            exes[args.lib_name] = (compile_against(args.lib, Path(tmp) / "other"), True)
        if not args.no_upstream:
            exes["llama.cpp"] = (exes["ours"][0], False)
        cells: dict[str, list[dict[str, float]]] = {}
        for rep in range(args.reps):
            order = [(d, kv, name) for d in args.depths.split(",") for kv in args.types.split(",") for name in exes]
            for d, kv, name in order if rep % 2 == 0 else order[::-1]:
                exe, ours = exes[name]
                cells.setdefault(f"{d} {kv} {name}", []).append(
                    run_once(exe, int(d), args.rows, kv, args.threads, heads, ours))
                print(f"rep {rep + 1} depth {d} {kv} {name}: {cells[f'{d} {kv} {name}'][-1]}", file=sys.stderr)
    what = "decode step" if args.rows == 1 else f"prompt batch of {args.rows} rows"
    print(f"FLASH_ATTN_EXT, {what}, heads {args.heads}, {args.threads} threads, median of {args.reps}; {cpu_name()}")
    print("| depth | KV | kernel | us a layer | GB/s |\n|---|---|---|---|---|")
    table = {}
    for key, runs in cells.items():
        us = statistics.median(r["us"] for r in runs)
        gb = statistics.median(r["gb_per_s"] for r in runs)
        table[key] = {"us": us, "gb_per_s": gb, "runs": runs}
        d, kv, name = key.split(" ", 2)
        print(f"| {d} | {kv} | {name} | {us:.0f} | {gb:.2f} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "threads": args.threads, "rows": args.rows,
                                         "heads": args.heads, "reps": args.reps, "cells": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
