#!/usr/bin/env python3
"""Where a decode step's (or a prompt batch's) wall time goes, per graph node: each thread's compute time and its
wait at the barrier after the node, per kind of node (op, tensor name without its layer, weight type), and how fast
each matmul streamed its weights.

Runs the model under RAPIDMOE_NODE_TIMES (patch 0019: ggml-cpu's graph loop times every node on every thread),
forgets the warm-up, then times --steps decode steps (or --pp prompt batches) and prints, per kind of node and per
token: how many a token, thread 0's compute and wait, the slowest thread's compute, the weights read and the GB/s
they streamed at (thread 0's compute time). perf (tools/profile_decode.py) says which functions take the CPU time;
this says which nodes take the wall time, and which of them leave a thread idle (one computes, the other waits).

--depth N times the decode steps (or --pp prompt batches) after a context of N tokens (llama-bench's -d: the
context is computed first, in batches of 512, untimed); -ctk/-ctv pick the KV cache's types (f16, q8_0, ...), --fa
flash attention (auto, as llama-bench). --stock-way runs MODEL the "stock way": no sidecar, llama.cpp's CPU
repacking off (repack=False) and every RAPIDMOE_* kernel switch off (STOCK_WAY_ENV): what upstream's kernels do with
the same file.

Usage: python tools/profile_nodes.py MODEL.wq.gguf [--residual WR.gguf -r 1 | --stock-way] [-t 2] [--steps 64]
       [--pp 512] [--depth 4096] [-ctk f16 -ctv f16] [--fa auto] [--top 30] [--json OUT]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Every kernel switch of ours off (the value each reads as "off"): with repack=False and no sidecar, the "stock
# way" of running a file through our build: upstream's kernels on the same file.
STOCK_WAY_ENV = dict.fromkeys((
    "RAPIDMOE_CLAIM", "RAPIDMOE_FA_DECODE", "RAPIDMOE_GEMM", "RAPIDMOE_HUGE_PAGES", "RAPIDMOE_MOE_SUM",
    "RAPIDMOE_ONE_ROW", "RAPIDMOE_Q2_K_REPACK", "RAPIDMOE_Q3_K_REPACK", "RAPIDMOE_Q6_K_REPACK", "RAPIDMOE_Q8_0_REPACK",
    "RAPIDMOE_REFINE_X8", "RAPIDMOE_REPACK_MMID_GEMM", "RAPIDMOE_SIDECAR_REPACK", "RAPIDMOE_TINY_RUN",
    "RAPIDMOE_VEC_DOT_Q3_K"), "0")

# llama.cpp's -ctk/-ctv names of the KV cache types (ggml_type values)
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}

LOOP = r"""
import ctypes, json, sys, time, numpy as np
cfg = json.loads(sys.argv[1])
from rapidmoe import Llama
kw = dict(residual_path=cfg["residual"], n_critical=cfg["r"]) if cfg["residual"] else {}
n_ctx = max(512, cfg["depth"] + cfg["pp"] + cfg["steps"] + 72)
llm = Llama(model_path=cfg["model"], n_ctx=n_ctx, n_batch=max(512, cfg["pp"]), n_ubatch=max(512, cfg["pp"]),
            n_threads=cfg["threads"], n_threads_batch=cfg["threads"], verbose=False, flash_attn=cfg["fa"],
            type_k=cfg["type_k"], type_v=cfg["type_v"], repack=cfg["repack"], **kw)
# the copy of ggml-cpu the engine loaded (another name of the file would dlopen a second copy with its own sums)
loaded = {l.split()[-1] for l in open("/proc/self/maps").read().splitlines() if "/libggml-cpu.so" in l}
assert len(loaded) == 1, loaded
reset = ctypes.CDLL(loaded.pop()).rapidmoe_node_times_reset
toks = llm.tokenize(b"Once upon a time there was a model that", add_bos=False)
if cfg["depth"]:  # llama-bench's -d: a context of this many tokens first (untimed)
    context = [(1000 + i % 4000) % llm.n_vocab() for i in range(cfg["depth"])]
    for i in range(0, len(context), 512):
        llm.eval(context[i:i + 512])
if cfg["pp"]:
    batch = (toks * (cfg["pp"] // len(toks) + 1))[:cfg["pp"]]
    def run():  # llama_cpp's eval drops the cache's cells from n_tokens on: each batch lands on the context alone
        llm.n_tokens = cfg["depth"]; llm.eval(batch)
    run()
    reset()
    t0 = time.perf_counter()
    for _ in range(cfg["steps"]):
        run()
    per_token = (time.perf_counter() - t0) / cfg["steps"] / len(batch)
else:
    llm.eval(toks)
    # random tokens, as llama-bench's tg (the logits are not read: Llama.eval keeps none without logits_all)
    rng = np.random.default_rng(0)
    def step():
        llm.eval([int(rng.integers(llm.n_vocab()))])
    for _ in range(4):
        step()
    reset()
    t0 = time.perf_counter()
    for _ in range(cfg["steps"]):
        step()
    per_token = (time.perf_counter() - t0) / cfg["steps"]
print("RESULT " + json.dumps({"ms_per_token": per_token * 1e3}))
"""


@dataclass
class Kind:
    """One kind of node, summed over the timed graphs (times in us, bytes per graph from thread 0)."""
    op: str
    name: str
    weight_type: str
    count: int = 0
    compute0: float = 0.0
    wait0: float = 0.0
    compute_max: float = 0.0
    weight_bytes: float = 0.0


def read_times(path: Path) -> tuple[int, list[Kind]]:
    """The file RAPIDMOE_NODE_TIMES wrote: (graphs, kinds of node), each thread's sums folded into one Kind."""
    lines = path.read_text().splitlines()
    if not lines or not lines[0].startswith("# graphs\t"):
        raise ValueError(f"{path}: not a RAPIDMOE_NODE_TIMES file")
    graphs = int(lines[0].split("\t")[1])
    kinds: dict[tuple[str, str, str], Kind] = {}
    for row in csv.DictReader(lines[1:], delimiter="\t"):
        key = (row["op"], row["name"], row["weight_type"])
        k = kinds.setdefault(key, Kind(*key))
        compute = float(row["compute_us"])
        k.compute_max = max(k.compute_max, compute)
        if row["thread"] == "0":
            k.count = int(row["count"])
            k.compute0 = compute
            k.wait0 = float(row["wait_us"])
            k.weight_bytes = float(row["weight_bytes"])
    return graphs, list(kinds.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--residual", type=Path, default=None)
    ap.add_argument("-r", type=int, default=1)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=64, help="decode steps (with --pp: prompt batches) timed")
    ap.add_argument("--pp", type=int, default=0, help="time prompt batches of this many tokens instead")
    ap.add_argument("--depth", type=int, default=0, help="decode (or --pp batches) after a context of this many tokens")
    ap.add_argument("-ctk", "--cache-type-k", default="f16", choices=sorted(KV_TYPES))
    ap.add_argument("-ctv", "--cache-type-v", default="f16", choices=sorted(KV_TYPES))
    ap.add_argument("--fa", default="auto", choices=["auto", "on", "off"], help="flash attention")
    ap.add_argument("--stock-way", action="store_true",
                    help="no sidecar, repack=False, every RAPIDMOE_* switch off (STOCK_WAY_ENV)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = ap.parse_args()
    if args.stock_way and args.residual:
        ap.error("--stock-way runs the file alone (no --residual)")
    if not args.model.is_file():
        print(f"no such model: {args.model}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        times = Path(tmp) / "node-times.tsv"
        env = dict(os.environ, RAPIDMOE_NODE_TIMES=str(times), **(STOCK_WAY_ENV if args.stock_way else {}))
        cfg = {"model": str(args.model.resolve()), "residual": str(args.residual.resolve()) if args.residual else None,
               "r": args.r, "threads": args.threads, "steps": args.steps, "pp": args.pp, "depth": args.depth,
               "fa": args.fa, "type_k": KV_TYPES[args.cache_type_k], "type_v": KV_TYPES[args.cache_type_v],
               "repack": not args.stock_way}
        out = subprocess.run([sys.executable, "-c", LOOP, json.dumps(cfg)], env=env, capture_output=True, text=True)
        if out.returncode != 0 or not times.exists():
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        ms_per_token = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))[7:])[
            "ms_per_token"]
        graphs, kinds = read_times(times)
    tokens = args.steps * max(args.pp, 1)
    per = 1.0 / tokens
    kinds.sort(key=lambda k: -(k.compute0 + k.wait0))
    total0 = sum(k.compute0 + k.wait0 for k in kinds) * per
    what = (f"prompt batches of {args.pp} after {args.depth} tokens" if args.pp else
            f"decode steps after {args.depth} tokens" if args.depth else "decode steps")
    way = " (stock way)" if args.stock_way else ""
    print(f"{args.model.name}{way} r={args.r if args.residual else '-'} threads={args.threads} "
          f"KV {args.cache_type_k}/{args.cache_type_v}: {ms_per_token:.3f} ms a "
          f"token wall over {args.steps} {what} ({graphs} graphs); thread 0's node times add up to "
          f"{total0 / 1e3:.3f} ms a token")
    print("| node (op, name, weight type) | a token | thread 0 compute us | thread 0 wait us | slowest thread "
          "compute us | weights MB | GB/s |\n|---|---|---|---|---|---|---|")
    rows = []
    for k in kinds[:args.top]:
        mb = k.weight_bytes * per / 1e6
        gbs = k.weight_bytes / k.compute0 / 1e3 if k.compute0 > 0 and k.weight_bytes > 0 else 0.0
        name = k.name if k.name != "-" else "(unnamed)"
        wt = f" {k.weight_type}" if k.weight_type != "-" else ""
        print(f"| {k.op} {name}{wt} | {k.count * per:.2f} | {k.compute0 * per:.1f} | {k.wait0 * per:.1f} | "
              f"{k.compute_max * per:.1f} | {mb:.2f} | {gbs:.1f} |" if mb else
              f"| {k.op} {name}{wt} | {k.count * per:.2f} | {k.compute0 * per:.1f} | {k.wait0 * per:.1f} | "
              f"{k.compute_max * per:.1f} | - | - |")
        rows.append({"op": k.op, "name": k.name, "weight_type": k.weight_type, "per_token": k.count * per,
                     "compute0_us": k.compute0 * per, "wait0_us": k.wait0 * per, "compute_max_us": k.compute_max * per,
                     "weight_mb": mb, "gb_s": gbs})
    if args.json:
        args.json.write_text(json.dumps({"ms_per_token": ms_per_token, "graphs": graphs, "depth": args.depth,
                                         "stock_way": args.stock_way, "kv": [args.cache_type_k, args.cache_type_v],
                                         "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
