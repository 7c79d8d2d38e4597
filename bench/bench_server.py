#!/usr/bin/env python3
"""Serving latency: TTFT and TPOT p50/p99 of `rapidmoe-cli serve` vs stock `llama-server`, in one run.

Both servers run the same GGUF with the same slots, context and threads (stock built from the same pin by
tools/stock_llama.py). For each concurrency level, requests arrive at a fixed rate (at most `c` in flight),
each a streaming /v1/completions with its own prompt (prompt caching off on both), greedy, ignore_eos.
TTFT: send -> first text chunk. TPOT: (last chunk - first chunk) / (completion tokens - 1).
Writes bench/results/server-<model>.{json,md}.
Usage: python bench/bench_server.py [--model M.gguf] [--levels 1 2 4] [--rate 2] [--requests 20]

`--multi-turn`: the prompt (prefix) cache instead. Multi-turn conversations where each turn appends a user message
and the previous answer to the history (raw text on /v1/completions, so both servers tokenize the same prompt);
every turn is sent twice to each server, with `cache_prompt` true and false, one after the other, and TTFT
(send -> first text chunk) is recorded per turn. Default model: the `small` synthetic qwen3moe (prefill of a few
hundred tokens takes long enough to matter). Writes <--out-dir>/server-prefix-cache-<model>.{json,md} (default
bench/results).
For an agent's long system prompt at the speed users run: `--system-words 7400 --turns 3 --conversations 1
--uncached none --parallel 1 --ctx 8192` (7.5k tokens of system prompt: llama-server caps a slot at the bench
model's 8192-token training context, and answers a longer prompt with an error event) on the bench model's pair
(`--model WQ --residual WR -r 1`) against stock on its own file (`--stock-model Q4_K_M.gguf`), flash attention on for
both (`--flash-attn on`); `--uncached none` sends every turn with the cache only (turn 1 has nothing cached either
way: an 8k resend costs minutes), and the report gives each turn's TTFT over turn 1's.
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rapidmoe.atomic import write_text as atomic_write
from rapidmoe.default_model import ensure_default_model
from rapidmoe.paths import vocab_dir
from rapidmoe.server.sse import read_events
from rapidmoe.synthetic import spec_for, write_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tools"))

from common import cpu_name  # noqa: E402
from server_proc import ServerProc  # noqa: E402
from stock_llama import build_stock  # noqa: E402

WORDS = ("time river stone light garden window morning silver quiet market letter island summer road forest "
         "lamp story bridge harbor winter field mountain candle song cloud mirror").split()


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1f}"


def small_model(folder: Path) -> Path:
    """The `small` synthetic qwen3moe (made once)."""
    path = folder / "synthetic-qwen3moe-small.gguf"
    if not path.exists():
        write_model(spec_for("qwen3moe", "small", seed=0), path, vocab_dir())
    return path


def _prompt(i: int, n_words: int) -> str:
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def one_request(port: int, prompt: str, n_predict: int, cache_prompt: bool = False) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)  # an 8k prompt on stock: minutes
    body = json.dumps({"prompt": prompt, "max_tokens": n_predict, "stream": True, "temperature": 0,
                       "ignore_eos": True, "cache_prompt": cache_prompt}).encode()
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        return {"error": f"status {r.status}"}
    t_first = t_last = 0.0
    n_tokens = n_prompt = n_cached = 0
    text = []
    for ev in read_events(r):
        if ev.startswith(b":"):  # an SSE comment (llama-server's keep-alive while a long prompt runs)
            continue
        if not ev.startswith(b"data: "):  # an `error:` event (e.g. llama-server's context limit)
            return {"error": ev.decode(errors="replace")[:500]}
        payload = ev[len(b"data: "):]
        if payload == b"[DONE]":
            continue
        d = json.loads(payload)
        if d["choices"] and d["choices"][0].get("text"):
            now = time.perf_counter()
            t_first = t_first or now
            t_last = now
            text.append(d["choices"][0]["text"])
        if d.get("usage"):
            n_tokens = d["usage"]["completion_tokens"]
            n_prompt = d["usage"]["prompt_tokens"]
        if d.get("timings"):
            n_cached = d["timings"].get("cache_n", 0)
    conn.close()
    if not t_first or n_tokens < 2:
        return {"error": f"no tokens ({n_tokens})"}
    return {"ttft_ms": 1e3 * (t_first - t0), "tpot_ms": 1e3 * (t_last - t_first) / (n_tokens - 1),
            "n_tokens": n_tokens, "e2e_ms": 1e3 * (t_last - t0), "n_prompt": n_prompt, "n_cached": n_cached,
            "text": "".join(text)}


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
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")

    return {"concurrency": concurrency, "rate": rate, "requests": n_requests, "errors": len(results) - len(ok),
            "ttft_p50_ms": pct("ttft_ms", 0.5), "ttft_p99_ms": pct("ttft_ms", 0.99),
            "tpot_p50_ms": pct("tpot_ms", 0.5), "tpot_p99_ms": pct("tpot_ms", 0.99),
            "tokens_per_s": sum(r["n_tokens"] for r in ok) / wall,
            "ttft_mean_ms": statistics.fmean(r["ttft_ms"] for r in ok) if ok else float("nan")}


def multi_turn(servers: dict[str, ServerProc], n_conv: int, n_turns: int, n_predict: int,
               user_words: int, system_words: int = 60, uncached: str = "all") -> list[dict[str, Any]]:
    """Each conversation's turns in order; each turn on every server with the cache on, then off (`uncached`: every
    turn, the first only, or none)."""
    rows: list[dict[str, Any]] = []
    for conv in range(n_conv):
        history = {name: f"Conversation {conv}. System: " + _prompt(50_000 + conv, system_words) for name in servers}
        for turn in range(n_turns):
            user = f" User: {_prompt(60_000 + 100 * conv + turn, user_words)}. Assistant:"
            for name, s in servers.items():
                history[name] += user
                for cache in (True, False) if uncached == "all" or (uncached == "first" and turn == 0) \
                        else (True,):
                    r = one_request(s.port, history[name], n_predict, cache_prompt=cache)
                    if "error" in r:
                        raise RuntimeError(f"{name} turn {turn}: {r['error']}")
                    rows.append({"server": name, "cache": cache, "conversation": conv, "turn": turn,
                                 "ttft_ms": r["ttft_ms"], "n_prompt": r["n_prompt"], "n_cached": r["n_cached"]})
                    print(json.dumps(rows[-1]), flush=True)
                    if cache:
                        answer = r["text"]
                history[name] += answer
    return rows


def multi_turn_report(args: argparse.Namespace, model: Path, rows: list[dict[str, Any]], out_dir: Path) -> None:
    def mean(xs: list[float]) -> float:
        return statistics.fmean(xs) if xs else float("nan")

    table: list[dict[str, Any]] = []
    for name in ("rapidmoe", "llama-server"):
        for turn in range(args.turns):
            on = [r for r in rows if r["server"] == name and r["cache"] and r["turn"] == turn]
            off = [r for r in rows if r["server"] == name and not r["cache"] and r["turn"] == turn]
            table.append({"server": name, "turn": turn + 1, "prompt_tokens": mean([r["n_prompt"] for r in on]),
                          "cached_tokens": mean([r["n_cached"] for r in on]),
                          "ttft_cache_ms": mean([r["ttft_ms"] for r in on]),
                          "ttft_nocache_ms": mean([r["ttft_ms"] for r in off])})
            table[-1]["over_turn1"] = table[-1]["ttft_cache_ms"] / table[-(turn + 1)]["ttft_cache_ms"]
    later = {name: [r for r in rows if r["server"] == name and r["turn"] > 0] for name in ("rapidmoe", "llama-server")}
    summary: dict[str, Any] = {name: {"ttft_cache_ms": mean([r["ttft_ms"] for r in xs if r["cache"]]),
                      "ttft_nocache_ms": mean([r["ttft_ms"] for r in xs if not r["cache"]])}
               for name, xs in later.items()}
    for name, v in summary.items():
        v["speedup"] = v["ttft_nocache_ms"] / v["ttft_cache_ms"]
        v["turn1_ms"] = next(t["ttft_cache_ms"] for t in table if t["server"] == name and t["turn"] == 1)
    summary["ours_over_stock_cache"] = (summary["rapidmoe"]["ttft_cache_ms"]
                                        / summary["llama-server"]["ttft_cache_ms"])
    stem = Path(model).stem
    meta = {"model": str(model), "command": "python bench/bench_server.py " + " ".join(sys.argv[1:]),
            "threads": args.threads, "conversations": args.conversations, "turns": args.turns,
            "n_predict": args.n_predict, "user_words": args.user_words, "system_words": args.system_words,
            "residual": str(args.residual) if args.residual else None, "n_critical": args.n_critical,
            "stock_model": str(args.stock_model or model), "flash_attn": args.flash_attn,
            "cpu": cpu_name(), "loadavg_at_end": os.getloadavg(),
            "cpus": os.cpu_count(), "summary": summary, "per_turn": table, "rows": rows}
    atomic_write(out_dir / f"server-prefix-cache-{stem}.json", json.dumps(meta, indent=2) + "\n")
    lines = [f"# Prompt (prefix) cache, multi-turn TTFT: rapidmoe-cli serve vs stock llama-server ({stem})", "",
             f"`{meta['command']}`; {meta['cpu']}, {args.threads} thread(s), {args.parallel} slot(s), flash "
             f"attention {args.flash_attn}; rapidmoe on `{Path(model).name}`"
             + (f" + `{Path(args.residual).name}` at r = {args.n_critical}" if args.residual else "")
             + f", llama-server on `{Path(meta['stock_model']).name}`; {args.conversations} conversation(s) of "
             f"{args.turns} turns on a {args.system_words}-word system prompt, each turn appending a "
             f"~{args.user_words}-word user message and the previous {args.n_predict}-token answer (greedy); "
             + {"all": "every turn sent with `cache_prompt` true and false; ",
                "first": "turn 1 sent with `cache_prompt` true and false, later turns with true only; ",
                "none": "every turn sent with `cache_prompt` true only (turn 1 has nothing cached); "}[args.uncached]
             + f"load average at the end {meta['loadavg_at_end'][0]:.1f} on {os.cpu_count()} CPUs.", "",
             "Turns 2 and later (mean TTFT):", "",
             "| server | turn 1 TTFT ms | TTFT with cache ms | TTFT without cache ms | speedup |",
             "|---|---|---|---|---|"]
    for name in ("rapidmoe", "llama-server"):
        v = summary[name]
        lines.append(f"| {name} | {v['turn1_ms']:.1f} | {v['ttft_cache_ms']:.1f} | {_ms(v['ttft_nocache_ms'])} | "
                     + ("-" if math.isnan(v["speedup"]) else f"{v['speedup']:.2f}x") + " |")
    lines += ["", f"rapidmoe / llama-server TTFT with the cache: {summary['ours_over_stock_cache']:.2f}", "",
              "Per turn (mean over conversations):", "",
              "| server | turn | prompt tokens | cached tokens | TTFT cache ms | TTFT / turn 1 | TTFT no cache ms |",
              "|---|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['server']} | {t['turn']} | {t['prompt_tokens']:.0f} | {t['cached_tokens']:.0f} | "
                     f"{t['ttft_cache_ms']:.1f} | {t['over_turn1']:.3f} | {_ms(t['ttft_nocache_ms'])} |")
    atomic_write(out_dir / f"server-prefix-cache-{stem}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


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
    ap.add_argument("--multi-turn", action="store_true", help="benchmark the prompt cache (see above)")
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--user-words", type=int, default=40)
    ap.add_argument("--system-words", type=int, default=60, help="--multi-turn: words of each system prompt")
    ap.add_argument("--uncached", choices=("all", "first", "none"), default="all",
                    help="--multi-turn: send every turn with the cache off too, only the first, or none (turn 1 with "
                    "the cache on has nothing cached: its TTFT is the uncached one)")
    ap.add_argument("--parallel", type=int, default=2, help="--multi-turn: slots of each server")
    ap.add_argument("--residual", type=Path, default=None, help="--multi-turn: our sidecar (.wr.gguf) for --model")
    ap.add_argument("-r", "--n-critical", type=int, default=1, help="--multi-turn: r with --residual")
    ap.add_argument("--stock-model", type=Path, default=None, help="--multi-turn: llama-server's GGUF (--model)")
    ap.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()

    stock_bin = build_stock(["llama-server"])
    out_dir = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    logs = ROOT / "bench" / "out"
    logs.mkdir(parents=True, exist_ok=True)
    if args.multi_turn:
        model = args.model or small_model(logs)
        stock_model = args.stock_model or model
        common = ["-c", str(args.ctx), "-t", str(args.threads), "-fa", args.flash_attn]
        ours_extra = ["--residual", str(args.residual), "-r", str(args.n_critical)] if args.residual else []
        servers = {
            "rapidmoe": ServerProc(model, "--parallel", str(args.parallel), *common, *ours_extra,
                                   log_path=logs / "bench-cache-rapidmoe.log", ready_timeout=300),
            "llama-server": ServerProc(stock_model, "-m", str(stock_model), "--parallel", str(args.parallel), *common,
                                       "-tb",
                                       str(args.threads), "--cache-ram", "0", "--no-ui",
                                       log_path=logs / "bench-cache-stock.log", cmd=[str(stock_bin / "llama-server")],
                                       ready_timeout=300),
        }
        try:
            for s in servers.values():  # warm up
                one_request(s.port, _prompt(10_000, 20), 4)
            rows = multi_turn(servers, args.conversations, args.turns, args.n_predict, args.user_words,
                              args.system_words, args.uncached)
        finally:
            for s in servers.values():
                s.stop()
        multi_turn_report(args, model, rows, out_dir)
        return 0

    model = args.model or ensure_default_model()
    slots = str(max(args.levels))
    common = ["-c", str(args.ctx), "-t", str(args.threads)]
    servers = {
        "rapidmoe": ServerProc(model, "--parallel", slots, "--queue-size", "64", *common,
                               log_path=logs / "bench-server-rapidmoe.log"),
        "llama-server": ServerProc(model, "-m", str(model), "--parallel", slots, *common, "-tb", str(args.threads),
                                   "--cache-ram", "0", "--no-ui", log_path=logs / "bench-server-stock.log",
                                   cmd=[str(stock_bin / "llama-server")]),
    }
    rows = []
    try:
        for s in servers.values():  # warm up both
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
