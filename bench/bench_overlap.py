#!/usr/bin/env python3
"""Overlapped vs serial residual work with the WQ experts on a second device, measured in one run.

The "device" is llama.cpp's RPC backend with a local rpc-server (the stand-in a CPU-only machine has; on a GPU
machine bench/gpu_check.sh measures the same with CUDA): every layer on it (-ngl) except the sidecar, which
stays in this process. Two contexts of the same RESplit pair, one with `overlap="off"` (the residual matmuls
run in this process after the device's WQ work) and one with `overlap="auto"` (they run on the residual
worker while the device computes), are timed alternately at each r: decode tokens/s (greedy, one token at a
time after a short prompt) and prefill tokens/s (one batch), medians over --reps, plus the overlap timing
of the decode steps (worker time, device time, wall time per stage).

Threads: the rpc-server, this process's compute threads and the residual worker get --threads each
(default 1: on a 2-core machine the device and the worker then each have a core).

--cache F: a per-expert WQ cache instead: the routed experts stay stacked in this process's memory (-ot exps=CPU)
and the first F of each MoE layer's experts are copied to the device; serial ("off": misses, then the device's
hits, then the residuals) against concurrent ("auto": the worker computes the misses and the residuals while the
device computes the hits). Writes overlap-cached.{json,md}.

Usage: python bench/bench_overlap.py [--wq M.wq.gguf --wr M.wr.gguf | --arch qwen3moe --size small]
                                      [--r 1 2 8] [--tg 24] [--pp 64] [--reps 3] [--threads 1] [--cache 0.5]
Writes bench/out/overlap.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from rapidmoe import Llama
from rapidmoe.atomic import write_text
from rapidmoe.cache import ExpertCacheConfig
from rapidmoe.ggufio import GGUFFile
from rapidmoe.placement.cache.moepic import moe_layers_of
from rapidmoe.resplit import convert, get_preset
from rapidmoe.rpc import RPCServer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
OUT = ROOT / "bench" / "out"

from common import cpu_name, ensure_synthetic  # noqa: E402

PROMPT = b"The mixture of experts routes every token to a few experts, and the rest of the network is dense. " * 8


def machine() -> str:
    """CPU model and core count (platform.processor() is empty on Linux)."""
    return f"{platform.machine()}, {cpu_name()}, {os.cpu_count()} cores"


def split_pair(args: argparse.Namespace) -> tuple[Path, Path]:
    if args.wq is not None:
        return args.wq, args.wr
    work = OUT / "overlap-work"
    work.mkdir(parents=True, exist_ok=True)
    src = ensure_synthetic(work / f"synthetic-{args.arch}-{args.size}.gguf", args.arch, args.size)
    dst = work / f"{src.stem}.{args.preset}"
    wq, wr = dst / f"{src.stem}.wq.gguf", dst / f"{src.stem}.wr.gguf"
    if not (wq.exists() and wr.exists()):
        res = convert(src, dst, get_preset(args.preset), progress=True)
        wq, wr = res.wq_path, res.wr_path
    return wq, wr


def decode_tps(llm: Llama, prompt: list[int], tg: int) -> float:
    llm.reset()
    llm._ctx.kv_cache_clear()
    llm.eval(prompt[:8])
    tok = int(np.argmax(llm.scores[7]))
    t0 = time.perf_counter()
    for _ in range(tg):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return tg / (time.perf_counter() - t0)


def prefill_tps(llm: Llama, prompt: list[int]) -> float:
    llm.reset()
    llm._ctx.kv_cache_clear()
    t0 = time.perf_counter()
    llm.eval(prompt)
    return len(prompt) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wq", type=Path, default=None, help="RESplit .wq.gguf (with --wr); default: a synthetic pair")
    ap.add_argument("--wr", type=Path, default=None)
    ap.add_argument("--arch", default="qwen3moe")
    ap.add_argument("--size", default="small")
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--r", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--tg", type=int, default=24)
    ap.add_argument("--pp", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", type=float, default=None, help="share of each layer's experts cached on the device")
    args = ap.parse_args()
    if args.cache is not None and not 0 < args.cache <= 1:
        ap.error("--cache is a share of the experts in (0, 1]")
    if (args.wq is None) != (args.wr is None):
        ap.error("--wq and --wr go together")
    wq, wr = split_pair(args)
    result: dict[str, Any] = {"command": " ".join(["python", "bench/bench_overlap.py", *sys.argv[1:]]), "wq": str(wq),
                    "wr": str(wr), "threads": args.threads, "tg": args.tg, "pp": args.pp, "reps": args.reps,
                    "machine": machine(), "cache": args.cache, "rows": []}
    with RPCServer(threads=args.threads) as srv:
        common: dict[str, Any] = {
            "residual_path": wr, "rpc_servers": [srv.endpoint], "n_gpu_layers": -1, "n_ctx": 512, "n_batch": 512,
            "n_ubatch": 512, "n_threads": args.threads, "n_threads_batch": args.threads,
            "overlap_threads": args.threads, "logits_all": False, "verbose": False}
        if args.cache is not None:
            f = GGUFFile(wq)
            n_expert = int(f.get(f"{f.get('general.architecture')}.expert_count"))
            n_cached = max(1, round(args.cache * n_expert))
            result["cached_experts"] = f"{n_cached}/{n_expert}"
            experts = {il: list(range(n_cached)) for il in moe_layers_of(wq)}
            common.update(override_tensor="exps=CPU",
                          expert_cache=ExpertCacheConfig(experts=experts, device=srv.device.buffer_type))
        llms = {mode: Llama(wq, overlap=mode, **common) for mode in ("off", "auto")}
        residual = llms["off"].residual
        assert residual is not None  # residual_path given
        k = residual.n_expert_used
        prompt = llms["off"].tokenize(PROMPT, add_bos=False)[: args.pp]
        for r in [min(r, k) for r in args.r]:
            row: dict[str, Any] = {"r": r}
            samples: dict[str, dict[str, list[float]]] = {m: {"tg": [], "pp": []} for m in llms}
            for llm in llms.values():
                llm.set_n_critical(r)
                decode_tps(llm, prompt, 4)  # warm-up: graphs built, pages touched
            for rep in range(args.reps):
                order = list(llms) if rep % 2 == 0 else list(reversed(llms))
                for m in order:
                    llm = llms[m]
                    if m == "auto":
                        llm.overlap_stats(reset=True)
                    samples[m]["tg"].append(decode_tps(llm, prompt, args.tg))
                    if m == "auto" and rep == 0:
                        row["stats"] = llm.overlap_stats().as_dict()
                        row["stats_tokens"] = args.tg
                    samples[m]["pp"].append(prefill_tps(llm, prompt))
            for m in llms:
                row[f"{m}_tg_tps"] = statistics.median(samples[m]["tg"])
                row[f"{m}_pp_tps"] = statistics.median(samples[m]["pp"])
                row[f"{m}_samples"] = samples[m]
            result["rows"].append(row)
            print(json.dumps({k2: v for k2, v in row.items() if not k2.endswith("samples")}), flush=True)
        if args.cache is not None:
            cache = llms["auto"].expert_cache
            assert cache is not None  # expert_cache given
            result["hit_rate"] = cache.stats().hit_rate
        for llm in llms.values():
            llm.close()
    OUT.mkdir(parents=True, exist_ok=True)
    name = "overlap" if args.cache is None else "overlap-cached"
    write_text(OUT / f"{name}.json", json.dumps(result, indent=1))
    write_text(OUT / f"{name}.md", to_markdown(result))
    print(to_markdown(result))
    return 0


def to_markdown(res: dict[str, Any]) -> str:
    if res.get("cache") is None:
        title = "Overlap of residual work with the device's WQ work (RPC stand-in device)"
        where = "every layer on a local rpc-server except the sidecar"
    else:
        title = "Concurrent hits, misses and residuals in cached layers (RPC stand-in device)"
        where = (f"every layer on a local rpc-server except the routed experts (stacked here) and the sidecar; "
                 f"{res['cached_experts']} experts of each MoE layer cached on the rpc-server (the lowest ids), hit "
                 f"rate {res['hit_rate']:.1%} over the run; serial = overlap off, concurrent = auto")
    lines = [f"# {title}", "",
             f"`{res['command']}`", "",
             f"Model {Path(res['wq']).name} + {Path(res['wr']).name}; {where}; "
             f"{res['threads']} thread(s) each for the rpc-server, this process and the residual worker; "
             f"medians of {res['reps']} alternating runs; decode {res['tg']} tokens, prefill {res['pp']} tokens. "
             f"Machine: {res['machine']}.", "",
             "| r | decode tok/s serial | decode tok/s overlapped | ratio | prefill tok/s serial | prefill tok/s "
             "overlapped | ratio |", "|---|---|---|---|---|---|---|"]
    for row in res["rows"]:
        lines.append(f"| {row['r']} | {row['off_tg_tps']:.2f} | {row['auto_tg_tps']:.2f} | "
                     f"{row['auto_tg_tps'] / row['off_tg_tps']:.3f} | {row['off_pp_tps']:.1f} | "
                     f"{row['auto_pp_tps']:.1f} | {row['auto_pp_tps'] / row['off_pp_tps']:.3f} |")
    lines += ["", "Overlap timing of the overlapped decode steps (per token, summed over layers; worker = the "
              "residual matmuls, device = begin returned to join started, wall = begin started to join done; "
              "hidden = worker + device - wall, as a share of the shorter one):", "",
              "| r | stage | worker ms | device ms | join wait ms | wall ms | hidden ms | hidden share |",
              "|---|---|---|---|---|---|---|---|"]
    for row in res["rows"]:
        n = row["stats_tokens"]
        for stage, s in row["stats"].items():
            lines.append(f"| {row['r']} | {stage} | {s['cpu_ms'] / n:.2f} | {s['device_ms'] / n:.2f} | "
                         f"{s['wait_ms'] / n:.2f} | {s['wall_ms'] / n:.2f} | {s['hidden_ms'] / n:.2f} | "
                         f"{s['hidden_fraction']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
