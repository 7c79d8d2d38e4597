#!/usr/bin/env python3
"""Per-weight cost of ggml's CPU decode kernels, in our build and in stock llama.cpp's (same pin, same flags).

Compiles tools/kernel_cost.cpp once against each build's ggml libraries and runs it:
  python tools/kernel_cost.py [--types q2_K,q4_K] [-t 2]      a table per build: us per node, ps per weight, GB/s
                                                              for the bench model's matmuls, weights from memory
  python tools/kernel_cost.py --check [--types q2_K,q4_K]     the same small matmuls in both builds; exit 0 when
                                                              every output is bit-identical
Patch 0006 gives the repacked Q2_K gemv our kernel: the table shows what it saves, the check that it changes no bit.
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

from stock_llama import STOCK, build_stock

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "tools" / "kernel_cost.cpp"
sys.path.insert(0, str(ROOT / "tools"))


def build_dirs(which: str) -> tuple[Path, Path]:
    """(ggml include dir, lib dir) of our build or the stock one (built on first use)."""
    if which == "ours":
        from rapidmoe._runtime import LIB_DIR  # noqa: PLC0415 - the compiled parts: only for our build

        return ROOT / "vendor" / "llama.cpp" / "ggml" / "include", LIB_DIR
    lib = build_stock(["llama"])
    return STOCK / "src" / "llama.cpp" / "ggml" / "include", lib


def compile_for(which: str, cache: Path) -> Path:
    inc, lib = build_dirs(which)
    key = hashlib.sha256(SRC.read_bytes() + str(lib).encode()).hexdigest()[:12]
    exe = cache / f"kernel_cost-{which}-{key}"
    if not exe.exists():
        tmp = exe.with_name(exe.name + ".tmp")
        subprocess.run(["g++", "-O2", "-std=c++17", str(SRC), f"-I{inc}", f"-L{lib}", "-lggml", "-lggml-base",
                        "-lggml-cpu", f"-Wl,-rpath,{lib}", "-o", str(tmp)], check=True)
        tmp.replace(exe)
    return exe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="q2_K,q4_K", help="ggml type names, comma-separated")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--builds", default="ours,stock", help="ours, stock, or ours,stock")
    ap.add_argument("--check", action="store_true", help="compare outputs bit for bit instead of timing")
    args = ap.parse_args()
    types = [t for t in args.types.split(",") if t]
    builds = [b for b in args.builds.split(",") if b]
    cache = ROOT / "build" / "kernel_cost"
    cache.mkdir(parents=True, exist_ok=True)
    exes = {b: compile_for(b, cache) for b in builds}
    if not args.check:
        for b, exe in exes.items():
            print(f"\n{b} build, {args.threads} threads:\n", flush=True)
            subprocess.run([str(exe), "time", str(args.threads), *types], check=True,
                           stderr=subprocess.DEVNULL)  # the repack buffer logs every tensor it repacks
        return 0
    if len(exes) != 2:
        ap.error("--check compares two builds: --builds ours,stock")
    with tempfile.TemporaryDirectory() as d:
        outs, ran = {}, {}
        for b, exe in exes.items():
            outs[b] = Path(d) / f"{b}.f32"
            ran[b] = subprocess.run([str(exe), "check", str(args.threads), str(outs[b]), *types], check=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout.split("\n")
        data = [p.read_bytes() for p in outs.values()]
    first, second = ran.values()
    same = data[0] == data[1] and len(data[0]) > 0 and first == second
    print("matmuls: " + "; ".join(x for x in first if x))
    print(f"{len(data[0]) // 4} output values: {'bit-identical' if same else 'DIFFERENT'} in {' and '.join(exes)}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
