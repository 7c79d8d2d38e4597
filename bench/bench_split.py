#!/usr/bin/env python3
"""Split expert routing vs stock llama.cpp, CPU, 2 threads, all measured in one run on one model.

Variants: stock F16 (the KL reference), stock Q4_K_M, stock Q2_K, stock on the RESplit .wq.gguf alone (WQ type
only), and ours (.wq.gguf + .wr.gguf sidecar) at r = 1, 2, k/2, k. Per variant: prefill tokens/s (one batch of --pp
tokens), decode tokens/s (--tg tokens one at a time, after a short prompt), KL divergence to the F16 model on
held-out text (our own equivalent of llama-perplexity --kl-divergence: all positions of --chunks chunks of --n-ctx
tokens), wall-clock timings (median of --reps), weight bytes read per decoded token (experts from the types and the
critical-slot counters; everything else from the file), and decode tokens/s as a fraction of the roofline bandwidth /
bytes per token, with the bandwidth measured in the same run (2 threads summing 1 GiB each). Stock variants run in a
stock build of the same pin (no patches); ours in our build.

Usage: python bench/bench_split.py [--model F16.gguf | --arch qwen3moe --size bench] [--preset cpu]
Writes bench/out/split.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from rapidmoe.ggufio import GGUFFile
from rapidmoe.resplit import convert, get_preset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "bench"))
from common import ensure_synthetic, kl_stats, pyplot  # noqa: E402
from stock_llama import build_stock  # noqa: E402

OUT = ROOT / "bench" / "out"
SHARED = ROOT.parent / "shared" / "models" / "tiny-moe-a"

# Runs one variant in a fresh process (stock: llama_cpp over the stock build; ours: rapidmoe.Llama) and prints
# a JSON line: prefill and decode timings, logits for the KL chunks, and the MoE counters.
MEASURE = r"""
import json, sys, time, numpy as np
cfg = json.loads(sys.argv[1])
if cfg["ours"]:
    from rapidmoe import Llama
    kw = dict(residual_path=cfg.get("residual"), n_critical=cfg.get("r", 0)) if cfg.get("residual") else {}
else:
    from llama_cpp import Llama
    kw = {}
llm = Llama(model_path=cfg["model"], n_ctx=max(cfg["n_ctx"], cfg["pp"] + 8), n_batch=512, n_ubatch=512,
            n_threads=2, n_threads_batch=2, logits_all=True, verbose=False, **kw)
res = {"pp_tps": [], "tg_tps": []}
for rep in range(cfg["reps"]):
    llm.reset(); llm._ctx.kv_cache_clear()
    t0 = time.perf_counter()
    llm.eval(cfg["pp_tokens"])
    res["pp_tps"].append(len(cfg["pp_tokens"]) / (time.perf_counter() - t0))
    llm.reset(); llm._ctx.kv_cache_clear()
    llm.eval(cfg["pp_tokens"][:8])
    if rep == 0 and cfg["ours"] and cfg.get("residual"):
        llm.moe_counters(reset=True)
    tok = int(np.argmax(llm.scores[7]))
    t0 = time.perf_counter()
    for _ in range(cfg["tg"]):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    res["tg_tps"].append(cfg["tg"] / (time.perf_counter() - t0))
    if rep == 0 and cfg["ours"] and cfg.get("residual"):
        c = llm.moe_counters()
        res["decode_tokens"] = max(x.tokens for x in c)
        res["wq_bytes_per_token"] = sum(x.wq_bytes for x in c) / res["decode_tokens"]
        res["wr_bytes_per_token"] = sum(x.wr_bytes for x in c) / res["decode_tokens"]
        res["critical_fraction"] = sum(x.critical_slots for x in c) / sum(x.slots for x in c)
logits = []
for ch in cfg["chunks"]:
    llm.reset(); llm._ctx.kv_cache_clear()
    llm.eval(ch)
    logits.append(np.array(llm.scores[:len(ch)], dtype=np.float32))
np.save(cfg["logits_out"], np.concatenate(logits))
llm.close()
print("RESULT " + json.dumps(res))
"""


def measure_bandwidth(gib: float = 1.0, threads: int = 2, reps: int = 3) -> float:
    """Read-only bandwidth in GB/s: `threads` threads each summing their own `gib` GiB array (numpy releases
    the GIL), best of `reps`."""
    arrays = [np.ones(int(gib * (1 << 30)) // 8, dtype=np.float64) for _ in range(threads)]
    best = 0.0
    for _ in range(reps):
        ts = [threading.Thread(target=np.sum, args=(a,)) for a in arrays]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = max(best, sum(a.nbytes for a in arrays) / (time.perf_counter() - t0) / 1e9)
    del arrays
    return best


def file_bytes_per_token(path: Path) -> tuple[float, float]:
    """(non-expert bytes read per token, routed-expert bytes per token at top-k) from a GGUF's tensors."""
    f = GGUFFile(path)
    arch = f.get("general.architecture")
    k, n = int(f.get(f"{arch}.expert_used_count")), int(f.get(f"{arch}.expert_count"))
    other = experts = 0.0
    for t in f.tensors:
        if "_exps." in t.name:
            experts += t.n_bytes * k / n
        elif t.name == "token_embd.weight":
            other += t.n_bytes / int(t.shape[1])  # one row per token
        else:
            other += t.n_bytes
    return other, experts


def run_variant(cfg: dict[str, Any], stock_bin: Path | None,
                script: str = MEASURE) -> tuple[dict[str, Any], np.ndarray]:
    """Run `script` (a MEASURE program) for one variant in a fresh process: stock variants over the stock build
    with llama-cpp-python's layer from the pinned sdist, ours over our build."""
    env = dict(os.environ)
    cwd = None
    if stock_bin is not None:
        env.update(LLAMA_CPP_LIB_PATH=str(stock_bin), PYTHONPATH=str(ROOT / "vendor" / "llama_cpp_py"))
        cwd = ROOT / "vendor"
    out = subprocess.run([sys.executable, "-c", script, json.dumps(cfg)], env=env, cwd=cwd,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"measuring {cfg['model']} failed:\n{out.stderr[-3000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[7:]), np.load(cfg["logits_out"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="F16 MoE GGUF (default: a synthetic one)")
    ap.add_argument("--arch", default="qwen3moe")
    ap.add_argument("--size", default="bench")
    ap.add_argument("--n-layer", type=int, default=None, help="override the synthetic model's layer count")
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--eval", type=Path, default=None, help="held-out text for KL (default: shared eval.txt)")
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--pp", type=int, default=128)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    OUT.mkdir(parents=True, exist_ok=True)
    work = OUT / "split-work"
    work.mkdir(exist_ok=True)
    t_setup = time.perf_counter()
    if args.model is not None:
        args.model = args.model.resolve()
    if args.model is None:
        over = {"n_layer": args.n_layer} if args.n_layer else {}
        tag = f"{args.arch}-{args.size}" + (f"-L{args.n_layer}" if args.n_layer else "")
        args.model = ensure_synthetic(work / f"synthetic-{tag}.gguf", args.arch, args.size, **over)
    stock_bin = build_stock(["llama", "llama-quantize"])
    variants_files: dict[str, Path] = {}
    for ft in ("Q4_K_M", "Q2_K"):
        p = work / f"{args.model.stem}.{ft}.gguf"
        if not p.exists():
            subprocess.run([str(stock_bin / "llama-quantize"), str(args.model), str(p), ft, "2"], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        variants_files[ft] = p
    split_dir = work / f"{args.model.stem}.{args.preset}"
    wq, wr = split_dir / f"{args.model.stem}.wq.gguf", split_dir / f"{args.model.stem}.wr.gguf"
    t_conv = None
    if not (wq.exists() and wr.exists()):
        t0 = time.perf_counter()
        convert(args.model, split_dir, get_preset(args.preset), progress=True, report_experts=1)
        t_conv = time.perf_counter() - t0
    setup_s = time.perf_counter() - t_setup
    args.model = args.model.resolve()
    wq, wr = wq.resolve(), wr.resolve()

    f = GGUFFile(wq)
    arch = f.get("general.architecture")
    k = int(f.get(f"{arch}.expert_used_count"))
    from rapidmoe import Llama  # noqa: PLC0415  (compiled part, loaded on first use)

    tok = Llama(args.model, n_ctx=args.n_ctx, vocab_only=True, verbose=False)
    eval_path = args.eval or (SHARED / "eval.txt")
    text = eval_path.read_text() if eval_path.exists() else (ROOT / "README.md").read_text() * 50
    toks = tok.tokenize(text.encode(), add_bos=False, special=False)
    tok.close()
    chunks = [toks[i * args.n_ctx:(i + 1) * args.n_ctx] for i in range(args.chunks)]
    pp_tokens = toks[-args.pp:]
    base_cfg = {"n_ctx": args.n_ctx, "pp": args.pp, "tg": args.tg, "reps": args.reps, "chunks": chunks,
                "pp_tokens": pp_tokens}

    bandwidth = measure_bandwidth()
    rows = []
    ref_res, ref_logits = run_variant({**base_cfg, "ours": False, "model": str(args.model),
                                       "logits_out": str(work / "ref.npy")}, stock_bin)
    plan: list[tuple[str, Path, Path | None, int | None]] = [
        ("stock F16", args.model, None, None), ("stock Q4_K_M", variants_files["Q4_K_M"], None, None),
        ("stock Q2_K", variants_files["Q2_K"], None, None),
        (f"stock WQ alone ({get_preset(args.preset).wq})", wq, None, None)]
    plan += [(f"ours r={r}", wq, wr, r) for r in sorted({1, 2, k // 2, k}) if 0 < r <= k]
    for name, path, side, r in plan:
        if name == "stock F16":
            res, logits = ref_res, ref_logits
        else:
            cfg = {**base_cfg, "ours": side is not None, "model": str(path), "logits_out": str(work / "var.npy")}
            if side is not None:
                cfg.update(residual=str(side), r=r)
            res, logits = run_variant(cfg, None if side is not None else stock_bin)
        other, experts = file_bytes_per_token(path)
        if side is not None:
            experts = res["wq_bytes_per_token"] + res["wr_bytes_per_token"]
        bpt = other + experts
        tg = float(np.median(res["tg_tps"]))
        rows.append({"variant": name, "file_mb": path.stat().st_size / 1e6 + (side.stat().st_size / 1e6 if side else 0),
                     "pp_tps": float(np.median(res["pp_tps"])), "tg_tps": tg, "mb_per_token": bpt / 1e6,
                     "roofline_fraction": tg * bpt / (bandwidth * 1e9),
                     "critical_fraction": res.get("critical_fraction"), **kl_stats(ref_logits, logits)})
        print(json.dumps(rows[-1]), flush=True)
    result = {"model": str(args.model), "model_gb": args.model.stat().st_size / 1e9, "preset": args.preset,
              "top_k": k, "bandwidth_gbs": bandwidth, "kl_tokens": sum(len(c) for c in chunks),
              "conversion_s": t_conv, "setup_s": setup_s, "rows": rows}
    (OUT / "split.json").write_text(json.dumps(result, indent=1))
    (OUT / "split.md").write_text(to_markdown(result))
    plot(result, OUT / "split.png")
    print(to_markdown(result))
    return 0


def to_markdown(r: dict[str, Any]) -> str:
    lines = [f"Model `{Path(r['model']).name}` ({r['model_gb']:.2f} GB F16), preset `{r['preset']}`, top-{r['top_k']}; "
             f"2 threads; bandwidth measured in the same run: {r['bandwidth_gbs']:.1f} GB/s; KL over "
             f"{r['kl_tokens']} tokens vs the F16 model.", "",
             "| variant | files MB | prefill tok/s | decode tok/s | MB read/token | decode / roofline | "
             "critical slots | KL vs F16 | top-1 same |", "|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        crit = f"{100 * x['critical_fraction']:.0f}%" if x["critical_fraction"] is not None else "-"
        lines.append(f"| {x['variant']} | {x['file_mb']:.0f} | {x['pp_tps']:.1f} | {x['tg_tps']:.2f} | "
                     f"{x['mb_per_token']:.1f} | {x['roofline_fraction']:.2f} | {crit} | {x['kl_mean']:.5f} | "
                     f"{x['top1_same']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for x in r["rows"]:
        if x["variant"] == "stock F16":
            continue
        ours = x["variant"].startswith("ours")
        ax.scatter(x["tg_tps"], max(x["kl_mean"], 1e-6), marker="o" if ours else "s", color="C0" if ours else "C1")
        ax.annotate(x["variant"], (x["tg_tps"], max(x["kl_mean"], 1e-6)), fontsize=8, xytext=(4, 4),
                    textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("decode tokens/s (2 threads)")
    ax.set_ylabel("KL divergence to F16 (mean, log scale)")
    ax.set_title(f"{Path(r['model']).name}: split routing vs stock")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
