#!/usr/bin/env python3
"""ik_llama.cpp's own CPU types on a trained model: KL of IQ4_KS / IQ3_KS, experts only and whole model, against
stock K-quants made and measured the same way, all by ik's own tools (llama-quantize, llama-perplexity).

Users who run ik_llama.cpp pick its non-linear types (IQ4_KS 4.25 bpw, IQ3_KS 3.19 bpw), not its K-quants. Our
presets' KL comes from our harness (bench_experts.py, bench_frontier.py), which cannot load ik's types; ik's build
cannot load our pairs. So each harness measures the stock K-quants too, and a point is compared with the stock line
of its own harness at the same bits: `KL / stock at these bits` (log KL linear in bits between neighbouring stock
types, as bench_experts.py's table does). Ours and ik's are then compared by that ratio.

Per variant (each file made by ik's llama-quantize from the F16 model):
- experts only: `--custom-q ffn_gate_exps=T,ffn_up_exps=T,ffn_down_exps=T` over base type Q8_0 (every other
  matrix Q8_0, norms and router F32, as bench_experts.py's files);
- whole model: ik's own mix for the type (`llama-quantize F16 OUT T`), K-quants as their _M mixes;
each with and without an importance matrix (--imatrix: collected with our build on calib.txt, llama-imatrix's
statistics, written in the legacy .dat layout ik reads). KL: `llama-perplexity --kl-divergence` against the F16
model's logits (`--kl-divergence-base`), --chunks chunks of --n-ctx tokens of eval.txt (llama-perplexity scores the
second half of each chunk). Bits: the routed-expert tensors' bytes x 8 / weights (read with ik's gguf-py, which knows
its types; a tensor's bytes up to the next tensor's data, row scales included).

  python bench/bench_ik_types.py --ik build/ik-src [--model ../shared/models/tiny-moe-a/model-f16.gguf]
      [--types IQ4_KS,IQ3_KS] [--stock Q2_K,Q3_K,Q4_K,Q5_K,Q6_K] [--chunks 48 --n-ctx 256] [--imatrix]
Writes --out (JSON) and its .md table.
"""
from __future__ import annotations

import argparse
import json
import re
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import cpu_name, kl_at_bytes
from ik_peer import locate_or_build, tool

ROOT = Path(__file__).resolve().parent.parent
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
MIX = {"Q2_K": "Q2_K", "Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "Q6_K": "Q6_K"}  # whole-model ftypes

# Bits per routed-expert weight of a GGUF, read by ik's gguf-py (run in a child: its `gguf` is not ours). A tensor's
# bytes are the distance to the next tensor's data: ik's row-scaled types (IQ4_KS, IQ3_KS) carry a few bytes per row
# beyond their blocks, which gguf-py's block sizes leave out.
BITS = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
from gguf import GGUFReader
r = GGUFReader(sys.argv[2])
ts = sorted(r.tensors, key=lambda t: t.data_offset)
ends = [t.data_offset for t in ts[1:]] + [os.path.getsize(sys.argv[2])]
nb = nw = 0
for t, end in zip(ts, ends):
    if any(k in t.name for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
        nb += end - t.data_offset
        nw += int(t.n_elements)
print(8 * nb / nw)
"""


def _run(cmd: list[str], what: str) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(cmd)}):\n{(out.stdout + out.stderr)[-3000:]}")
    return out.stdout + out.stderr


def write_legacy_imatrix(model: Path, calib: Path, out: Path, chunks: int, n_ctx: int) -> None:
    """Our collector's statistics in llama-imatrix's legacy .dat layout (ik_llama.cpp reads that one): per entry
    the name, ncall = 1 and the mean squared input per column (per expert, experts concatenated)."""
    from rapidmoe.calibration.imatrix import collect_imatrix  # noqa: PLC0415  (only with --imatrix)

    im = collect_imatrix(model, calib.read_text(), n_ctx=n_ctx, max_chunks=chunks, n_threads=2)
    buf = bytearray(struct.pack("<i", len(im.in_sum2)))
    for name, s in sorted(im.in_sum2.items()):
        counts = im.counts[name].reshape(-1, 1).astype("float64")
        mean = (s.reshape(counts.shape[0], -1) / counts.clip(min=1)).astype("<f4").reshape(-1)
        enc = name.encode()
        buf += struct.pack("<i", len(enc)) + enc + struct.pack("<ii", 1, mean.size) + mean.tobytes()
    dataset = calib.name.encode()
    buf += struct.pack("<ii", chunks, len(dataset)) + dataset
    tmp = out.with_name(out.name + ".partial")  # a stopped run leaves no file that the next would take as done
    tmp.write_bytes(bytes(buf))
    tmp.rename(out)


def quantize(quant: Path, src: Path, out: Path, qtype: str, experts_only: bool, imatrix: Path | None) -> None:
    if out.exists():
        return
    cmd = [str(quant)]
    if imatrix is not None:
        cmd += ["--imatrix", str(imatrix)]
    if experts_only:
        name = re.sub(r"_k$", "_K", qtype.lower())  # ggml_type_name's spelling: q4_K, iq4_ks
        cmd += ["--custom-q", ",".join(f"{k}={name}" for k in EXPERTS)]
    tmp = out.with_name(out.name + ".partial")
    cmd += [str(src), str(tmp), "Q8_0" if experts_only else MIX.get(qtype, qtype), "2"]
    _run(cmd, "llama-quantize")
    tmp.rename(out)


def kl(perplexity: Path, model: Path, base: Path, text: Path, chunks: int, n_ctx: int) -> dict[str, float]:
    """ik's llama-perplexity --kl-divergence of `model` against the base logits: mean (± its SE), 99th pct, top-1."""
    log = _run([str(perplexity), "-m", str(model), "-f", str(text), "-c", str(n_ctx), "-b", str(n_ctx),
                "--chunks", str(chunks), "-t", "2", "--kl-divergence-base", str(base), "--kl-divergence"],
               "llama-perplexity --kl-divergence")
    m = re.search(r"Mean\s+KLD:\s+([-\d.e]+)\s+±\s+([-\d.e]+)", log)
    p99 = re.search(r"99\.0%\s+KLD:\s+([-\d.e]+)", log)
    top = re.search(r"Same top p:\s+([-\d.e]+)", log)
    if m is None or p99 is None or top is None:
        raise RuntimeError(f"no KL in llama-perplexity's output:\n{log[-2000:]}")
    return {"kl": float(m.group(1)), "kl_se": float(m.group(2)), "kl_p99": float(p99.group(1)),
            "top1": float(top.group(1)) / 100}


def to_markdown(res: dict[str, Any]) -> str:
    lines = [f"`{res['command']}`", "",
             f"Model `{res['model']}`; KL(F16 || variant) by ik_llama.cpp {res['ik_commit']}'s llama-perplexity over "
             f"{res['chunks']} chunks of {res['n_ctx']} tokens of `{res['text']}` (the second half of each chunk "
             f"scored); files by its llama-quantize; {res['cpu']}.", ""]
    for scope in dict.fromkeys(r["scope"] for r in res["rows"]):  # the scopes the run measured
        lines += [f"### {'routed experts only (all else Q8_0)' if scope == 'experts' else 'whole model (ik mixes)'}",
                  "", "| variant | file MB | bits / expert weight | KL (± SE) | KL p99 | top-1 same | "
                  "stock KL at these bits | KL / stock |", "|---|---|---|---|---|---|---|---|"]
        for r in (r for r in res["rows"] if r["scope"] == scope):
            ref = r.get("stock_at")
            at, ratio = ("-", "-") if ref is None else (f"{ref:.5f}", f"{r['kl'] / ref:.2f}")
            lines.append(f"| {r['variant']} | {r['file_mb']:.2f} | {r['bits']:.3f} | {r['kl']:.5f} ± "
                         f"{r['kl_se']:.5f} | {r['kl_p99']:.4f} | {r['top1']:.3f} | {at} | {ratio} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ik", type=Path, required=True, help="ik_llama.cpp build folder or source (bench/ik_peer.py)")
    ap.add_argument("--model", type=Path, default=ROOT.parent / "shared" / "models" / "tiny-moe-a" / "model-f16.gguf")
    ap.add_argument("--text", type=Path, default=None, help="evaluation text (default: eval.txt beside the model)")
    ap.add_argument("--calib", type=Path, default=None, help="imatrix text (default: calib.txt beside the model)")
    ap.add_argument("--types", default="IQ4_KS,IQ3_KS", help="ik's own types")
    ap.add_argument("--stock", default="Q2_K,Q3_K,Q4_K,Q5_K,Q6_K", help="the stock K-quants of the reference line")
    ap.add_argument("--scopes", default="experts,whole")
    ap.add_argument("--chunks", type=int, default=48)
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--imatrix", action="store_true", help="also every variant with an importance matrix")
    ap.add_argument("--imatrix-chunks", type=int, default=32)
    ap.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "ik-types-work")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "ik-types.json")
    args = ap.parse_args()
    text = args.text or args.model.parent / "eval.txt"
    calib = args.calib or args.model.parent / "calib.txt"
    for p in (args.model, text) + ((calib,) if args.imatrix else ()):
        if not p.is_file():
            ap.error(f"{p}: no such file")
    ik = locate_or_build(args.ik)
    quant, ppl = tool(ik, "llama-quantize"), tool(ik, "llama-perplexity")
    gguf_py = ik.bench.parent.parent.parent / "gguf-py"
    if not (gguf_py / "gguf").is_dir():
        ap.error(f"{gguf_py}: ik's gguf-py not found (--ik must be its source folder or a build inside it)")
    work = args.work / args.model.stem
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    base = work / "base.kld"
    if not base.exists():
        tmp = base.with_name(base.name + ".partial")
        _run([str(ppl), "-m", str(args.model), "-f", str(text), "-c", str(args.n_ctx), "-b", str(args.n_ctx),
              "--chunks", str(args.chunks), "-t", "2", "--kl-divergence-base", str(tmp)], "F16 base logits")
        tmp.rename(base)
    imats: dict[str, Path | None] = {"": None}
    if args.imatrix:
        dat = work / "imatrix.dat"
        if not dat.exists():
            write_legacy_imatrix(args.model, calib, dat, args.imatrix_chunks, args.n_ctx)
        imats["+imatrix"] = dat
    stock = [t for t in args.stock.split(",") if t]
    rows: list[dict[str, Any]] = []
    for scope in (s for s in args.scopes.split(",") if s):
        for tag, imat in imats.items():
            for qtype in stock + [t for t in args.types.split(",") if t]:
                name = qtype if scope == "experts" else MIX.get(qtype, qtype)
                out = work / f"{scope}-{name}{tag}.gguf"
                quantize(quant, args.model, out, qtype, scope == "experts", imat)
                bits = float(_run([sys.executable, "-c", BITS, str(gguf_py), str(out)], "bits").split()[-1])
                row = {"scope": scope, "variant": ("stock " if qtype in stock else "ik ") + name + tag,
                       "type": qtype, "imatrix": imat is not None, "bits": bits, "file_mb": out.stat().st_size / 1e6,
                       **kl(ppl, out, base, text, args.chunks, args.n_ctx)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    for r in rows:  # the stock line of the same scope and imatrix choice
        line = [(x["bits"], x["kl"]) for x in rows if x["scope"] == r["scope"] and x["imatrix"] == r["imatrix"]
                and x["type"] in stock]
        r["stock_at"] = kl_at_bytes(line, r["bits"])[0]  # bits for bytes: log KL linear between neighbours
    res = {"command": " ".join(["python", "bench/bench_ik_types.py", *sys.argv[1:]]), "model": str(args.model),
           "text": str(text), "chunks": args.chunks, "n_ctx": args.n_ctx, "ik_commit": ik.commit, "cpu": cpu_name(),
           "seconds": time.perf_counter() - t0, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    md = to_markdown(res)
    args.out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
