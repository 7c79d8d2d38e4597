#!/usr/bin/env python3
"""Speed only, against ik_llama.cpp: our split pairs at fixed r against ik's llama-bench (`-rtr 1`) on stock files,
in alternating passes, medians over the passes, ratios to ik's Q4_K_M.

bench_frontier.py measures quality and speed in one run, but it keeps every variant's logits and reads every file
(F16 included) in each pass: on a 24 GB machine the page cache then cannot hold the files and the timings of
mmap'd weights move with the disk. This runs the speed half alone, over files bench_frontier.py made
(bench/out/frontier-work), and takes each point's KL from a frontier JSON (--kl-from) measured before.

  python bench/bench_ik_speed.py --ik /path/to/ik_llama.cpp/build --kl-from bench/out/frontier-NAME.json \\
      [--presets cpu-fast --r 0,1,2 --ik-types Q3_K_M,Q4_K_M,Q5_K_M,Q6_K --reps 3]
--ours-types TYPES adds our build on stock files alone (no sidecar: 'ours on Q3_K_M', its KL the stock type's).
Without --ik it times ours alone, against --stock-types run by the stock build's llama-bench; --ab VAR adds each
of our points with one of our kernel switches off (VAR=0), or set to another value (--ab VAR=VALUE, e.g.
RAPIDMOE_GEMM=avx2: our AVX2 gemms on an AVX-512 VNNI CPU), for a kernel's end-to-end effect in the same passes.
--ik-ab 'FLAGS' adds each ik point with more of its llama-bench flags (e.g. '-fmoe 0': its fused MoE up/gate op
off). With two or more ik stock types the table gives each point's decode against ik's frontier (its stock types'
Pareto front, linear in log KL) at the point's KL, and a last line checks the issue's condition over ik's KL range:
at every KL from ik's lowest to its highest, the fastest of our points at or below that KL is faster than ik's
frontier there (bench/common.py envelope_check).
Our points run with flash attention as llama-bench does (stock: auto, ik: on); before 2026-12-03 they ran
without it (llama_cpp.Llama's default), which cost them about 9 % of decode and prefill on the bench model.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import EnvelopeCheck, envelope_check, frontier_speed, pair_dir, pareto
from ik_peer import llama_bench, locate_or_build, run_llama_bench

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from stock_llama import build_stock  # noqa: E402  (tools/ on the path first)

WORK = ROOT / "bench" / "out" / "frontier-work"
PYTHON_LOOP = " (Python loop)"  # the name suffix of a point of ours timed through the earlier harness (--python-loop)

# One point of ours in a fresh process. pp: a prompt batch, the last token's logits only (as llama-bench's pp).
# Decode, as llama-bench's tg times it (since 2026-12-03): one random token per llama_decode (the low-level
# call, not Llama.eval), llama_synchronize, no logits read, after one untimed step; before, the decode loop ran
# through Llama.eval with every step's logits copied and the greedy token picked in Python, which read 1.09-1.18x
# slower when the two were compared (cfg "python_loop": that loop, for comparisons with earlier results).
OURS = r"""
import json, random, sys, time, numpy as np
from rapidmoe import Llama
from rapidmoe._runtime import llama_cpp as lc
cfg = json.loads(sys.argv[1])
llm = Llama(model_path=cfg["wq"], residual_path=cfg["wr"], n_critical=cfg["r"],  # wr None: a stock file alone
            n_ctx=max(cfg["pp"], cfg["depth"] + cfg["tg"] + 1) + 8,
            n_batch=cfg["pp"], n_ubatch=cfg["pp"], n_threads=2, n_threads_batch=2, logits_all=True, verbose=False,
            flash_attn=cfg["fa"])
toks = list(range(1000, 1000 + cfg["pp"]))
llm._logits_all = False
llm.eval(toks)  # warm-up
llm.reset(); llm._ctx.kv_cache_clear()
t0 = time.perf_counter(); llm.eval(toks); pp = cfg["pp"] / (time.perf_counter() - t0)
llm._logits_all = cfg["python_loop"]
llm.reset(); llm._ctx.kv_cache_clear()
context = toks[:8] if not cfg["depth"] else [1000 + i % 4000 for i in range(cfg["depth"])]  # --depth: a long context
for i in range(0, len(context), cfg["pp"]):
    llm.eval(context[i:i + cfg["pp"]])
if cfg["python_loop"]:
    def step(tok):
        llm.eval([tok])
        return int(np.argmax(llm.scores[llm.n_tokens - 1]))
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
else:
    ctx, one, rng, n_vocab = llm._ctx.ctx, (lc.llama_token * 1)(), random.Random(0), llm.n_vocab()
    def step(tok):
        one[0] = tok
        if lc.llama_decode(ctx, lc.llama_batch_get_one(one, 1)) != 0:
            raise SystemExit("llama_decode failed")
        lc.llama_synchronize(ctx)
        return rng.randrange(n_vocab)
    tok = rng.randrange(n_vocab)
tok = step(tok)  # one untimed step first, as llama-bench warms up
t0 = time.perf_counter()
for _ in range(cfg["tg"]):
    tok = step(tok)
tg = cfg["tg"] / (time.perf_counter() - t0)
llm.close()
print("RESULT " + json.dumps({"pp": pp, "tg": tg}))
"""


def run_ours(wq: Path, wr: Path | None, r: int, pp: int, tg: int, env: dict[str, str] | None = None,
             fa: str = "auto", depth: int = 0, python_loop: bool = False) -> dict[str, float]:
    cfg = {"wq": str(wq), "wr": str(wr) if wr is not None else None, "r": r, "pp": pp, "tg": tg, "fa": fa,
           "depth": depth, "python_loop": python_loop}
    out = subprocess.run([sys.executable, "-c", OURS, json.dumps(cfg)], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})})
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _ab_env(ab: str) -> dict[str, str]:
    """--ab's environment: VAR (=0) or VAR=VALUE, several joined by +."""
    env = {}
    for part in (x for x in ab.split("+") if x):
        var, _, value = part.partition("=")
        env[var] = value or "0"
    return env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ik", type=Path, default=None,
                    help="ik_llama.cpp build folder or source checkout (without it: no ik rows)")
    ap.add_argument("--kl-from", type=Path, default=None, help="a bench_frontier.py JSON: the points' KL")
    ap.add_argument("--stock-types", default="",
                    help="stock files also timed by the stock build's llama-bench (e.g. Q4_K_M), comma-separated")
    ap.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"],
                    help="our points' flash attention (default auto: as stock llama-bench; ik's runs it on)")
    ap.add_argument("--ab", action="append", default=[], metavar="VAR[=VALUE][+VAR2[=VALUE2]...]",
                    help="also time each of our points with VAR=0 (or VAR=VALUE) in the environment (one of our kernel "
                         "switches, e.g. RAPIDMOE_VEC_DOT_Q3_K, RAPIDMOE_GEMM=avx2; several joined by +, e.g. "
                         "RAPIDMOE_MOE_SUM+RAPIDMOE_TINY_RUN: both off); repeatable")
    ap.add_argument("--ik-ab", action="append", default=[], metavar="'FLAG VALUE ...'",
                    help="also time each ik point with these llama-bench flags added (e.g. '-fmoe 0': ik's fused MoE "
                         "up/gate op off), for what one of ik's features is worth in the same passes; repeatable")
    ap.add_argument("--model-stem", default="synthetic-qwen3moe-bench")
    ap.add_argument("--ours-types", default="",
                    help="stock files (types, comma-separated) our build runs alone, no sidecar: 'ours on Q3_K_M'; "
                         "with --ab RAPIDMOE_Q3_K_REPACK, our repacked Q3_K (patch 0021) against the plain layout")
    ap.add_argument("--presets", default="cpu-fast",
                    help="our pairs in bench/out/frontier-work, comma-separated: NAME, or NAME@MIXFILE for a preset "
                         "with a mix (common.pair_dir: <stem>.NAME+<mix file stem>)")
    ap.add_argument("--r", default="0,1,2")
    ap.add_argument("--preset-r", action="append", default=[], metavar="PRESET=R,R",
                    help="this preset's r values instead of --r (e.g. cpu-q8=1,2,3,4)")
    ap.add_argument("--no-ik-wq", action="store_true", help="leave out ik on our presets' .wq.gguf alone")
    ap.add_argument("--ik-types", default="Q3_K_M,Q4_K_M,Q5_K_M,Q6_K")
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--depth", type=int, default=0,
                    help="time decode after a context of this many tokens (ik: llama-bench -gp DEPTH,TG); prefill "
                         "stays pp from an empty cache; not with --stock-types")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--python-loop", action="store_true",
                    help="also time each of our points with its decode steps through Llama.eval, logits copied and "
                         "the greedy token picked in Python (the harness before 2026-12-03)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "ik-speed.json")
    args = ap.parse_args()
    if args.depth and args.stock_types:
        ap.error("--depth times ik's and our decode only (stock llama-bench's -d moves its prefill too)")
    ik = locate_or_build(args.ik) if args.ik is not None else None
    stock_bench = build_stock(["llama-bench"]) / "llama-bench" if args.stock_types else None
    kl = ({row["variant"]: row["kl_mean"] for row in json.loads(args.kl_from.read_text())["rows"]}
          if args.kl_from is not None else {})
    points: dict[str, tuple[Any, ...]] = {}
    if any("=" not in x for x in args.preset_r):
        ap.error("--preset-r takes PRESET=R,R (e.g. cpu-q8=1,2,3,4)")
    preset_r = dict(x.split("=", 1) for x in args.preset_r)
    ik_frontier: list[str] = []  # ik's stock types as shipped: its frontier
    for t in (t for t in args.ik_types.split(",") if t and ik is not None):
        points[f"ik {t} -rtr"] = (WORK / f"{args.model_stem}.{t}.gguf", f"stock {t}")
        ik_frontier.append(f"ik {t} -rtr")
        for extra in args.ik_ab:
            points[f"ik {t} -rtr {extra}"] = (WORK / f"{args.model_stem}.{t}.gguf", f"stock {t}", extra.split())
    for t in (t for t in args.stock_types.split(",") if t):
        points[f"stock {t} (llama-bench)"] = (WORK / f"{args.model_stem}.{t}.gguf", f"stock {t}")
    for t in (t for t in args.ours_types.split(",") if t):
        stock_file = WORK / f"{args.model_stem}.{t}.gguf"
        points[f"ours on {t}"] = (stock_file, None, 0, {})
        for ab in args.ab:
            env = _ab_env(ab)
            points[f"ours on {t}, {'+'.join(f'{k}={v}' for k, v in env.items())}"] = (stock_file, None, 0, env)
    for p in (p for p in args.presets.split(",") if p):
        pair = pair_dir(WORK, args.model_stem, p)
        wq, wr = pair / f"{args.model_stem}.wq.gguf", pair / f"{args.model_stem}.wr.gguf"
        if ik is not None and not args.no_ik_wq:
            points[f"ik {p} .wq.gguf -rtr"] = (wq, f"ours {p} r=0")
            for extra in args.ik_ab:
                points[f"ik {p} .wq.gguf -rtr {extra}"] = (wq, f"ours {p} r=0", extra.split())
        for r in (int(x) for x in preset_r.get(p, args.r).split(",") if x):
            points[f"ours {p} r={r}"] = (wq, wr, r, {})
            if args.python_loop:
                points[f"ours {p} r={r}{PYTHON_LOOP}"] = (wq, wr, r, {})
            for ab in args.ab:
                env = _ab_env(ab)
                points[f"ours {p} r={r}, {'+'.join(f'{k}={v}' for k, v in env.items())}"] = (wq, wr, r, env)
    times: dict[str, dict[str, list[float]]] = {name: {"pp": [], "tg": []} for name in points}
    for rep in range(args.reps):
        order = list(points) if rep % 2 == 0 else list(reversed(points))
        for name in order:
            spec = points[name]
            t0 = time.perf_counter()
            if name.startswith("ik ") and ik is not None:
                res = llama_bench(ik, spec[0], args.pp, args.tg, depth=args.depth,
                                  extra=spec[2] if len(spec) > 2 else None)
                pp, tg = res["pp_tps"], res["tg_tps"]
            elif name.startswith("stock ") and stock_bench is not None:
                res = run_llama_bench(stock_bench, spec[0], args.pp, args.tg)
                pp, tg = res["pp_tps"], res["tg_tps"]
            else:
                res = run_ours(spec[0], spec[1], spec[2], args.pp, args.tg, env=spec[3], fa=args.flash_attn,
                               depth=args.depth, python_loop=name.endswith(PYTHON_LOOP))
                pp, tg = res["pp"], res["tg"]
            times[name]["pp"].append(pp)
            times[name]["tg"].append(tg)
            print(f"rep {rep} {name}: pp {pp:.1f} tg {tg:.2f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows: list[dict[str, Any]] = []
    for name, spec in points.items():
        kl_name = (spec[1] if name.startswith(("ik ", "stock ")) else
                   "stock " + name.split(", ")[0].removeprefix("ours on ") if name.startswith("ours on ") else
                   name.split(", ")[0].removesuffix(PYTHON_LOOP))
        rows.append({"variant": name, "kl_mean": kl.get(str(kl_name)), "pp_tps": statistics.median(times[name]["pp"]),
                     "tg_tps": statistics.median(times[name]["tg"]), "pp_all": times[name]["pp"],
                     "tg_all": times[name]["tg"]})
    # the ratios' baseline: ik's Q4_K_M where ik ran, else stock llama.cpp's Q4_K_M, else the first row
    base_name = next((n for n in ("ik Q4_K_M -rtr", "stock Q4_K_M (llama-bench)") if n in points), rows[0]["variant"])
    base = next(x for x in rows if x["variant"] == base_name)
    for x in rows:
        x["decode_vs_base"] = x["tg_tps"] / base["tg_tps"]
        x["prefill_vs_base"] = x["pp_tps"] / base["pp_tps"]
    envelope = _ik_frontier(rows, ik_frontier)
    result = {"ik_commit": ik.commit if ik is not None else None, "reps": args.reps, "pp": args.pp, "tg": args.tg,
              "baseline": base_name, "rows": rows, "kl_from": str(args.kl_from) if args.kl_from else None,
              "ik_envelope": dataclasses.asdict(envelope) if envelope is not None else None,
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    args.out.write_text(json.dumps(result, indent=1))
    print(f"| variant | KL vs F16 | decode tok/s (median) | pp{args.pp} tok/s (median) | decode / {base_name} "
          f"| prefill / {base_name} | decode / ik frontier at its KL |")
    print("|---|---|---|---|---|---|---|")
    for x in rows:
        klv = f"{x['kl_mean']:.4f}" if x["kl_mean"] is not None else "-"
        ikf = x.get("decode_vs_ik_frontier")
        ikv = f"{ikf:.2f}x ({x['ik_frontier_how']})" if ikf is not None else "-"
        print(f"| {x['variant']} | {klv} | {x['tg_tps']:.2f} | {x['pp_tps']:.1f} | "
              f"{x['decode_vs_base']:.2f}x | {x['prefill_vs_base']:.2f}x | {ikv} |")
    if envelope is not None:
        print(f"\nOur points (timed llama-bench-style, switches as shipped) against ik's frontier of stock types, "
              f"KL {envelope.lo:.4f} to {envelope.hi:.4f}: the fastest of ours at or below each KL is "
              f"{'ahead everywhere' if envelope.holds else 'behind somewhere'}; least ahead at KL "
              f"{envelope.worst_kl:.4f}: {envelope.worst_ratio:.2f}x ik's frontier there")
    return 0


def _ik_frontier(rows: list[dict[str, Any]], ik_frontier: list[str]) -> EnvelopeCheck | None:
    """Each row's decode against ik's frontier (its stock types' Pareto front, linear in log KL) at the row's KL, and
    the envelope check of our plain points (no switch changed, not the Python loop) over ik's KL range; None without
    two ik stock types with a KL."""
    ik_pts = [(x["kl_mean"], x["tg_tps"]) for x in rows if x["variant"] in ik_frontier and x["kl_mean"] is not None]
    if len(ik_pts) < 2:
        return None
    front = pareto(ik_pts)
    for x in rows:
        if x["kl_mean"] is not None:
            spd, how = frontier_speed(front, x["kl_mean"])
            x["decode_vs_ik_frontier"], x["ik_frontier_how"] = x["tg_tps"] / spd, how
    ours = [(x["kl_mean"], x["tg_tps"]) for x in rows if x["variant"].startswith("ours ") and x["kl_mean"] is not None
            and ", " not in x["variant"] and not x["variant"].endswith(PYTHON_LOOP)]
    return envelope_check(ours, ik_pts) if ours else None


if __name__ == "__main__":
    sys.exit(main())
