#!/usr/bin/env python3
"""RESplit presets vs stock llama-quantize Q4_K_M and Q2_K, measured in one run on one model.

Per variant: bits/weight of the routed experts, file sizes, conversion time and peak RAM (each conversion runs
in its own process), relative reconstruction error of the routed experts, and KL divergence of the WQ-only
model (the r = 0 mode) vs the F16 model on held-out text.

KL is our own equivalent of `llama-perplexity --kl-divergence`: both models run in our build over the same
chunks of eval text (n_ctx tokens each, all positions scored), KL(P_f16 || P_variant) per token, averaged;
also the share of positions where the top-1 token agrees. Stock variants are made with the stock build's
llama-quantize (same pin, no patches) and the same importance matrix.

Usage: python bench/bench_resplit.py [--model F16.gguf --eval TEXT --calib TEXT] [--presets paper,cpu,...]
Default model: the trained tiny-moe-a from shared/models when present, else a synthetic 'small' qwen3moe.
Writes bench/out/resplit.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from rapidmoe.calibration.imatrix import collect_imatrix
from rapidmoe.ggufio import GGUFFile, tensor_f32
from rapidmoe.resplit import PRESETS, write_imatrix

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "bench"))
from common import ensure_synthetic, kl_stats  # noqa: E402
from stock_llama import build_stock  # noqa: E402

OUT = ROOT / "bench" / "out"
SHARED_MODEL = ROOT.parent / "shared" / "models" / "tiny-moe-a"


def run_measured(code: str, *args: str) -> tuple[float, float]:
    wrapper = ("import resource, subprocess, sys, time\n"
               "t0 = time.perf_counter()\n"
               "subprocess.run([sys.executable, '-c', sys.argv[1], *sys.argv[2:]], check=True)\n"
               "print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    out = subprocess.run([sys.executable, "-c", wrapper, code, *args], check=True, capture_output=True, text=True)
    secs, kb = out.stdout.strip().splitlines()[-1].split()
    return float(secs), int(kb) / 1024


CONVERT = """
import sys
from rapidmoe.resplit import convert, get_preset, read_imatrix
im = read_imatrix(sys.argv[4]) if sys.argv[4] != '-' else None
convert(sys.argv[1], sys.argv[2], get_preset(sys.argv[3]), imatrix=im, force=True, progress=False, report_experts=8)
"""
QUANTIZE = """
import subprocess, sys
cmd = [sys.argv[1], '--imatrix', sys.argv[4], sys.argv[2], sys.argv[3], sys.argv[5], '2']
if sys.argv[4] == '-':
    cmd = [sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[5], '2']
subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""


def expert_error(src: Path, variant: Path) -> float:
    """sqrt(sum ||W - deq W'||^2 / sum ||W||^2) over all routed-expert tensors, dequantized by ggml."""
    a, b = GGUFFile(src), GGUFFile(variant)
    num = den = 0.0
    for t in a.tensors:
        if "_exps.weight" in t.name:
            w = tensor_f32(t).astype(np.float64)
            d = tensor_f32(b.tensor(t.name)).astype(np.float64)
            num += float(((w - d) ** 2).sum())
            den += float((w ** 2).sum())
    return float(np.sqrt(num / den))


def expert_bpw(path: Path) -> float:
    ts = [t for t in GGUFFile(path).tensors if "_exps.weight" in t.name]
    return 8 * sum(t.n_bytes for t in ts) / sum(t.n_elements for t in ts)


def logits_chunks(model: Path, chunks: list[list[int]], n_ctx: int) -> np.ndarray:
    from rapidmoe import Llama  # noqa: PLC0415  (compiled part, loaded on first use)

    llm = Llama(model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True, verbose=False, n_threads=2,
                n_threads_batch=2)
    out = []
    for c in chunks:
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval(c)
        out.append(np.array(llm.scores[: len(c)], dtype=np.float64))
    llm.close()
    return np.concatenate(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--eval", type=Path, default=None, help="held-out text for KL")
    ap.add_argument("--calib", type=Path, default=None, help="text for the importance matrix")
    ap.add_argument("--presets", default="paper,paper-residual,iq2,cpu,dense")
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=16)
    args = ap.parse_args()

    OUT.mkdir(parents=True, exist_ok=True)
    work = OUT / "resplit-work"
    work.mkdir(exist_ok=True)
    if args.model is None:
        if (SHARED_MODEL / "model-f16.gguf").exists():
            args.model = SHARED_MODEL / "model-f16.gguf"
            args.eval = args.eval or SHARED_MODEL / "eval.txt"
            args.calib = args.calib or SHARED_MODEL / "calib.txt"
        else:
            args.model = ensure_synthetic(work / "synthetic-qwen3moe-small.gguf", "qwen3moe", "small")
    text_eval = args.eval.read_text() if args.eval else (ROOT / "README.md").read_text() * 20
    text_calib = args.calib.read_text() if args.calib else text_eval[::-1]

    t0 = time.perf_counter()
    imat_path = work / "imatrix.gguf"
    write_imatrix(collect_imatrix(args.model, text_calib, n_ctx=args.n_ctx, max_chunks=32, progress=False),
                  imat_path)
    imat_secs = time.perf_counter() - t0

    from rapidmoe import Llama  # noqa: PLC0415  (compiled part, loaded on first use)

    tok = Llama(args.model, n_ctx=args.n_ctx, vocab_only=True, verbose=False)
    toks = tok.tokenize(text_eval.encode(), add_bos=False, special=False)
    chunks = [toks[i * args.n_ctx:(i + 1) * args.n_ctx] for i in range(min(args.chunks, len(toks) // args.n_ctx))]
    tok.close()
    ref = logits_chunks(args.model, chunks, args.n_ctx)

    rows = []
    quantize = build_stock(["llama-quantize"]) / "llama-quantize"
    for name, ftype in (("stock Q4_K_M", "Q4_K_M"), ("stock Q2_K", "Q2_K")):
        out = work / f"stock-{ftype}.gguf"
        secs, peak = run_measured(QUANTIZE, str(quantize), str(args.model), str(out), str(imat_path), ftype)
        rows.append({"variant": name, "bpw_experts": expert_bpw(out), "wq_mb": out.stat().st_size / 1e6, "wr_mb": 0.0,
                     "seconds": secs, "peak_mb": peak, "err_wq": expert_error(args.model, out), "err_critical": None,
                     **kl_stats(ref, logits_chunks(out, chunks, args.n_ctx))})
    for p in args.presets.split(","):
        d = work / p
        secs, peak = run_measured(CONVERT, str(args.model), str(d), p, str(imat_path))
        rep = json.loads(next(d.glob("*.resplit.json")).read_text())
        wq = next(d.glob("*.wq.gguf"))
        rows.append({"variant": f"resplit {p}", "preset": PRESETS[p].description, "bits": rep["bits"],
                     "wq_mb": rep["files"]["wq_bytes"] / 1e6, "wr_mb": rep["files"]["wr_bytes"] / 1e6,
                     "seconds": secs, "peak_mb": peak, "err_wq": rep["total"]["wq_only"],
                     "err_critical": rep["total"]["critical"], "err_q4k_same": rep["total"].get("Q4_K"),
                     **kl_stats(ref, logits_chunks(wq, chunks, args.n_ctx))})
    result = {"model": str(args.model), "model_mb": args.model.stat().st_size / 1e6, "n_ctx": args.n_ctx,
              "kl_tokens": sum(len(c) for c in chunks), "imatrix_seconds": imat_secs, "rows": rows}
    (OUT / "resplit.json").write_text(json.dumps(result, indent=1))
    (OUT / "resplit.md").write_text(to_markdown(result))
    print(to_markdown(result))
    return 0


def to_markdown(r: dict[str, Any]) -> str:
    lines = [f"Model: `{Path(r['model']).name}` ({r['model_mb']:.1f} MB F16); KL over {r['kl_tokens']} tokens "
             f"(n_ctx {r['n_ctx']}), own implementation (see bench_resplit.py); imatrix from calibration text in "
             f"{r['imatrix_seconds']:.1f} s.", "",
             "| variant | expert bpw: WQ / sidecar / critical / stored | WQ file MB | WR file MB | convert s | "
             "peak RAM MB | expert rel. err WQ | expert rel. err critical | KL WQ-only vs F16 | top-1 same |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        b = x.get("bits")
        bits = (f"{b['wq']:.2f} / {b['sidecar']:.2f} / {b['critical']:.2f} / {b['total_stored']:.2f}" if b
                else f"{x['bpw_experts']:.2f} (all experts)")
        crit = f"{x['err_critical']:.4f}" if x["err_critical"] is not None else "-"
        lines.append(f"| {x['variant']} | {bits} | {x['wq_mb']:.1f} | {x['wr_mb']:.1f} | {x['seconds']:.1f} | "
                     f"{x['peak_mb']:.0f} | {x['err_wq']:.4f} | {crit} | {x['kl_mean']:.5f} | {x['top1_same']:.3f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
