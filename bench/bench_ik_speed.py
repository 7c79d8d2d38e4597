#!/usr/bin/env python3
"""Speed only, against ik_llama.cpp: our split pairs at fixed r against ik's llama-bench (`-rtr 1`) on stock files,
in alternating passes, medians over the passes, ratios to ik's Q4_K_M.

bench_frontier.py measures quality and speed in one run, but it keeps every variant's logits and reads every file
(F16 included) in each pass: on a 24 GB machine the page cache then cannot hold the files and the timings of
mmap'd weights move with the disk. This runs the speed half alone, over files bench_frontier.py made
(bench/out/frontier-work), and takes each point's KL from a frontier JSON (--kl-from) measured before.

  python bench/bench_ik_speed.py --ik /path/to/ik_llama.cpp/build --kl-from bench/out/frontier-NAME.json \\
      [--presets cpu-fast --r 0,1,2 --ik-types Q3_K_M,Q4_K_M,Q5_K_M,Q6_K --reps 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ik_peer import llama_bench, locate_or_build

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / "out" / "frontier-work"

# One point of ours in a fresh process, timed as bench_frontier.py's MEASURE times it (pp: the prompt's last logits
# only; decode: one token per llama_decode, logits copied, greedy)
OURS = r"""
import json, sys, time, numpy as np
from rapidmoe import Llama
cfg = json.loads(sys.argv[1])
llm = Llama(model_path=cfg["wq"], residual_path=cfg["wr"], n_critical=cfg["r"], n_ctx=cfg["pp"] + 8,
            n_batch=cfg["pp"], n_ubatch=cfg["pp"], n_threads=2, n_threads_batch=2, logits_all=True, verbose=False)
toks = list(range(1000, 1000 + cfg["pp"]))
llm._logits_all = False
llm.eval(toks)  # warm-up
llm.reset(); llm._ctx.kv_cache_clear()
t0 = time.perf_counter(); llm.eval(toks); pp = cfg["pp"] / (time.perf_counter() - t0)
llm._logits_all = True
llm.reset(); llm._ctx.kv_cache_clear(); llm.eval(toks[:8]); tok = int(np.argmax(llm.scores[7]))
t0 = time.perf_counter()
for _ in range(cfg["tg"]):
    llm.eval([tok]); tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
tg = cfg["tg"] / (time.perf_counter() - t0)
llm.close()
print("RESULT " + json.dumps({"pp": pp, "tg": tg}))
"""


def run_ours(wq: Path, wr: Path, r: int, pp: int, tg: int) -> dict[str, float]:
    cfg = {"wq": str(wq), "wr": str(wr), "r": r, "pp": pp, "tg": tg}
    out = subprocess.run([sys.executable, "-c", OURS, json.dumps(cfg)], capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ik", type=Path, required=True, help="ik_llama.cpp build folder or source checkout")
    ap.add_argument("--kl-from", type=Path, required=True, help="a bench_frontier.py JSON: the points' KL")
    ap.add_argument("--model-stem", default="synthetic-qwen3moe-bench")
    ap.add_argument("--presets", default="cpu-fast")
    ap.add_argument("--r", default="0,1,2")
    ap.add_argument("--ik-types", default="Q3_K_M,Q4_K_M,Q5_K_M,Q6_K")
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "ik-speed.json")
    args = ap.parse_args()
    ik = locate_or_build(args.ik)
    kl = {row["variant"]: row["kl_mean"] for row in json.loads(args.kl_from.read_text())["rows"]}
    points: dict[str, tuple[Any, ...]] = {}
    for t in (t for t in args.ik_types.split(",") if t):
        points[f"ik {t} -rtr"] = (WORK / f"{args.model_stem}.{t}.gguf", f"stock {t}")
    for p in (p for p in args.presets.split(",") if p):
        pair = WORK / f"{args.model_stem}.{p}"
        wq, wr = pair / f"{args.model_stem}.wq.gguf", pair / f"{args.model_stem}.wr.gguf"
        points[f"ik {p} .wq.gguf -rtr"] = (wq, f"ours {p} r=0")
        for r in (int(x) for x in args.r.split(",") if x):
            points[f"ours {p} r={r}"] = (wq, wr, r)
    times: dict[str, dict[str, list[float]]] = {name: {"pp": [], "tg": []} for name in points}
    for rep in range(args.reps):
        order = list(points) if rep % 2 == 0 else list(reversed(points))
        for name in order:
            spec = points[name]
            t0 = time.perf_counter()
            if name.startswith("ik "):
                res = llama_bench(ik, spec[0], args.pp, args.tg)
                pp, tg = res["pp_tps"], res["tg_tps"]
            else:
                res = run_ours(spec[0], spec[1], spec[2], args.pp, args.tg)
                pp, tg = res["pp"], res["tg"]
            times[name]["pp"].append(pp)
            times[name]["tg"].append(tg)
            print(f"rep {rep} {name}: pp {pp:.1f} tg {tg:.2f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows: list[dict[str, Any]] = []
    for name, spec in points.items():
        kl_name = spec[1] if name.startswith("ik ") else name
        rows.append({"variant": name, "kl_mean": kl.get(str(kl_name)), "pp_tps": statistics.median(times[name]["pp"]),
                     "tg_tps": statistics.median(times[name]["tg"]), "pp_all": times[name]["pp"],
                     "tg_all": times[name]["tg"]})
    q4 = next((x for x in rows if x["variant"] == "ik Q4_K_M -rtr"), None)
    for x in rows:
        if q4:
            x["decode_vs_ik_q4_k_m"] = x["tg_tps"] / q4["tg_tps"]
            x["prefill_vs_ik_q4_k_m"] = x["pp_tps"] / q4["pp_tps"]
    result = {"ik_commit": ik.commit, "reps": args.reps, "pp": args.pp, "tg": args.tg, "rows": rows,
              "kl_from": str(args.kl_from), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    args.out.write_text(json.dumps(result, indent=1))
    print("| variant | KL vs F16 | decode tok/s (median) | pp512 tok/s (median) | decode / ik Q4_K_M "
          "| prefill / ik Q4_K_M |")
    print("|---|---|---|---|---|---|")
    for x in rows:
        klv = f"{x['kl_mean']:.4f}" if x["kl_mean"] is not None else "-"
        print(f"| {x['variant']} | {klv} | {x['tg_tps']:.2f} | {x['pp_tps']:.1f} | "
              f"{x.get('decode_vs_ik_q4_k_m', 0):.2f}x | {x.get('prefill_vs_ik_q4_k_m', 0):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
