#!/usr/bin/env python3
"""The CPU quantization frontier: stock llama.cpp's types against RapidMoE's presets x r x UMIA, in one run.

A CPU-only user picks a GGUF type by trading decode speed against quality. This benchmark measures, on one
model and in one run, stock llama.cpp of the same pin at Q2_K ... Q8_0 (and IQ4_XS) and ours (each preset's
.wq.gguf + .wr.gguf at fixed r, and UMIA policies calibrated on other text), each variant in a fresh process:

- decode tokens/s (--tg single-token steps after an 8-token prompt) at 2 threads and at 1 thread,
- prefill tokens/s (one batch of --pp tokens: pp512 by default),
- weight bytes read per decoded token (experts: from the types and, for ours, the critical-slot counters),
- KL divergence to the F16 model and top-1 agreement over --chunks x --n-ctx held-out tokens (evaluated as prompt
  batches; a UMIA policy is forced to its decode-phase thresholds there, so its KL belongs to its decode speed).

Stock's Pareto-optimal points make the frontier line (decode tok/s against log KL); for each of our points the
table gives the ratio of its decode speed to that line interpolated at the same KL (beyond the line's lowest KL
the ratio is to stock's lowest-KL point, which is then also worse in quality: marked ">").
With --ik, ik_llama.cpp (the fastest CPU engine, bench/ik_peer.py) is a second peer in the same run: its
llama-bench with run-time repacking (-rtr 1) on --ik-types' stock files and on our presets' .wq.gguf alone, its own
frontier line, and our ratios to it. Stock llama.cpp's own llama-bench on Q4_K_M is measured too: our and stock's
numbers come from a Python harness, ik's from llama-bench, and that row shows how far the two harnesses differ.
The harness runs without flash attention (llama_cpp.Llama's default, the same for our and stock's rows, and the KL
is measured so), while both llama-benches run with it: about 9 % of our decode and prefill on the bench model
(bench/results/archive/ik-speed-qwen3moe-bench-zen5-avx512.md). bench_ik_speed.py times ours with flash attention, as
llama-bench does.
Repetitions run variants in alternating order; medians are reported (the machine is shared and noisy).

Usage:
  python bench/bench_frontier.py --arch qwen3moe --size bench            # the bench-size synthetic model
  python bench/bench_frontier.py --model ../shared/models/tiny-moe-a/model-f16.gguf --name tiny-moe-a
  python bench/bench_frontier.py --presets cpu-fast,cpu --ik ~/ik_llama.cpp       # with ik_llama.cpp as a peer
Writes bench/out/frontier-<name>.{json,md,png} (copy to bench/results/ to publish). The files it makes on the way
are kept in bench/out/frontier-work/ (the synthetic models) or, for a --model of yours, in a folder of that model's
own there (frontier-work/<model folder>-<file stem>-<digest of path, size and time>/).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from rapidmoe.calibration.measure import calibrate_latency
from rapidmoe.calibration.umia import calibrate
from rapidmoe.ggufio import GGUFFile
from rapidmoe.umia.latency import load_latency_model
from rapidmoe.umia.policy import policy_from_dict

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "bench"))
from bench_split import file_bytes_per_token, measure_bandwidth, run_variant  # noqa: E402
from common import (  # noqa: E402
    K_QUANTS,
    ensure_pair,
    ensure_synthetic,
    frontier_speed,
    kl_at_bytes,
    kl_stats,
    pareto,
    pyplot,
    source_key,
)
from ik_peer import IK_COMMIT, llama_bench, locate_or_build, run_llama_bench  # noqa: E402
from stock_llama import build_stock  # noqa: E402

OUT = ROOT / "bench" / "out"
SHARED = ROOT.parent / "shared" / "models" / "tiny-moe-a"

STOCK_TYPES = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS")

# One variant in a fresh process (stock: llama_cpp over the stock build; ours: rapidmoe.Llama); prints one JSON
# line: prefill and decode timings per repetition, the MoE counters, and the logits of the KL chunks (saved).
MEASURE = r"""
import json, sys, time, numpy as np
cfg = json.loads(sys.argv[1])
if cfg["ours"]:
    from rapidmoe import Llama
    from rapidmoe._runtime import llama_cpp as lc
    kw = dict(residual_path=cfg["residual"], n_critical=cfg.get("r", 0))
else:
    import llama_cpp as lc
    from llama_cpp import Llama
    kw = {}
llm = Llama(model_path=cfg["model"], n_ctx=max(cfg["n_ctx"], cfg["pp"] + 8), n_batch=cfg["pp"], n_ubatch=cfg["pp"],
            n_threads=2, n_threads_batch=2, logits_all=True, verbose=False, **kw)
if cfg.get("policy"):
    llm.set_policy(cfg["policy"])
res = {"pp_tps": [], "tg_tps": {"2": [], "1": []}}

def decode(threads):
    lc.llama_set_n_threads(llm._ctx.ctx, threads, threads)
    llm.reset(); llm._ctx.kv_cache_clear()
    llm.eval(cfg["pp_tokens"][:8])
    tok = int(np.argmax(llm.scores[7]))
    t0 = time.perf_counter()
    for _ in range(cfg["tg"]):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return cfg["tg"] / (time.perf_counter() - t0)

llm._logits_all = False
llm.eval(cfg["pp_tokens"])  # warm-up: a prompt batch reads every expert (pages in mmap'd weights), graphs allocated
llm._logits_all = True
decode(2)
for rep in range(cfg["reps"]):
    lc.llama_set_n_threads(llm._ctx.ctx, 2, 2)
    llm.reset(); llm._ctx.kv_cache_clear()
    llm._logits_all = False  # as llama-bench's pp: the prompt's last logits only (the head is not run 512 times)
    t0 = time.perf_counter()
    llm.eval(cfg["pp_tokens"])
    res["pp_tps"].append(len(cfg["pp_tokens"]) / (time.perf_counter() - t0))
    llm._logits_all = True
    if rep == 0 and cfg["ours"]:
        llm.moe_counters(reset=True)
    res["tg_tps"]["2"].append(decode(2))
    if rep == 0 and cfg["ours"]:
        c = llm.moe_counters()
        n = max(x.tokens for x in c)
        res["decode_tokens"] = n
        res["wq_bytes_per_token"] = sum(x.wq_bytes for x in c) / n
        res["wr_bytes_per_token"] = sum(x.wr_bytes for x in c) / n
        res["critical_fraction"] = sum(x.critical_slots for x in c) / max(1, sum(x.slots for x in c))
    if cfg["one_thread"]:
        res["tg_tps"]["1"].append(decode(1))
lc.llama_set_n_threads(llm._ctx.ctx, 2, 2)
if cfg.get("policy"):  # KL with the thresholds decode runs (the chunks are prompt batches: prefill's otherwise)
    import dataclasses
    llm.set_policy(dataclasses.replace(llm.policy, phase="decode"))
logits = []
for ch in cfg["chunks"]:
    llm.reset(); llm._ctx.kv_cache_clear()
    llm.eval(ch)
    logits.append(np.array(llm.scores[:len(ch)], dtype=np.float32))
np.save(cfg["logits_out"], np.concatenate(logits))
llm.close()
print("RESULT " + json.dumps(res))
"""


# -- the stock frontier and the ratios -----------------------------------------------------------------------

# -- setup ---------------------------------------------------------------------------------------------------

def stock_file(model: Path, ftype: str, work: Path, quantize: Path) -> Path:
    p = work / f"{model.stem}.{ftype}.gguf"
    if not p.exists():
        tmp = p.with_name(p.name + ".tmp")
        subprocess.run([str(quantize), str(model), str(tmp), ftype, "2"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.replace(tmp, p)
    return p


def our_pair(model: Path, preset: str, work: Path) -> tuple[Path, Path]:
    """A preset spec's pair (common.ensure_pair: NAME, or NAME@MIXFILE for a preset with a mix)."""
    return ensure_pair(model, work, preset)


def kernels_key() -> str:
    """A short hash of our patches and CPU kernels: what a cached latency measurement depends on besides the files."""
    src = ROOT / "src" / "rapidmoe_ggml"
    h = hashlib.sha256()
    kernels = [f for d in ("ops", "backend") for f in (src / d).rglob("*") if f.is_file()]
    for f in sorted([*(src / "patches").glob("*.patch"), *kernels]):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:10]


def umia_policies(wq: Path, wr: Path, calib: Path, work: Path, n: int) -> list[tuple[str, str]]:
    """Calibrate UMIA on `calib` (latency model measured here, then the frontier search) and return up to n of its
    UMIA frontier policies as (label, policy.json path), cached in work/."""
    # one calibration per preset and per build of our kernels (the latency model is measured with them)
    d = work / f"{wq.parent.name}.{kernels_key()}.umia"
    d.mkdir(exist_ok=True)
    lat_path = d / "latency.json"
    if lat_path.exists():
        lat = load_latency_model(lat_path)
    else:
        lat = calibrate_latency(wq, wr, threads=2)
        lat.save(lat_path)
    front_path = d / "frontier.json"
    if not front_path.exists():
        res = calibrate(wq, wr, calib, lat, n_tokens=512, chunk=128, threads=2, progress=True)
        res.save(d)
    front = json.loads(front_path.read_text())
    evals = front["evaluations"]
    umia = [evals[i] for i in front["frontier"] if evals[i]["kind"] == "umia"]
    picks = umia if len(umia) <= n else [umia[round(j * (len(umia) - 1) / (n - 1))] for j in range(n)] if n > 1 \
        else umia[:1]
    out = []
    for j, e in enumerate(picks):
        p = d / f"policy-{j}.json"
        pol = policy_from_dict(e["policy"])
        pol.save(p)
        out.append((f"UMIA {pol.describe()}", str(p)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="F16/F32 MoE GGUF (default: a synthetic one)")
    ap.add_argument("--name", default=None, help="name in the output files (default: the model's stem)")
    ap.add_argument("--arch", default="qwen3moe")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--stock", default=",".join(STOCK_TYPES), help="stock llama-quantize types, comma-separated")
    ap.add_argument("--presets", default="cpu,cpu-q8",
                    help="our presets, comma-separated; NAME@MIXFILE: with the mix in MIXFILE (convert --mix-bits's "
                         "NAME.mix.json, or a text file holding a mix string)")
    ap.add_argument("--r", default="0,1,2", help="fixed r values (comma-separated) for every preset")
    ap.add_argument("--umia", type=int, default=2, help="UMIA policies per preset (calibrated on --calib; 0: none)")
    ap.add_argument("--umia-presets", default=None, help="the presets that get UMIA points (default: all of --presets)")
    ap.add_argument("--eval", type=Path, default=None, help="held-out text for KL (default: shared eval.txt)")
    ap.add_argument("--calib", type=Path, default=None, help="UMIA calibration text (default: shared calib.txt)")
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-one-thread", action="store_true", help="skip the 1-thread decode measurement")
    ap.add_argument("--ik", type=Path, default=None,
                    help="ik_llama.cpp build folder or source checkout (bench/ik_peer.py): measure it as a peer")
    ap.add_argument("--ik-types", default="Q3_K_M,Q4_K_M,Q5_K_M,Q6_K",
                    help="the stock files ik_llama.cpp runs (each must be in --stock)")
    ap.add_argument("--ik-wq", default=None, help="presets whose .wq.gguf ik_llama.cpp runs alone (default: all)")
    ap.add_argument("--render", type=Path, default=None,
                    help="write the Markdown table of a finished run's JSON again (bench/out/frontier-NAME.md beside "
                         "it), running nothing")
    args = ap.parse_args()
    if args.render is not None:
        args.render.with_suffix(".md").write_text(to_markdown(json.loads(args.render.read_text())))
        print(args.render.with_suffix(".md").read_text())
        return 0

    OUT.mkdir(parents=True, exist_ok=True)
    work = OUT / "frontier-work"
    work.mkdir(exist_ok=True)
    t_setup = time.perf_counter()
    if args.model is None:
        args.model = ensure_synthetic(work / f"synthetic-{args.arch}-{args.size}.gguf", args.arch, args.size)
    args.model = args.model.resolve()
    name = args.name or args.model.stem
    if args.model.parent != work.resolve():  # a model of the user's: its own folder (two trained models are both
        work = work / source_key(args.model)  # model-f16.gguf; their stock files and pairs must not be shared)
        work.mkdir(exist_ok=True)
    stock_bin = build_stock(["llama", "llama-quantize"] + (["llama-bench"] if args.ik else []))
    stock_types = [s for s in args.stock.split(",") if s]
    ik_types = [t for t in args.ik_types.split(",") if t] if args.ik else []
    if not set(ik_types) <= set(stock_types) or (ik_types and "Q4_K_M" not in stock_types):
        ap.error("--ik-types must be among --stock types, and --stock must have Q4_K_M (the harness comparison)")
    ik = locate_or_build(args.ik) if args.ik else None
    if ik is not None:
        print(f"ik_llama.cpp: {ik.bench} at commit {ik.commit} (published numbers: {IK_COMMIT})", flush=True)
    files = {ft: stock_file(args.model, ft, work, stock_bin / "llama-quantize") for ft in stock_types}
    presets = [p for p in args.presets.split(",") if p]
    pairs = {p: our_pair(args.model, p, work) for p in presets}
    calib = args.calib or (SHARED / "calib.txt")
    umia_presets = presets if args.umia_presets is None else [p for p in args.umia_presets.split(",") if p]
    policies = {p: (umia_policies(*pairs[p], calib, work, args.umia) if args.umia > 0 and p in umia_presets else [])
                for p in presets}
    setup_s = time.perf_counter() - t_setup

    from rapidmoe import Llama  # noqa: PLC0415  (compiled part, loaded on first use)

    f = GGUFFile(args.model)
    arch = f.get("general.architecture")
    k = int(f.get(f"{arch}.expert_used_count"))
    tok = Llama(args.model, n_ctx=args.n_ctx, vocab_only=True, verbose=False)
    eval_path = args.eval or (SHARED / "eval.txt")
    text = eval_path.read_text()
    toks = tok.tokenize(text.encode(), add_bos=False, special=False)
    tok.close()
    chunks = [toks[i * args.n_ctx:(i + 1) * args.n_ctx] for i in range(args.chunks)]
    pp_tokens = toks[-args.pp:]
    base = {"n_ctx": args.n_ctx, "pp": args.pp, "tg": args.tg, "reps": 1, "chunks": chunks, "pp_tokens": pp_tokens,
            "one_thread": not args.no_one_thread}

    variants: list[dict[str, Any]] = [{"variant": "stock F16", "kind": "stock", "type": "F16", "model": args.model}]
    variants += [{"variant": f"stock {ft}", "kind": "stock", "type": ft, "model": files[ft]} for ft in stock_types]
    for p in presets:
        wq, wr = pairs[p]
        variants += [{"variant": f"ours {p} r={r}", "kind": "ours", "preset": p, "r": int(r), "model": wq,
                      "residual": wr} for r in args.r.split(",") if r != "" and int(r) <= k]
        variants += [{"variant": f"ours {p} {label}", "kind": "ours", "preset": p, "policy": path, "model": wq,
                      "residual": wr} for label, path in policies[p]]
    if ik is not None:  # measured by llama-bench; the KL of the same weights comes from the variant named in kl_from
        variants += [{"variant": f"ik {ft} -rtr", "kind": "ik", "type": ft, "model": files[ft],
                      "kl_from": f"stock {ft}"} for ft in ik_types]
        variants += [{"variant": f"ik {p} .wq.gguf -rtr", "kind": "ik", "preset": p, "model": pairs[p][0],
                      "kl_from": f"ours {p} r=0"} for p in (args.ik_wq.split(",") if args.ik_wq else presets)]
        variants.append({"variant": "stock Q4_K_M llama-bench", "kind": "stock-bench", "type": "Q4_K_M",
                         "model": files["Q4_K_M"], "kl_from": "stock Q4_K_M"})
    missing = {v["kl_from"] for v in variants if "kl_from" in v} - {v["variant"] for v in variants}
    if missing:
        ap.error(f"no variant measures the KL of {sorted(missing)} (add r=0 to --r, or the type to --stock)")

    bandwidth = {"2": measure_bandwidth(threads=2), "1": measure_bandwidth(threads=1)}  # the roofline, this run
    runs: dict[str, list[dict[str, Any]]] = {v["variant"]: [] for v in variants}
    logits: dict[str, np.ndarray] = {}
    for rep in range(args.reps):  # alternating order: rep 0 forward, rep 1 backward, ...
        order = variants if rep % 2 == 0 else variants[::-1]
        for v in order:
            if v["kind"] in ("ik", "stock-bench"):
                lb = llama_bench(ik, v["model"], args.pp, args.tg) if v["kind"] == "ik" and ik is not None else \
                    run_llama_bench(stock_bin / "llama-bench", v["model"], args.pp, args.tg)
                runs[v["variant"]].append({"pp_tps": [lb["pp_tps"]], "tg_tps": {"2": [lb["tg_tps"]], "1": []}})
                print(f"rep {rep} {v['variant']}: pp {lb['pp_tps']:.1f} tg2 {lb['tg_tps']:.2f}", flush=True)
                continue
            cfg = {**base, "ours": v["kind"] == "ours", "model": str(v["model"]),
                   "logits_out": str(work / f"logits-{abs(hash(v['variant']))}.npy")}
            if v["kind"] == "ours":
                cfg.update(residual=str(v["residual"]), r=v.get("r", 0), policy=v.get("policy"))
            res, lg = run_variant(cfg, stock_bin if v["kind"] == "stock" else None, MEASURE)
            runs[v["variant"]].append(res)
            logits.setdefault(v["variant"], lg)
            print(f"rep {rep} {v['variant']}: pp {res['pp_tps'][0]:.1f} tg2 {res['tg_tps']['2'][0]:.2f}", flush=True)

    ref = logits["stock F16"]
    rows = []
    for v in variants:
        rr = runs[v["variant"]]
        other, experts = file_bytes_per_token(Path(v["model"]))
        if v["kind"] == "ours":
            experts = rr[0]["wq_bytes_per_token"] + rr[0]["wr_bytes_per_token"]
        size = Path(v["model"]).stat().st_size + (Path(v["residual"]).stat().st_size if "residual" in v else 0)
        tg1 = [x for r in rr for x in r["tg_tps"]["1"]]
        tg2 = float(np.median([x for r in rr for x in r["tg_tps"]["2"]]))
        rows.append({"variant": v["variant"], "kind": v["kind"], "preset": v.get("preset"), "r": v.get("r"),
                     "policy": v.get("policy"), "file_mb": size / 1e6,
                     "pp_tps": float(np.median([x for r in rr for x in r["pp_tps"]])),
                     "tg_tps": tg2,
                     "tg1_tps": float(np.median(tg1)) if tg1 else None,
                     "mb_per_token": (other + experts) / 1e6,
                     "gb_per_s": (other + experts) / 1e9 * tg2,
                     "critical_fraction": rr[0].get("critical_fraction"),
                     **kl_stats(ref, logits[v.get("kl_from", v["variant"])])})
    stock_pts = [(x["kl_mean"], x["tg_tps"]) for x in rows if x["kind"] == "stock" and x["variant"] != "stock F16"]
    front = pareto(stock_pts)
    ik_front = pareto([(x["kl_mean"], x["tg_tps"]) for x in rows if x["kind"] == "ik" and x["preset"] is None])
    q4 = next((x for x in rows if x["variant"] == "stock Q4_K_M"), None)
    ik_q4 = next((x for x in rows if x["variant"] == "ik Q4_K_M -rtr"), None)
    for x in rows:
        spd, how = frontier_speed(front, x["kl_mean"])
        x["frontier_tps"], x["frontier_how"] = spd, how
        x["ratio_to_frontier"] = x["tg_tps"] / spd
        x["decode_vs_q4_k_m"] = x["tg_tps"] / q4["tg_tps"] if q4 else None
        x["prefill_vs_q4_k_m"] = x["pp_tps"] / q4["pp_tps"] if q4 else None
        if ik_front:
            spd, how = frontier_speed(ik_front, x["kl_mean"])
            x["ik_frontier_tps"], x["ik_frontier_how"], x["ratio_to_ik_frontier"] = spd, how, x["tg_tps"] / spd
        if ik_q4:
            x["decode_vs_ik_q4_k_m"] = x["tg_tps"] / ik_q4["tg_tps"]
            x["prefill_vs_ik_q4_k_m"] = x["pp_tps"] / ik_q4["pp_tps"]
    result = {"model": str(args.model), "name": name, "model_gb": args.model.stat().st_size / 1e9, "top_k": k,
              "kl_tokens": sum(len(c) for c in chunks), "pp": args.pp, "tg": args.tg, "reps": args.reps,
              "setup_s": setup_s, "read_bandwidth_gbs": bandwidth, "stock_frontier": front, "rows": rows,
              "ik_frontier": ik_front, "ik_commit": ik.commit if ik else None,
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    stem = OUT / f"frontier-{name}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(to_markdown(result))
    plot(result, stem.with_suffix(".png"))
    print(to_markdown(result))
    return 0


def to_markdown(r: dict[str, Any]) -> str:
    ik = bool(r.get("ik_frontier"))
    lines = [f"Model `{Path(r['model']).name}` ({r['model_gb']:.2f} GB), top-{r['top_k']}; CPU, decode at 2 and 1 "
             f"threads ({r['tg']} tokens), prefill pp{r['pp']} at 2 threads (the last token's logits only, as "
             f"llama-bench); medians of {r['reps']} alternating repetitions; KL over {r['kl_tokens']} held-out "
             "tokens vs the F16 model. Command: `python bench/"
             f"{r['command']}`", "",
             f"Memory read bandwidth measured in the same run (numpy sum of 1 GiB per thread, best of 3): "
             f"{r['read_bandwidth_gbs']['2']:.1f} GB/s with 2 threads, {r['read_bandwidth_gbs']['1']:.1f} GB/s with 1. "
             "A decode step reads at least `MB read/token`; `GB/s` is that times decode tok/s (2 threads): a "
             "variant near the measured bandwidth is bandwidth-bound, one well below it compute-bound.", "",
             "| variant | files MB | MB read/token | prefill tok/s | decode tok/s (2 thr) | decode tok/s (1 thr) | "
             "GB/s (2 thr) | critical slots | KL vs F16 | top-1 same | stock frontier at this KL | speed / frontier | "
             "decode / Q4_K_M | prefill / Q4_K_M |"
             + (" speed / ik frontier | decode / ik Q4_K_M | prefill / ik Q4_K_M |" if ik else ""),
             "|" + "---|" * (17 if ik else 14)]
    for x in r["rows"]:
        crit = f"{100 * x['critical_fraction']:.0f}%" if x["critical_fraction"] is not None else "-"
        tg1 = f"{x['tg1_tps']:.2f}" if x["tg1_tps"] is not None else "-"
        mark = {"interp": "", "below": ">", "above": "<"}[x["frontier_how"]]
        q4d = f"{x['decode_vs_q4_k_m']:.2f}x" if x["decode_vs_q4_k_m"] else "-"
        q4p = f"{x['prefill_vs_q4_k_m']:.2f}x" if x["prefill_vs_q4_k_m"] else "-"
        lines.append(f"| {x['variant']} | {x['file_mb']:.0f} | {x['mb_per_token']:.1f} | {x['pp_tps']:.1f} | "
                     f"{x['tg_tps']:.2f} | {tg1} | {x['gb_per_s']:.1f} | {crit} | {x['kl_mean']:.5f} | "
                     f"{x['top1_same']:.3f} | "
                     f"{x['frontier_tps']:.2f} | {mark}{x['ratio_to_frontier']:.2f}x | {q4d} | {q4p} |"
                     + (f" {'>' if x['ik_frontier_how'] == 'below' else '<' if x['ik_frontier_how'] == 'above' else ''}"
                        f"{x['ratio_to_ik_frontier']:.2f}x | {x.get('decode_vs_ik_q4_k_m', 0):.2f}x | "
                        f"{x.get('prefill_vs_ik_q4_k_m', 0):.2f}x |" if ik else ""))
    lines += ["", "Frontier ratio marks: `>` our KL is below every stock type's, so the ratio is to stock's "
              "lowest-KL type (which is also worse in quality); `<` our KL is above every stock type's (ratio to "
              "stock's fastest type)."]
    lines += quality_per_byte(r["rows"])
    if ik:
        lines += ["", f"ik_llama.cpp at commit {r['ik_commit']}: rows `ik ...` are its llama-bench with `-rtr 1` "
                  "(run-time repacking), one repetition per alternating pass; their KL is that of the same file in the "
                  "row named by it (stock llama.cpp, or ours at r = 0 for a .wq.gguf). Ours and stock's speeds come "
                  "from a Python harness (bench_frontier.py's MEASURE), ik's from llama-bench: `stock Q4_K_M "
                  "llama-bench` is stock llama.cpp's llama-bench on the same file, so its ratio to `stock Q4_K_M` is "
                  "the harnesses' difference. The ik frontier is ik's stock types only."]
    return "\n".join(lines) + "\n"


def quality_per_byte(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: each of our points against stock's K-quant line at the same bytes read per token (the
    whole-model measure of quality: lower KL at equal bytes is better quality per byte, whatever the speed)."""
    line = [(x["mb_per_token"], x["kl_mean"]) for x in rows
            if x["kind"] == "stock" and str(x["variant"]).removeprefix("stock ") in K_QUANTS]
    ours = [x for x in rows if x["kind"] == "ours"]
    if len(line) < 2 or not ours:
        return []
    out = ["", f"Quality per byte: stock's K-quants ({', '.join(K_QUANTS)}; log KL linear in MB read per "
           "token between neighbours) at each of our points' bytes; `KL / stock` below 1 is better quality at equal "
           "bytes. Outside the K-quants' range the ratio is to the nearest end: `<` fewer bytes than the smallest "
           "(the ratio at equal bytes would be lower still), `>` more than the largest.", "",
           "| variant | MB read/token | KL vs F16 | stock K-quants' KL at these bytes | KL / stock |",
           "|---|---|---|---|---|"]
    for x in ours:
        kl, how = kl_at_bytes(line, x["mb_per_token"])
        if kl is None:
            end = min(line) if how == "below" else max(line)
            mark = "<" if how == "below" else ">"
            out.append(f"| {x['variant']} | {x['mb_per_token']:.1f} | {x['kl_mean']:.5f} | - ({mark} {end[0]:.1f} MB: "
                       f"{end[1]:.5f}) | {mark}{x['kl_mean'] / end[1]:.2f}x |")
        else:
            out.append(f"| {x['variant']} | {x['mb_per_token']:.1f} | {x['kl_mean']:.5f} | {kl:.5f} | "
                       f"{x['kl_mean'] / kl:.2f}x |")
    return out


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    stock = sorted((x for x in r["rows"] if x["kind"] == "stock" and x["variant"] != "stock F16"),
                   key=lambda x: x["kl_mean"])
    fr = r["stock_frontier"]
    ax.plot([s for _, s in fr], [k for k, _ in fr], "-", color="C1", label="stock llama.cpp frontier")
    for x in stock:
        ax.scatter(x["tg_tps"], x["kl_mean"], marker="s", color="C1")
        ax.annotate(x["variant"].removeprefix("stock "), (x["tg_tps"], x["kl_mean"]), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    ik = sorted((x for x in r["rows"] if x["kind"] == "ik"), key=lambda x: x["kl_mean"])
    if r.get("ik_frontier"):
        ax.plot([s for _, s in r["ik_frontier"]], [k for k, _ in r["ik_frontier"]], "--", color="C3",
                label="ik_llama.cpp -rtr frontier")
    for x in ik:
        ax.scatter(x["tg_tps"], x["kl_mean"], marker="^", color="C3")
        ax.annotate(x["variant"].removesuffix(" -rtr"), (x["tg_tps"], x["kl_mean"]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    presets = sorted({x["preset"] for x in r["rows"] if x["kind"] == "ours"})
    for i, p in enumerate(presets):
        ours = [x for x in r["rows"] if x["kind"] == "ours" and x["preset"] == p]
        ax.scatter([x["tg_tps"] for x in ours], [max(x["kl_mean"], 1e-6) for x in ours], marker="o",
                   color=f"C{i % 8 if i % 8 != 1 else 9}", label=f"RapidMoE preset {p}")
        for x in ours:
            lab = x["variant"].removeprefix(f"ours {p} ")
            ax.annotate(lab if len(lab) < 14 else "UMIA", (x["tg_tps"], max(x["kl_mean"], 1e-6)), fontsize=7,
                        xytext=(4, -8), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("decode tokens/s (CPU, 2 threads)")
    ax.set_ylabel("KL divergence to F16 (mean, log scale)")
    ax.set_title(f"{r['name']}: RapidMoE vs stock llama.cpp quantizations")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
