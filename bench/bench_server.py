#!/usr/bin/env python3
"""Serving latency: TTFT and TPOT p50/p99 of `rapidmoe-cli serve` vs stock `llama-server`, in one run.

Both servers run the same GGUF with the same slots, context and threads (stock built from the same pin by
tools/stock_llama.py). For each concurrency level, requests arrive at a fixed rate (at most `c` in flight),
each a streaming /v1/completions with its own prompt (prompt caching off on both), greedy, ignore_eos.
TTFT: send -> first text chunk. TPOT: (last chunk - first chunk) / (completion tokens - 1).
Writes bench/results/server-<model>.{json,md}.
Usage: python bench/bench_server.py [--model M.gguf] [--levels 1 2 4] [--rate 2] [--requests 20]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
import http.client
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rapidmoe.server.sse import read_events

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tools"))

from server_proc import ServerProc  # noqa: E402

WORDS = ("time river stone light garden window morning silver quiet market letter island summer road forest "
         "lamp story bridge harbor winter field mountain candle song cloud mirror").split()


def _prompt(i: int, n_words: int) -> str:
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def one_request(port: int, prompt: str, n_predict: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = json.dumps({"prompt": prompt, "max_tokens": n_predict, "stream": True, "temperature": 0,
                       "ignore_eos": True, "cache_prompt": False}).encode()
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        return {"error": f"status {r.status}"}
    t_first = t_last = 0.0
    n_tokens = 0
    for ev in read_events(r):
        payload = ev[len(b"data: "):]
        if payload == b"[DONE]":
            continue
        d = json.loads(payload)
        if d["choices"] and d["choices"][0].get("text"):
            now = time.perf_counter()
            t_first = t_first or now
            t_last = now
        if d.get("usage"):
            n_tokens = d["usage"]["completion_tokens"]
    conn.close()
    if not t_first or n_tokens < 2:
        return {"error": f"no tokens ({n_tokens})"}
    return {"ttft_ms": 1e3 * (t_first - t0), "tpot_ms": 1e3 * (t_last - t_first) / (n_tokens - 1),
            "n_tokens": n_tokens, "e2e_ms": 1e3 * (t_last - t0)}


def run_level(port: int, concurrency: int, rate: float, n_requests: int, n_predict: int, n_words: int,
              seed0: int) -> dict[str, Any]:
    """Arrivals every 1/rate s; a request whose arrival finds `concurrency` in flight waits for one to end."""
    sem = threading.Semaphore(concurrency)
    results: list[dict[str, Any]] = []
    lock = threading.Lock()

    def task(i: int) -> None:
        try:
            res = one_request(port, _prompt(seed0 + i, n_words), n_predict)
        finally:
            sem.release()
        with lock:
            results.append(res)

    t_start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        for i in range(n_requests):
            delay = t_start + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            sem.acquire()
            ex.submit(task, i)
    wall = time.perf_counter() - t_start
    ok = [r for r in results if "error" not in r]

    def pct(key: str, q: float) -> float:
        xs = sorted(r[key] for r in ok)
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")

    return {"concurrency": concurrency, "rate": rate, "requests": n_requests, "errors": len(results) - len(ok),
            "ttft_p50_ms": pct("ttft_ms", 0.5), "ttft_p99_ms": pct("ttft_ms", 0.99),
            "tpot_p50_ms": pct("tpot_ms", 0.5), "tpot_p99_ms": pct("tpot_ms", 0.99),
            "tokens_per_s": sum(r["n_tokens"] for r in ok) / wall,
            "ttft_mean_ms": statistics.fmean(r["ttft_ms"] for r in ok) if ok else float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the tiny synthetic default model)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rate", type=float, default=2.0, help="request arrivals per second")
    ap.add_argument("--requests", type=int, default=20, help="requests per level and server")
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096, help="total context (split over 4 slots)")
    args = ap.parse_args()

    from rapidmoe.default_model import ensure_default_model  # noqa: PLC0415
    from stock_llama import build_stock  # noqa: PLC0415

    model = args.model or ensure_default_model()
    stock_bin = build_stock(["llama-server"])
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    logs = ROOT / "bench" / "out"
    logs.mkdir(parents=True, exist_ok=True)
    slots = str(max(args.levels))
    common = ["-c", str(args.ctx), "-t", str(args.threads)]
    servers = {
        "rapidmoe": ServerProc(model, "--parallel", slots, "--queue-size", "64", *common,
                               log_path=logs / "bench-server-rapidmoe.log"),
        "llama-server": ServerProc(model, "-m", str(model), "--parallel", slots, *common, "-tb", str(args.threads),
                                   "--cache-ram", "0", "--no-ui", log_path=logs / "bench-server-stock.log",
                                   cmd=[str(stock_bin / "llama-server")]),
    }
    rows: list[dict[str, Any]] = []
    try:
        for name, s in servers.items():  # warm up both
            for i in range(2):
                one_request(s.port, _prompt(10_000 + i, args.prompt_words), 8)
        for c in args.levels:
            for name, s in servers.items():  # interleaved, so drift in machine load hits both alike
                r = run_level(s.port, c, args.rate, args.requests, args.n_predict, args.prompt_words, 1000 * c)
                r["server"] = name
                rows.append(r)
                print(json.dumps(r), flush=True)
    finally:
        for s in servers.values():
            s.stop()

    stem = Path(model).stem
    meta = {"model": str(model), "command": "python bench/bench_server.py " + " ".join(sys.argv[1:]),
            "threads": args.threads, "ctx": args.ctx, "slots": int(slots), "n_predict": args.n_predict,
            "prompt_words": args.prompt_words, "rate": args.rate, "requests": args.requests,
            "loadavg_at_end": os.getloadavg(), "cpus": os.cpu_count(), "rows": rows}
    (out_dir / f"server-{stem}.json").write_text(json.dumps(meta, indent=2) + "\n")
    lines = [f"# Serving latency: rapidmoe-cli serve vs stock llama-server ({stem})", "",
             f"`{meta['command']}`; {args.threads} threads, {slots} slots, {args.ctx} context, streaming "
             f"/v1/completions of {args.n_predict} tokens (greedy, ignore_eos) after ~{args.prompt_words}-word "
             f"prompts, {args.rate} requests/s arriving, {args.requests} per level; prompt caching off.", "",
             "| server | concurrency | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | tokens/s | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
                     f"{r['tpot_p50_ms']:.2f} | {r['tpot_p99_ms']:.2f} | {r['tokens_per_s']:.1f} | {r['errors']} |")
    (out_dir / f"server-{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
