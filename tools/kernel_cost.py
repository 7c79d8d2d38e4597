#!/usr/bin/env python3
"""Per-weight cost of ggml's CPU decode kernels, in our build and in stock llama.cpp's (same pin, same flags).

Compiles tools/kernel_cost.cpp once against each build's ggml libraries and runs it:
  python tools/kernel_cost.py [--types q2_K,q4_K] [-t 2]      a table per build: us per node, ps per weight, GB/s
                                                              for the bench model's matmuls, weights from memory
  python tools/kernel_cost.py --check [--types q2_K,q4_K]     the same small matmuls in both builds; exit 0 when
                                                              every output is bit-identical (a layout only our
                                                              build has: equal to its plain one to float rounding)
                                                              and our batched experts' gemm gives the gemv's bits
Patches 0006 and 0007 give the repacked Q2_K and Q4_K gemvs our kernels, 0008 their gemms, 0009 the activations'
Q8_K quantization: the table shows what they save, the check that they change no bit (it compares the quantized
bytes of edge-case rows too). The check runs our build twice: with RAPIDMOE_REPACK_MMID_GEMM=0 and
RAPIDMOE_GEMM=0 (every routed row through the gemv, as stock llama.cpp does, and upstream's gemms), compared with
stock, and as it is (patch 0005: an expert's rows through the gemm by 4; our gemms), compared with that first run:
the routed rows (our gemm against the gemv) bit for bit, the dense rows (our gemm against upstream's, which adds in
another order) to float rounding.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from stock_llama import STOCK, build_stock

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "tools" / "kernel_cost.cpp"
OUR_GEMMS = ("q2_K", "q4_K", "q8_0", "q6_K", "q3_K")  # the repacked types whose gemm is ours (0008, 0016, 0017, 0021)
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
    if set(exes) != {"ours", "stock"}:
        ap.error("--check compares two builds: --builds ours,stock")
    upstream = {"RAPIDMOE_REPACK_MMID_GEMM": "0", "RAPIDMOE_GEMM": "0"}
    with tempfile.TemporaryDirectory() as d:
        stock = run_check(exes["stock"], args.threads, types, Path(d) / "stock.f32")
        ours_gemv = run_check(exes["ours"], args.threads, types, Path(d) / "ours-gemv.f32", env=upstream)
        ours = run_check(exes["ours"], args.threads, types, Path(d) / "ours.f32")
    status = compare(ours_gemv, stock, names=["ours", "stock"])
    return max(status, compare_gemm(ours, ours_gemv))


def run_check(exe: Path, threads: int, types: list[str], out: Path,
              env: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """One build's check run: {matmul ("experts q2_K repacked"): its output values}, in the order it ran them."""
    lines = subprocess.run([str(exe), "check", str(threads), str(out), *types], check=True, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True, env={**os.environ, **(env or {})}).stdout.split("\n")
    values = np.fromfile(out, dtype=np.float32)
    result, start = {}, 0
    for line in filter(None, lines):
        name, end = line.rsplit(" ", 1)
        result[name] = values[start:int(end)]
        start = int(end)
    return result


def max_error(a: np.ndarray, b: np.ndarray) -> float:
    """The largest difference of a and b, relative to b's largest value."""
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def compare_gemm(ours: dict[str, np.ndarray], gemv: dict[str, np.ndarray]) -> int:
    """0 when our build as it is (an expert's batched rows through the gemm) equals its run with every routed row
    through the gemv and upstream's gemms: the routed rows of the types with our gemm (patch 0008, against the gemv)
    bit for bit, the rest to float rounding."""
    ok = set(ours) == set(gemv) and any(" x" in m for m in ours)
    for m in (m for m in ours if m in gemv):
        exact = m.startswith("experts") and m.split()[-2] in OUR_GEMMS
        if ours[m].tobytes() == gemv[m].tobytes():
            continue
        err = max_error(ours[m], gemv[m])
        ok = ok and not exact and err <= 1e-5
        print(f"{m}: as built against upstream's kernels and the gemv: max error {err:.1e} of the largest output "
              f"({'NOT bit-identical' if exact else 'within' if err <= 1e-5 else 'BEYOND'}"
              f"{'' if exact else ' float rounding (1e-5)'})")
    batched = [m for m in ours if m.startswith("experts x") and m.endswith("repacked") and m.split()[-2] in OUR_GEMMS]
    print(f"gemm (batched rows) against gemv: {'bit-identical' if ok else 'FAILED'}: " + "; ".join(batched))
    return 0 if ok else 1


def compare(first: dict[str, np.ndarray], second: dict[str, np.ndarray], names: list[str]) -> int:
    """0 when every matmul both builds ran is bit-identical, and a layout only the first build has (our repacked
    Q2_K on an AVX2 CPU without AVX-512, where upstream keeps Q2_K plain) equals the first build's plain layout of
    the same matmul to float rounding (the repacked kernel adds the blocks' float terms in another order)."""
    shared = [m for m in first if m in second]
    print("matmuls: " + "; ".join(shared))
    same = bool(shared) and all(first[m].tobytes() == second[m].tobytes() and first[m].size > 0 for m in shared)
    n = sum(first[m].size for m in shared)
    print(f"{n} output values: {'bit-identical' if same else 'DIFFERENT'} in {' and '.join(names)}")
    ok = same and all(m in first for m in second)
    for m in (m for m in second if m not in first):
        print(f"{m}: only in {names[1]}")
    for m in (m for m in first if m not in second):
        plain = first.get(m.replace(" repacked", " plain"))
        if plain is None or plain.shape != first[m].shape:
            print(f"{m}: only in {names[0]}, and no plain layout to compare it with")
            ok = False
            continue
        err = max_error(first[m], plain)
        close = err <= 1e-5
        ok = ok and close
        print(f"{m}: only in {names[0]} (no such layout there on this CPU); against {names[0]}'s plain layout: "
              f"max error {err:.1e} of the largest output, {'within' if close else 'BEYOND'} float rounding (1e-5)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
