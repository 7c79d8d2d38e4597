#!/usr/bin/env python3
"""The experts-only quality frontier: stock ggml types on the routed experts against our presets x r, all else fixed.

Every variant differs from the others only in its routed-expert tensors (`ffn_{gate,up,down}_exps`):
every other 2-D matrix is Q8_0, norms, router and biases F32, byte for byte the same in every file (checked).

- Stock: the routed experts in one stock type (Q2_K ... Q6_K) each, made with ggml's own quantization through
  rapidmoe._core (`ggml_quantize_chunk`, what llama-quantize calls, expert by expert, with llama-quantize's row-size
  fallback), no importance matrix unless --imatrix-variants (then one computed from the calibration text with our
  build, llama-imatrix's statistics, each expert quantized with its own slice as llama-quantize does).
- Ours: `rapidmoe.resplit.convert` with each preset, its other tensors forced to Q8_0 (no per-tensor overrides),
  evaluated at each fixed r (rapidmoe.Llama with residual_path and n_critical=r).

Per variant, in a fresh process of our build: logits at all positions of --chunks chunks of --n-ctx held-out
tokens, KL(F16 || variant) per position (mean, 99th percentile), top-1 agreement. The x axis is the bits per
routed-expert weight read per token: for stock the type's bits per weight (from the file's tensor sizes); for ours
the engine's own counters over the KL evaluation (llm.moe_counters: WQ and sidecar bytes read, per slot, over the
weights of one expert), with the preset's accounting (Preset.bits(): WQ + critical fraction x (critical - WQ))
next to it as a cross-check.

The noise: each KL carries its standard error over chunks; the ratio to stock at the same bits a 90% interval from
resampling the chunks (every variant resampled together: the comparison is paired); and the numerical floor is
the KL of an F32 copy of the F16 model (no weight changes: only the computation's rounding).

Usage:
  python bench/bench_experts.py --name tiny-moe-a --r 0,1,2,3,4
  python bench/bench_experts.py --name tiny-moe-a-mix --presets cpu-q8 --mix-bits 2.9,3.2   # + measured mixes
Writes <out-dir>/experts-<name>.{json,md,png} (default bench/out/experts; copy to bench/results/ to publish); the
files it makes on the way are kept in <out-dir>/work/<model folder>-<file stem>-<digest of the path, size and time>/.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from rapidmoe.calibration.imatrix import collect_imatrix
from rapidmoe.calibration.mix import Sensitivity, allocate, measure_sensitivity, mix_preset
from rapidmoe.ggml_types import fit_type, ggml_type
from rapidmoe.ggufio import GGUFFile, Tensor, copy_metadata, n_rows, tensor_rows
from rapidmoe.moe_tensors import is_expert, parse_expert
from rapidmoe.resplit import Preset, convert, get_preset
from rapidmoe.resplit.codecs import codec_of
from rapidmoe.resplit.convert import _add_quant_info, _byte_shape, _target_type
from rapidmoe.resplit.imatrix import Imatrix, write_imatrix

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "bench"))
from bench_frontier import SHARED  # noqa: E402
from bench_split import run_variant  # noqa: E402
from common import log_softmax, pyplot, source_key  # noqa: E402

STOCK_TYPES = "Q2_K,Q3_K,Q4_K,Q5_K,Q6_K"
# the stock build's llama-quantize (tools/stock_llama.py), used only when already built: then every stock file is
# compared byte for byte with llama-quantize's own output for the same tensor types (this script builds nothing)
STOCK_QUANTIZE = ROOT / "build" / "stock" / "build" / "bin" / "llama-quantize"
# the non-expert rule of every file here: 2-D matrices Q8_0 (F16 where rows do not fit), norms/router/biases F32
# (typechoice.tensor_type); the WQ/WR types of this preset are never used
Q8_OTHER = Preset("experts-only", "Q2_K", "Q2_K", other="Q8_0")

# One variant in a fresh process of our build; saves the logits of every chunk (all positions) and prints one JSON
# line with the MoE counters over the evaluation (ours) and the seconds it took.
MEASURE = r"""
import json, sys, time, numpy as np
from rapidmoe import Llama
cfg = json.loads(sys.argv[1])
kw = dict(residual_path=cfg["residual"], n_critical=cfg["r"]) if cfg.get("residual") else {}
llm = Llama(model_path=cfg["model"], n_ctx=cfg["n_ctx"], n_batch=cfg["n_ctx"], n_ubatch=cfg["n_ctx"],
            n_threads=cfg["threads"], n_threads_batch=cfg["threads"], logits_all=True, verbose=False, **kw)
if kw:
    llm.moe_counters(reset=True)
t0 = time.perf_counter()
logits = []
for ch in cfg["chunks"]:
    llm.reset(); llm._ctx.kv_cache_clear()
    llm.eval(ch)
    logits.append(np.array(llm.scores[:len(ch)], dtype=np.float32))
res = {"eval_s": time.perf_counter() - t0}
if kw:
    res["counters"] = [dict(layer=c.layer, tokens=c.tokens, slots=c.slots, critical_slots=c.critical_slots,
                            wq_bytes=c.wq_bytes, wr_bytes=c.wr_bytes) for c in llm.moe_counters()]
np.save(cfg["logits_out"], np.concatenate(logits))
llm.close()
print("RESULT " + json.dumps(res))
"""


# -- the files -------------------------------------------------------------------------------------------------

def expert_elements(path: Path) -> dict[int, int]:
    """Per MoE layer: the weights of one routed expert (gate + up + down)."""
    out: dict[int, int] = {}
    for t in GGUFFile(path).tensors:
        e = parse_expert(t.name)
        if e is not None:
            out[e.layer] = out.get(e.layer, 0) + t.n_elements // int(t.shape[2])
    return out


def expert_bits(path: Path) -> float:
    """Bits per routed-expert weight stored in a GGUF (= read per token: every expert is read whole)."""
    ts = [t for t in GGUFFile(path).tensors if is_expert(t.name)]
    return 8 * sum(t.n_bytes for t in ts) / sum(t.n_elements for t in ts)


def tensor_types(path: Path, experts: bool) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in GGUFFile(path).tensors if is_expert(t.name) == experts}


def _write_other(w: GGUFWriter, t: Tensor, qt: GGMLQuantizationType) -> None:
    """One non-expert tensor's data in type qt, exactly as rapidmoe.resplit.convert writes it."""
    from rapidmoe._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use)

    if qt == t.tensor_type:
        w.write_tensor_data(np.asarray(t.data).reshape(-1).view(np.uint8))
        return
    rows = tensor_rows(t, 0, n_rows(t))
    shape = tuple(int(x) for x in reversed(t.shape))
    if qt == GGMLQuantizationType.F32:
        w.write_tensor_data(rows.reshape(shape))
    elif qt == GGMLQuantizationType.F16:
        w.write_tensor_data(rows.astype(np.float16).reshape(shape))
    else:
        w.write_tensor_data(_core.quantize(rows, int(qt)).reshape(_byte_shape(t, qt)))


def stock_experts_file(src: Path, ty: str, out: Path, imatrix: Imatrix | None) -> Path:
    """`src` with every routed-expert tensor in stock type `ty` (llama-quantize's fallback where rows do not fit)
    and every other tensor by Q8_OTHER: what `llama-quantize --tensor-type ffn_.*_exps=<ty> src out Q8_0` writes
    (ggml_quantize_chunk row by row, each expert with its own importance-matrix slice)."""
    from rapidmoe._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use)

    if out.exists():
        return out
    reader = GGUFFile(src)
    tmp = out.with_name(out.name + ".tmp")
    w = GGUFWriter(tmp, arch=str(reader.get("general.architecture")))
    copy_metadata(reader, w)
    plan: list[tuple[Tensor, GGMLQuantizationType]] = []
    for t in reader.tensors:
        if is_expert(t.name):
            qt = ggml_type(fit_type(ty, int(t.shape[0])))
        else:
            qt = _target_type(t, Q8_OTHER)
        if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            dt = np.dtype(np.float32 if qt == GGMLQuantizationType.F32 else np.float16)
            shape = tuple(int(x) for x in reversed(t.shape))
            w.add_tensor_info(t.name, shape, dt, int(np.prod(shape)) * dt.itemsize, qt)
        else:
            _add_quant_info(w, t.name, _byte_shape(t, qt), qt)
        plan.append((t, qt))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t, qt in plan:
        if not is_expert(t.name):
            _write_other(w, t, qt)
            continue
        n_in, n_out, n_expert = (int(x) for x in t.shape)
        imat = imatrix.weights_for(t.name, n_expert, n_in) if imatrix is not None else None
        data = np.empty((n_expert, n_out, _core.row_size(int(qt), n_in)), dtype=np.uint8)
        for e in range(n_expert):
            data[e] = _core.quantize(tensor_rows(t, e * n_out, n_out), int(qt), imat[e] if imat is not None else None)
        w.write_tensor_data(data)
    w.close()
    tmp.replace(out)
    return out


def llama_quantize_check(src: Path, ty: str, ours: Path, imatrix: Path | None, work: Path) -> bool | None:
    """Whether `ours` holds the same tensor types and bytes as the stock llama-quantize's
    `--tensor-type ffn_{gate,up,down}_exps=<ty> src out Q8_0` (with `--imatrix`); None without the stock build."""
    if not STOCK_QUANTIZE.exists():
        return None
    out = work / f"{ours.stem}.llama-quantize.gguf"
    cmd = [str(STOCK_QUANTIZE), *(["--imatrix", str(imatrix)] if imatrix is not None else []),
           *(x for role in ("gate", "up", "down") for x in ("--tensor-type", f"ffn_{role}_exps={ty.lower()}")),
           str(src), str(out), "Q8_0", "2"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return same_bytes(out, ours, experts=True) and same_bytes(out, ours, experts=False)
    finally:
        out.unlink(missing_ok=True)


def f32_copy(src: Path, out: Path) -> Path:
    """`src` with every F16/BF16 tensor widened to F32 (the same weights): its KL to `src` is the numerical floor."""
    if out.exists():
        return out
    reader = GGUFFile(src)
    tmp = out.with_name(out.name + ".tmp")
    w = GGUFWriter(tmp, arch=str(reader.get("general.architecture")))
    copy_metadata(reader, w)
    for t in reader.tensors:
        if t.tensor_type not in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.F32):
            raise ValueError(f"{src}: tensor {t.name} is {t.tensor_type.name}; the F32 copy needs a float model")
        shape = tuple(int(x) for x in reversed(t.shape))
        w.add_tensor_info(t.name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4, GGMLQuantizationType.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in reader.tensors:
        _write_other(w, t, GGMLQuantizationType.F32)
    w.close()
    tmp.replace(out)
    return out


PRESET_FIELDS = ("wq", "wr", "down_mode", "down_type")


def preset_spec(spec: str) -> Preset:
    """A preset by name, or NAME:field=TYPE[:field=TYPE...] with some of its expert types replaced; a replaced one is
    named after the whole spec (its pair's folder and its rows in the table)."""
    name, *pairs = spec.split(":")
    overrides: dict[str, str] = {}
    for pair in pairs:
        field, eq, value = pair.partition("=")
        if not eq or field not in PRESET_FIELDS or not value:
            raise SystemExit(f"--presets {spec!r}: {pair!r} is not field=TYPE with field one of "
                             f"{', '.join(PRESET_FIELDS)}")
        overrides[field] = value
    try:
        preset = get_preset(name, **overrides)
    except ValueError as e:
        raise SystemExit(f"--presets {spec!r}: {e}") from None
    return dataclasses.replace(preset, name=spec.replace(":", "+")) if overrides else preset


def q8_other(preset: Preset) -> Preset:
    """The preset with every non-expert tensor forced to Q8_0 (no mixture, no per-tensor overrides): only the
    routed experts differ from the stock files. Any preset by name, whatever its expert fields."""
    forced = dataclasses.replace(preset, other="Q8_0", token_embd=None, output=None)
    return preset if forced == preset else dataclasses.replace(forced, name=f"{preset.name}+other-q8")


def our_pair(src: Path, preset: Preset, work: Path, imatrix: Imatrix | None = None) -> tuple[Path, Path, bool]:
    """(.wq.gguf, .wr.gguf, converted now) of `src` with `preset` (and the importance matrix, if given), reused when
    the cached pair was made with the same preset definition (an imatrix pair is remade with every new imatrix)."""
    d = work / f"{src.stem}.{preset.name}{'.imat' if imatrix is not None else ''}"
    wq, wr, rep = d / f"{src.stem}.wq.gguf", d / f"{src.stem}.wr.gguf", d / f"{src.stem}.resplit.json"
    if imatrix is None and wq.exists() and wr.exists() and rep.exists() and \
            json.loads(rep.read_text()).get("preset") == json.loads(json.dumps(preset.record())):
        return wq, wr, False
    convert(src, d, preset, imatrix=imatrix, progress=False, report_experts=1, force=True)
    return wq, wr, True


def with_mixes(src: Path, presets: list[Preset], args: argparse.Namespace,
               work: Path) -> tuple[list[Preset], dict[str, Any]]:
    """The presets plus each residual one with a mix per --mix-bits budget; the sensitivities (measured once on the
    calibration text, cached in the work folder per types, chunks and context) and how long they took."""
    calib = args.calib or src.parent / "calib.txt"
    types = [t.upper() for t in args.mix_types.split(",") if t]
    text_key = hashlib.sha256(calib.read_bytes()).hexdigest()[:10]  # another calibration text: measured again
    cache = work / f"{src.stem}.mix-{'-'.join(types)}-c{args.mix_chunks}x{args.n_ctx}-{text_key}.json"
    t0 = time.perf_counter()
    if cache.exists():
        sens = [Sensitivity(**x) for x in json.loads(cache.read_text())["sensitivity"]]
        seconds = json.loads(cache.read_text())["seconds"]
    else:
        sens = measure_sensitivity(src, calib.read_text(), types, n_ctx=args.n_ctx, chunks=args.mix_chunks,
                                   threads=args.threads, progress=False)
        seconds = time.perf_counter() - t0
        cache.write_text(json.dumps({"seconds": seconds, "sensitivity": [dataclasses.asdict(x) for x in sens]}))
    out = list(presets)
    for b in (float(x) for x in args.mix_bits.split(",") if x):
        for p in presets:
            if codec_of(p).no_mix is None:
                out.append(dataclasses.replace(mix_preset(p, allocate(sens, b)), name=f"{p.name}+mix{b:g}"))
    return out, {"calib": str(calib), "types": types, "chunks": args.mix_chunks, "seconds": seconds,
                 "sensitivity": [dataclasses.asdict(x) for x in sens]}


def same_bytes(a: Path, b: Path, experts: bool) -> bool:
    """Whether two GGUFs hold byte-identical data in all their routed-expert (or all their other) tensors."""
    fa, fb = GGUFFile(a), GGUFFile(b)
    ta = {t.name: t for t in fa.tensors if is_expert(t.name) == experts}
    tb = {t.name: t for t in fb.tensors if is_expert(t.name) == experts}
    if ta.keys() != tb.keys():
        return False
    ma, mb = fa.memmap(), fb.memmap()
    return all(x.tensor_type == tb[n].tensor_type and x.n_bytes == tb[n].n_bytes and np.array_equal(
        ma[x.data_offset:x.data_offset + x.n_bytes], mb[tb[n].data_offset:tb[n].data_offset + tb[n].n_bytes])
        for n, x in ta.items())


# -- the statistics ----------------------------------------------------------------------------------------------

def interp_log(points: list[tuple[float, float]], x: float) -> float | None:
    """y at x on the curve through (x, y) points, log(y) linear in x between neighbours; None outside their range."""
    pts = sorted(points)
    if not pts or x < pts[0][0] - 1e-9 or x > pts[-1][0] + 1e-9:
        return None
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 - 1e-9 <= x <= x1 + 1e-9:
            w = 0.0 if x1 == x0 else min(1.0, max(0.0, (x - x0) / (x1 - x0)))
            return math.exp((1 - w) * math.log(max(y0, 1e-12)) + w * math.log(max(y1, 1e-12)))
    return pts[0][1]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown"


# -- the run -----------------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=SHARED / "model-f16.gguf", help="F16/BF16/F32 MoE GGUF")
    ap.add_argument("--name", default=None, help="name in the output files (default: the model folder's name)")
    ap.add_argument("--eval", type=Path, default=None, help="held-out text for KL (default: the model dir's eval.txt)")
    ap.add_argument("--calib", type=Path, default=None,
                    help="text for --imatrix-variants (default: the model dir's calib.txt)")
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=12, help="chunks of --n-ctx eval tokens (all positions scored)")
    ap.add_argument("--stock", default=STOCK_TYPES, help="stock ggml types for the routed experts, comma-separated")
    ap.add_argument("--presets", default="cpu-q8",
                    help="our presets, comma-separated: any name rapidmoe.resplit knows, with type overrides as "
                         "NAME:field=TYPE[:field=TYPE] (fields wq, wr, down_mode, down_type; e.g. "
                         "cpu-q8:wr=Q4_K:down_type=Q8_0, a near-lossless critical path over a Q2_K base)")
    ap.add_argument("--r", default=None, help="fixed r values, comma-separated (default: 0..top-k)")
    ap.add_argument("--imatrix-variants", action="store_true",
                    help="also every stock type with an importance matrix computed from --calib")
    ap.add_argument("--imatrix-presets", action="store_true",
                    help="with --imatrix-variants: also our presets converted with that importance matrix")
    ap.add_argument("--imatrix-chunks", type=int, default=32, help="calibration chunks of --n-ctx for the imatrix")
    ap.add_argument("--mix-bits", default="",
                    help="also each residual preset with per-layer/per-role WQ types chosen on the calibration text "
                         "(rapidmoe.calibration.mix) at these mean WQ bits, comma-separated")
    ap.add_argument("--mix-types", default="Q2_K,Q3_K,Q4_K", help="the WQ types a mix chooses among")
    ap.add_argument("--mix-chunks", type=int, default=8, help="calibration chunks of --n-ctx the mix measures on")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--boot", type=int, default=2000, help="chunk resamples for the ratio's interval")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "out" / "experts")
    args = ap.parse_args()

    t_start = time.perf_counter()
    src = args.model.resolve()
    name = args.name or src.parent.name
    presets = [q8_other(preset_spec(p)) for p in args.presets.split(",") if p]  # unknown names fail here, early
    stock_types = [s.upper() for s in args.stock.split(",") if s]
    if not stock_types:
        raise SystemExit("--stock: name at least one stock type (the curve every preset is compared with)")
    for s in stock_types:
        ggml_type(s)
    eval_path = args.eval or src.parent / "eval.txt"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    work = args.out_dir / "work" / source_key(src)
    work.mkdir(parents=True, exist_ok=True)

    f = GGUFFile(src)
    arch = f.get("general.architecture")
    k = int(f.get(f"{arch}.expert_used_count"))
    rs = list(range(k + 1)) if args.r is None else [int(r) for r in args.r.split(",") if r != ""]
    bad = [r for r in rs if not 0 <= r <= k]
    if bad:
        raise SystemExit(f"--r {bad}: r must be in 0..{k} (top-k of {src.name})")

    # files
    t0 = time.perf_counter()
    imatrix = None
    imatrix_path = work / f"{src.stem}.imatrix.gguf"
    imatrix_s = 0.0
    if args.imatrix_variants:
        calib = args.calib or src.parent / "calib.txt"
        imatrix = collect_imatrix(src, calib.read_text(), n_ctx=args.n_ctx, max_chunks=args.imatrix_chunks,
                                  n_threads=args.threads, progress=False)
        imatrix_s = time.perf_counter() - t0
        write_imatrix(imatrix, imatrix_path)  # for llama-quantize's cross-check
        for old in work.glob(f"{src.stem}.experts-*.imat.gguf"):  # made with an earlier imatrix
            old.unlink()
    variants: list[dict[str, Any]] = [
        {"variant": "F16 (reference)", "kind": "ref", "model": src, "bits": 16.0},
        {"variant": "F32 copy (numerical floor)", "kind": "floor", "bits": 32.0,
         "model": f32_copy(src, work / f"{src.stem}.F32.gguf")}]
    stock_sets = [("stock", None)] + ([("stock+imatrix", imatrix)] if imatrix is not None else [])
    for kind, im in stock_sets:
        for ty in stock_types:
            tag = "imat" if im is not None else "plain"
            path = stock_experts_file(src, ty, work / f"{src.stem}.experts-{ty}.{tag}.gguf", im)
            variants.append({"variant": f"{kind} {ty}", "kind": kind, "type": ty, "model": path,
                             "bits": expert_bits(path)})
    mix_info = None
    if args.mix_bits:
        presets, mix_info = with_mixes(src, presets, args, work)
    pairs = {p.name: our_pair(src, p, work) for p in presets}
    for p in presets:
        wq, wr, _ = pairs[p.name]
        variants += [{"variant": f"ours {p.name} r={r}", "kind": "ours", "preset": p.name, "r": r, "model": wq,
                      "residual": wr} for r in rs]
    if args.imatrix_presets and imatrix is not None:  # the same presets converted with the importance matrix
        for p in presets:
            wq, wr, _ = our_pair(src, p, work, imatrix)
            variants += [{"variant": f"ours+imatrix {p.name} r={r}", "kind": "ours", "preset": p.name, "r": r,
                          "model": wq, "residual": wr} for r in rs]
    files_s = time.perf_counter() - t0

    # the fixed part really is fixed: every file's non-expert tensors hold the same bytes as the first stock file's
    checks: dict[str, Any] = {}
    first = next(v for v in variants if v["kind"] == "stock")
    checks["non_expert_identical"] = {v["variant"]: same_bytes(first["model"], v["model"], experts=False)
                                      for v in variants if v["kind"] in ("stock", "stock+imatrix", "ours")}
    checks["non_expert_types"] = sorted(set(tensor_types(first["model"], experts=False).values()))
    checks["identical_to_stock_llama_quantize"] = {
        v["variant"]: llama_quantize_check(src, v["type"], v["model"],
                                           imatrix_path if v["kind"] == "stock+imatrix" else None, work)
        for v in variants if v["kind"] in ("stock", "stock+imatrix")}
    for p in presets:  # a preset's WQ alone (r = 0) vs the stock file of the same type: the same expert bytes?
        # (not for a mix: its WQ holds several types, each tensor's quantized by ggml as the others)
        st = next((v for v in variants if v["kind"] == "stock" and v["type"] == p.wq.upper()), None) \
            if not p.mix else None
        if st is not None:
            # True for the residual presets (their WQ is plain ggml quantization, so r = 0 is that stock file);
            # False is expected where a preset fits its own WQ (the refine codec's Q3_K scales)
            checks[f"{p.name}: WQ expert bytes identical to stock {p.wq.upper()}'s"] = same_bytes(
                st["model"], pairs[p.name][0], experts=True)

    # logits
    from rapidmoe import Llama  # noqa: PLC0415  (compiled part, loaded on first use)

    tok = Llama(src, n_ctx=args.n_ctx, vocab_only=True, verbose=False)
    toks = tok.tokenize(eval_path.read_text().encode(), add_bos=False, special=False)
    tok.close()
    n_chunks = min(args.chunks, len(toks) // args.n_ctx)
    chunks = [toks[i * args.n_ctx:(i + 1) * args.n_ctx] for i in range(n_chunks)]
    ref_lp: np.ndarray | None = None
    for v in variants:
        cfg: dict[str, Any] = {"model": str(v["model"]), "n_ctx": args.n_ctx, "threads": args.threads,
                               "chunks": chunks, "logits_out": str(work / "logits.npy")}
        if v["kind"] == "ours":
            cfg.update(residual=str(v["residual"]), r=v["r"])
        t1 = time.perf_counter()
        res, logits = run_variant(cfg, None, MEASURE)
        v["run_s"] = time.perf_counter() - t1
        v["eval_s"] = res["eval_s"]
        lp = log_softmax(logits)
        del logits
        if ref_lp is None:
            ref_lp = lp
        per_tok = (np.exp(ref_lp) * (ref_lp - lp)).sum(axis=-1)
        same = ref_lp.argmax(-1) == lp.argmax(-1)
        v["kl_chunks"] = [float(x) for x in per_tok.reshape(n_chunks, args.n_ctx).mean(axis=1)]
        v["kl_mean"], v["kl_p99"] = float(per_tok.mean()), float(np.quantile(per_tok, 0.99))
        v["kl_se"] = float(np.std(v["kl_chunks"], ddof=1) / math.sqrt(n_chunks)) if n_chunks > 1 else None
        v["top1_same"] = float(same.mean())
        if v["kind"] == "ours":
            bits_from_counters(v, res["counters"], next(p for p in presets if p.name == v["preset"]))
        print(f"{v['variant']}: bits {v['bits']:.3f} KL {v['kl_mean']:.5f} top-1 {v['top1_same']:.3f} "
              f"({v['run_s']:.1f} s)", flush=True)
    (work / "logits.npy").unlink(missing_ok=True)

    add_interpolation(variants, args.boot)
    rows = [{k2: (str(x) if isinstance(x, Path) else x) for k2, x in v.items()} for v in variants]
    result = {"name": name, "model": str(src), "model_mb": src.stat().st_size / 1e6, "top_k": k, "cpu": cpu_name(),
              "threads": args.threads, "n_ctx": args.n_ctx, "chunks": n_chunks, "kl_tokens": n_chunks * args.n_ctx,
              "eval": str(eval_path), "imatrix": {"chunks": args.imatrix_chunks, "seconds": imatrix_s}
              if imatrix is not None else None,
              "presets": {p.name: {**p.record(), "bits": p.bits(sorted(expert_elements(src)))}
                          for p in presets},
              "mix": mix_info,
              "checks": checks, "files_s": files_s, "total_s": time.perf_counter() - t_start, "rows": rows,
              "command": " ".join(["python", "bench/bench_experts.py", *sys.argv[1:]])}
    stem = args.out_dir / f"experts-{name}"
    png = stem.with_suffix(".png")
    result["plot"] = png.name if plot(result, png) else None
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(to_markdown(result))
    print(to_markdown(result))
    return 0


def bits_from_counters(v: dict[str, Any], counters: list[dict[str, int]], preset: Preset) -> None:
    """Ours: bits per routed-expert weight read per token from the engine's counters over the KL evaluation (WQ and
    sidecar bytes per slot over one expert's weights), and the same from the preset's accounting as a check."""
    elems = expert_elements(Path(v["model"]))
    slots = sum(c["slots"] for c in counters)
    crit = sum(c["critical_slots"] for c in counters)
    read = sum(c["wq_bytes"] + c["wr_bytes"] for c in counters)
    weights = sum(c["slots"] * elems[c["layer"]] for c in counters)
    v["critical_fraction"] = crit / slots if slots else None
    v["bits"] = 8 * read / weights if weights else float("nan")
    b = preset.bits(sorted(elems))
    v["bits_preset"] = (b["wq"] + v["critical_fraction"] * (b["critical"] - b["wq"])
                        if v["critical_fraction"] is not None and "wq" in b and "critical" in b else None)


def add_interpolation(variants: list[dict[str, Any]], n_boot: int) -> None:
    """For every variant: stock's KL at its bits (log KL linear in bits between neighbouring stock types), the
    ratio, and the ratio's 90% interval from resampling the chunks (all variants with the same resample)."""
    curves = {kind: [v for v in variants if v["kind"] == kind] for kind in ("stock", "stock+imatrix")}
    per_chunk = np.array([v["kl_chunks"] for v in variants])
    rng = np.random.default_rng(0)
    n = per_chunk.shape[1]
    boots = per_chunk[:, rng.integers(0, n, size=(n_boot, n))].mean(axis=2)  # [variant, resample]
    index = {id(v): i for i, v in enumerate(variants)}
    for kind, curve in curves.items():
        if not curve:
            continue
        key = "stock" if kind == "stock" else "stock_imatrix"
        for v in variants:
            if v["kind"] in ("ref", "floor"):
                v[f"{key}_kl_interp"] = v[f"{key}_ratio"] = v[f"{key}_ratio_ci90"] = None
                continue
            pts = [(c["bits"], c["kl_mean"]) for c in curve]
            y = interp_log(pts, v["bits"])
            v[f"{key}_kl_interp"] = y
            v[f"{key}_ratio"] = v["kl_mean"] / y if y else None
            if y is None or n < 2:
                v[f"{key}_ratio_ci90"] = None
                continue
            ratios = []
            for b in range(boots.shape[1]):
                yb = interp_log([(c["bits"], boots[index[id(c)], b]) for c in curve], v["bits"])
                ratios.append(boots[index[id(v)], b] / yb if yb else np.nan)
            lo, hi = np.nanquantile(ratios, [0.05, 0.95])
            v[f"{key}_ratio_ci90"] = [float(lo), float(hi)]


def quantize_check(checks: dict[str, Any]) -> str:
    """The sentence on how the stock files compare with the stock build's llama-quantize."""
    res = checks.get("identical_to_stock_llama_quantize", {})
    done = {k: v for k, v in res.items() if v is not None}
    if not done:
        return ("not compared here (no stock build of llama.cpp; `python tools/stock_llama.py llama-quantize` makes "
                "one and the next run compares every file byte for byte).")
    same = [k for k, v in done.items() if v]
    diff = [k for k, v in done.items() if not v]
    return (f"compared byte for byte with that command's output (the stock build of the same pin): "
            f"{len(same)} of {len(done)} files identical in every tensor's type and data"
            + (f"; DIFFERENT: {', '.join(diff)}" if diff else "") + ".")


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _kl(x: float) -> str:
    """A KL value: 5 decimals, or 2 significant digits below 1e-3 (the floor and the F16 reference)."""
    return f"{x:.5f}" if x >= 1e-3 or x == 0 else f"{x:.2e}"


def _mix_lines(r: dict[str, Any]) -> list[str]:
    """How the mixes were chosen and what each one is (nothing without --mix-bits)."""
    mix = r.get("mix")
    if not mix:
        return []
    return [f"- **ours P+mixB**: preset P with per-layer/per-role WQ types (`rapidmoe.calibration.mix`): each "
            f"routed-expert tensor alone quantized to each of {', '.join(mix['types'])}, KL to the source over "
            f"{mix['chunks']} x {r['n_ctx']} tokens of {Path(mix['calib']).name} (not the evaluation text; "
            f"{mix['seconds']:.0f} s), then the greedy allocation of B mean WQ bits per routed weight. The mixes "
            "(`[layer.]role=WQ[/down copy]`):",
            *[f"  - {name}: `{p['mix']}`" for name, p in r["presets"].items() if p.get("mix")]]


def to_markdown(r: dict[str, Any]) -> str:
    rows = r["rows"]
    floor = next(x for x in rows if x["kind"] == "floor")
    has_im = any(x["kind"] == "stock+imatrix" for x in rows)
    im = r["imatrix"]
    lines = [
        f"Experts-only frontier: `{Path(r['model']).name}` ({r['model_mb']:.1f} MB), top-{r['top_k']}. "
        "Every variant differs only in its routed-expert tensors; every other matrix is Q8_0, norms and router F32, "
        f"the same bytes in every file (checked: {'yes' if all(r['checks']['non_expert_identical'].values()) else 'NO'}"
        f"; non-expert types {', '.join(r['checks']['non_expert_types'])}).", "",
        f"CPU: {r['cpu']}, {r['threads']} threads, our build for every variant (each in a fresh process). "
        f"KL(F16 || variant) over all positions of {r['chunks']} chunks of {r['n_ctx']} tokens of "
        f"`{Path(r['eval']).name}` ({r['kl_tokens']} tokens). Command: `{r['command']}` "
        f"(files {r['files_s']:.0f} s, total {r['total_s']:.0f} s).", "",
        "How the variants were made:",
        "- **stock T**: every routed-expert tensor quantized to T by ggml's own `ggml_quantize_chunk` (through "
        "`rapidmoe._core`, the function llama-quantize calls, row-size fallback as llama-quantize), "
        + ("no importance matrix" if not has_im else
           f"without (`stock`) and with (`stock+imatrix`: {im['chunks']} x {r['n_ctx']} tokens of calib.txt, "
           f"llama-imatrix's statistics collected with our build in {im['seconds']:.0f} s) an importance matrix")
        + "; the other tensors by `rapidmoe.resplit.convert`'s rule with other = Q8_0. The equivalent stock command "
        "is `llama-quantize --tensor-type ffn_gate_exps=T --tensor-type ffn_up_exps=T --tensor-type ffn_down_exps=T "
        f"model-f16.gguf out.gguf Q8_0` (+ `--imatrix`): {quantize_check(r['checks'])}",
        "- **ours P r=N**: `rapidmoe.resplit.convert` with preset P, other tensors forced to Q8_0 (no per-tensor "
        "overrides), run by `rapidmoe.Llama(wq, residual_path=wr, n_critical=N)`.",
        *_mix_lines(r),
        *[f"- check: {k}: {'yes' if v else 'no'}" for k, v in r["checks"].items()
          if k not in ("non_expert_identical", "non_expert_types", "identical_to_stock_llama_quantize")],
        "  (yes for a residual preset, whose WQ is plain ggml quantization: its r = 0 is that stock file; no is "
        "expected where a preset fits its own WQ, as the refine codec's Q3_K scales)", "",
        "Bits = bits per routed-expert weight read per token. Stock: the type's bits per weight (every selected "
        "expert read whole). Ours: **the engine's counters** over the KL evaluation (`llm.moe_counters()`: WQ + "
        "sidecar bytes read, per expert slot, over one expert's weights); `preset bits` is the same from "
        "`Preset.bits()` (WQ + critical fraction x (critical - WQ)) as a check.", "",
        f"Noise: `± SE` is the standard error of the mean KL over the {r['chunks']} chunks; the ratio's interval is "
        "the 5-95% range over chunk resamples (all variants resampled together, so it is the paired uncertainty of "
        f"the comparison); the numerical floor (F32 copy of the same weights vs F16) is KL {floor['kl_mean']:.2e}. "
        "`stock KL at these bits`: log KL linear in bits between neighbouring stock types (`-` outside their range); "
        "ratio < 1: lower KL than stock at the same bits.", "",
        "| variant | bits read / weight | preset bits | critical slots | KL vs F16 (± SE) | KL p99 | top-1 same | "
        "stock KL at these bits | KL / stock (90% interval) |"
        + (" stock+imatrix KL at these bits | KL / stock+imatrix (90%) |" if has_im else ""),
        "|" + "---|" * (11 if has_im else 9)]
    for x in rows:
        crit = f"{100 * x['critical_fraction']:.0f}%" if x.get("critical_fraction") is not None else "-"
        cells = [x["variant"], f"{x['bits']:.3f}", _fmt(x.get("bits_preset"), ".3f"), crit,
                 f"{_kl(x['kl_mean'])} ± {_kl(x['kl_se'])}" if x["kl_se"] is not None else _kl(x["kl_mean"]),
                 f"{x['kl_p99']:.4f}", f"{x['top1_same']:.3f}"]
        for key in ("stock",) + (("stock_imatrix",) if has_im else ()):
            ci = x.get(f"{key}_ratio_ci90")
            ratio = x.get(f"{key}_ratio")
            interp = x.get(f"{key}_kl_interp")
            cells += ["-" if interp is None else _kl(interp),
                      "-" if ratio is None else f"{ratio:.2f}" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")]
        lines.append("| " + " | ".join(cells) + " |")
    if r.get("plot"):
        lines += ["", f"![KL vs bits]({r['plot']})"]
    else:
        lines += ["", "(no plot: matplotlib is not installed here; `pip install '.[bench]'` and rerun)"]
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    for kind, color, label in (("stock", "C1", "stock types (experts only)"),
                               ("stock+imatrix", "C2", "stock types + imatrix (experts only)")):
        pts = sorted((x for x in r["rows"] if x["kind"] == kind), key=lambda x: x["bits"])
        if not pts:
            continue
        ax.plot([x["bits"] for x in pts], [x["kl_mean"] for x in pts], "s-", color=color, label=label)
        for x in pts:
            ax.annotate(x["type"], (x["bits"], x["kl_mean"]), fontsize=8, xytext=(4, 4), textcoords="offset points")
    presets = list(dict.fromkeys(x["preset"] for x in r["rows"] if x["kind"] == "ours"))
    for i, p in enumerate(presets):
        ours = sorted((x for x in r["rows"] if x["kind"] == "ours" and x["preset"] == p), key=lambda x: x["bits"])
        ax.plot([x["bits"] for x in ours], [x["kl_mean"] for x in ours], "o--", color=f"C{(i + 3) % 10}",
                label=f"RapidMoE {p} (r = 0..)")
        for x in ours:
            ax.annotate(f"r={x['r']}", (x["bits"], x["kl_mean"]), fontsize=8, xytext=(4, -10),
                        textcoords="offset points")
    floor = next(x for x in r["rows"] if x["kind"] == "floor")
    ax.axhline(floor["kl_mean"], color="gray", ls=":", label="numerical floor (F32 vs F16)")
    ax.set_yscale("log")
    ax.set_xlabel("bits per routed-expert weight read per token")
    ax.set_ylabel("KL(F16 || variant), mean (log scale)")
    ax.set_title(f"{r['name']}: routed experts only, all else Q8_0")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


if __name__ == "__main__":
    sys.exit(main())
