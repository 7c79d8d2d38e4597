#!/usr/bin/env python3
"""Where a decode step's time goes: perf's cpu-clock samples of the decode loop only, per function.

Loads the model (ours with --residual, or stock llama.cpp with --stock), warms up, then attaches
`perf record -e cpu-clock` to this process for --steps single-token decode steps and prints the functions
that took the time (ggml kernels name their op and type: ggml_vec_dot_q2_K_q8_K is a plain Q2_K matmul row,
ggml_gemv_q2_K_8x8_q8_K a repacked one, ggml_barrier / the thread pool's spin are synchronisation).
Needs Debian's linux-perf; cpu-clock samples count on-CPU time of both threads (software clock, no hardware
counters), so the CPU ms per function hold up when other processes load the machine; the wall time does not.

Usage: python tools/profile_decode.py MODEL.gguf [--residual WR.gguf -r 1] [--stock] [-t 2] [--steps 64] [--top 25]
       [--pp 512: profile prefill batches of 512 tokens instead of decode steps]
       [--ik PATH/llama-bench: profile ik_llama.cpp's llama-bench with -rtr 1 on MODEL instead (bench/ik_peer.py);
        the whole process is sampled, so its load and repacking functions are listed too, by name; the per-token
        figures divide by the tokens it ran (decode: --steps tokens plus its 1-token warm-up; prefill: --steps + 1
        batches of --pp)]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from stock_llama import build_stock

ROOT = Path(__file__).resolve().parent.parent
FREQ = 4000  # perf samples per second of CPU time

LOOP = r"""
import json, os, sys, time, subprocess, signal, numpy as np
cfg = json.loads(sys.argv[1])
if cfg["stock"]:
    import llama_cpp as lc
    from llama_cpp import Llama
    kw = {}
else:
    from rapidmoe import Llama
    from rapidmoe._runtime import llama_cpp as lc
    kw = dict(residual_path=cfg["residual"], n_critical=cfg["r"]) if cfg["residual"] else {}
# ours takes llama.cpp's three modes; stock llama_cpp.Llama a bool (auto turns it on on a CPU)
kw["flash_attn"] = cfg["fa"] if not cfg["stock"] else cfg["fa"] != "off"
if cfg["no_repack"]:  # plain weight layout: llama.cpp's use_extra_bufts off (its --no-repack)
    import importlib
    low = importlib.import_module("llama_cpp.llama_cpp" if cfg["stock"] else "rapidmoe._llama_cpp.llama_cpp")
    _default = low.llama_model_default_params
    def _plain():
        p = _default()
        p.use_extra_bufts = False
        return p
    low.llama_model_default_params = _plain
    os.environ["RAPIDMOE_SIDECAR_REPACK"] = "0"
llm = Llama(model_path=cfg["model"], n_ctx=max(512, cfg["pp"] + 8), n_batch=max(512, cfg["pp"]),
            n_ubatch=max(512, cfg["pp"]), n_threads=cfg["threads"], n_threads_batch=cfg["threads"],
            verbose=False, **kw)
if cfg.get("policy"):
    llm.set_policy(cfg["policy"])
toks = llm.tokenize(b"Once upon a time there was a model that", add_bos=False)
def prompt():
    llm.reset(); llm._ctx.kv_cache_clear()
    llm.eval(toks)
    return int(np.argmax(llm.scores[len(toks) - 1]))
def decode(tok, n):
    t0 = time.perf_counter()
    for _ in range(n):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return (time.perf_counter() - t0) / n
def prefill(n):  # one batch of cfg["pp"] tokens per step, from an empty cache
    t0 = time.perf_counter()
    for _ in range(n):
        llm.reset(); llm._ctx.kv_cache_clear()
        llm.eval(pp_toks)
    return (time.perf_counter() - t0) / n / len(pp_toks)
if cfg["pp"]:
    pp_toks = (toks * (cfg["pp"] // len(toks) + 1))[:cfg["pp"]]
    prefill(1)
else:
    decode(prompt(), 8)
    tok = prompt()
perf = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", str(cfg["freq"]), "-o", cfg["data"],
                         "-p", str(os.getpid())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(0.5)
step = prefill(cfg["steps"]) if cfg["pp"] else decode(tok, cfg["steps"])
perf.send_signal(signal.SIGINT)
perf.wait()
print("RESULT " + json.dumps({"ms_per_token": step * 1e3}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--residual", type=Path, default=None)
    ap.add_argument("-r", type=int, default=1)
    ap.add_argument("--policy", type=Path, default=None)
    ap.add_argument("--stock", action="store_true", help="run on the stock build (tools/stock_llama.py)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-repack", action="store_true", help="load every weight in the plain layout (no CPU_REPACK)")
    ap.add_argument("--pp", type=int, default=0,
                    help="profile prefill instead: --steps batches of PP tokens each (times are then per token)")
    ap.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto",
                    help="flash attention, as llama.cpp's -fa (default auto, as llama-bench and llama-server run)")
    ap.add_argument("--json", type=Path, default=None, help="also write the table as JSON")
    ap.add_argument("--ik", type=Path, default=None, help="ik_llama.cpp's llama-bench: profile it (-rtr 1) on MODEL")
    args = ap.parse_args()
    if shutil.which("perf") is None:
        print("perf not found (apt-get install linux-perf)", file=sys.stderr)
        return 1
    if args.ik is not None:
        return profile_ik(args)
    env = dict(os.environ)
    cwd = None
    if args.stock:
        env.update(LLAMA_CPP_LIB_PATH=str(build_stock(["llama"])), PYTHONPATH=str(ROOT / "vendor" / "llama_cpp_py"))
        cwd = ROOT / "vendor"
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "perf.data")
        cfg = {"model": str(args.model.resolve()), "residual": str(args.residual.resolve()) if args.residual else None,
               "r": args.r, "policy": str(args.policy) if args.policy else None, "stock": args.stock,
               "threads": args.threads, "steps": args.steps, "data": data, "freq": FREQ, "pp": args.pp,
               "no_repack": args.no_repack, "fa": args.flash_attn}
        out = subprocess.run([sys.executable, "-c", LOOP, json.dumps(cfg)], env=env, cwd=cwd, capture_output=True,
                             text=True)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        res = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[7:])
        rep = subprocess.run(["perf", "report", "-i", data, "--stdio", "-n", "--sort", "sym", "--percent-limit", "0.3"],
                             capture_output=True, text=True).stdout
    rows = per_function(rep, args.steps * max(args.pp, 1))
    print_table(args, f"{'stock' if args.stock else 'ours'} r={args.r if args.residual else '-'}", res["ms_per_token"],
                rows)
    return 0


def per_function(report: str, tokens: int) -> list[tuple[float, float, str]]:
    """perf report's lines as (share %, CPU ms per token, symbol); CPU time counts every thread and holds up under
    other load (the wall time does not)."""
    rows = []
    for line in report.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0].endswith("%") and parts[2].startswith("["):
            rows.append((float(parts[0][:-1]), int(parts[1]) / FREQ * 1e3 / tokens, " ".join(parts[3:])))
    return rows


def print_table(args: argparse.Namespace, label: str, ms_per_token: float,
                rows: list[tuple[float, float, str]]) -> None:
    cpu_ms = sum(r[1] for r in rows)
    print(f"{args.model.name} {label} threads={args.threads}: {ms_per_token:.3f} ms/token wall over {args.steps} "
          f"{'prefill batches of ' + str(args.pp) if args.pp else 'decode steps'}, "
          f"{cpu_ms:.2f} CPU ms/token in the functions listed")
    print("| share of samples | CPU ms/token | function |\n|---|---|---|")
    for pct, ms, sym in rows[:args.top]:
        print(f"| {pct:.1f}% | {ms:.3f} | `{sym}` |")
    if args.json:
        args.json.write_text(json.dumps({"ms_per_token": ms_per_token, "rows": rows}, indent=1))


def profile_ik(args: argparse.Namespace) -> int:
    """perf over one ik_llama.cpp llama-bench run with run-time repacking (decode, or prefill with --pp)."""
    pp, tg = (args.pp, 0) if args.pp else (0, args.steps)
    reps = args.steps if args.pp else 1
    tokens = (reps + 1) * pp if args.pp else tg + 1  # its warm-up: one pp batch, or one decode token
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "perf.data")
        cmd = ["perf", "record", "-e", "cpu-clock", "-F", str(FREQ), "-o", data, "--", str(args.ik), "-m",
               str(args.model.resolve()), "-t", str(args.threads), "-rtr", "1", "-r", str(reps), "-p", str(pp),
               "-n", str(tg), "-o", "json"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        tests = json.loads(out.stdout[out.stdout.index("["):])
        tps = float(tests[0]["avg_ts"])
        rep = subprocess.run(["perf", "report", "-i", data, "--stdio", "-n", "--sort", "sym", "--percent-limit", "0.3"],
                             capture_output=True, text=True).stdout
    print_table(args, "ik_llama.cpp -rtr 1 (whole process: load and repack included)", 1e3 / tps,
                per_function(rep, tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
