#!/usr/bin/env python3
"""Real-size models, one command: conversion against stock llama-quantize, the memory `plan` predicts against the
RSS measured after load, load time, and prefill/decode of refine-hq r = 1 against stock Q4_K_M, all in one run.

  python bench/bench_real.py --shape qwen3-30b-a3b --work /big/disk/dir [--lock /work/cpu.lock]
  python bench/bench_real.py --shape deepseek-v3 --n-layer 5 --work /big/disk/dir [--lock /work/cpu.lock]

On the model of that shape in Q8_0 (made with make-model in --work when missing: 32.5 GB for Qwen3-30B-A3B):
  1. scaling: our conversion and llama-quantize's (Q4_K_M) with 1 and with --threads threads on a 2-layer model of
     the same shape (experts, attention and vocabulary of the real one);
  2. ours: `convert --preset refine-hq -t THREADS` timed, its peak memory polled (anonymous and total RSS); then the
     pair loaded CPU-only in a fresh process: load time and RSS growth (anonymous, file-backed) against the plan's
     figures (placement.realize.plan_for_model, gpu_mem 0); prefill and decode at r = 1 (bench_ik_speed's harness:
     llama-bench-style timing);
  3. stock: `llama-quantize --allow-requantize SRC OUT Q4_K_M THREADS` (the stock build's) timed and polled; the file
     loaded by the stock libllama: load time and RSS; its llama-bench prefill and decode with the same threads.
Outputs of one side are deleted before the other is made (--keep keeps them when the disk allows): the source and
both outputs of the 30B shape do not fit the 80 GB of the reference machine together. For the DeepSeek-V3 slice
the figures are also extrapolated to DeepSeek-V3's 61 layers: conversion time by source bytes, memory by the plan
of the whole model (placement shape set deepseek-v3) times the slice's measured/planned ratio, decode by bytes read
per token and prefill by active weights per token: stated as extrapolations. With --lock every timed step holds
that file's lock (flock) and raises this process's scheduling group (Linux autogroup) for its duration: niced jobs
of other sessions otherwise keep half of a 2-core machine. Results: JSON and a Markdown table beside it (-o).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "bench"))
from bench_ik_speed import run_ours  # noqa: E402  (bench/ on the path first)
from common import cpu_name  # noqa: E402
from ik_peer import run_llama_bench  # noqa: E402
from stock_llama import build_stock  # noqa: E402

from rapidmoe.placement import get_shape_set  # noqa: E402
from rapidmoe.placement.planner import plan as plan_shapes  # noqa: E402
from rapidmoe.placement.realize import plan_for_model  # noqa: E402
from rapidmoe.resplit import get_preset  # noqa: E402
from rapidmoe.synthetic import DEEPSEEK_V3_LAYERS, describe, spec_for_shape  # noqa: E402

GIB = 1 << 30

# RSS growth of one load, in a fresh process: ours (the pair, CPU-only) or, with the stock environment, a stock file
LOAD = r"""
import json, sys, time
def mem():
    kib = {k: int(v.split()[0]) for k, _, v in (x.partition(":") for x in open("/proc/self/status"))
           if k in ("RssAnon", "RssFile", "RssShmem")}
    return (kib["RssAnon"] + kib.get("RssShmem", 0)) * 1024, kib["RssFile"] * 1024
cfg = json.loads(sys.argv[1])
if cfg["stock"]:
    from llama_cpp import Llama
    kw = {}
else:
    from rapidmoe import Llama
    import rapidmoe._runtime
    kw = {"residual_path": cfg["wr"], "n_critical": 1}
a, t0 = mem(), time.perf_counter()
llm = Llama(model_path=cfg["model"], n_ctx=cfg["ctx"], n_threads=cfg["threads"], verbose=False, **kw)
t1, b = time.perf_counter(), mem()
llm.create_completion("Once upon a time", max_tokens=4, temperature=0)
c = mem()
print("RESULT " + json.dumps({"load_s": t1 - t0, "anon": b[0] - a[0], "file": b[1] - a[1],
                              "anon_after_decode": c[0] - a[0], "file_after_decode": c[1] - a[1]}))
"""


def machine() -> dict[str, Any]:
    mem = int(next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")).split()[1])
    return {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)), "mem_gib": round(mem / (1 << 20), 1),
            "kernel": platform.release()}


@contextlib.contextmanager
def locked(path: str | None) -> Iterator[None]:
    """A timed step: the CPU lock held and this session's scheduling group ahead of niced ones (Linux autogroup)."""
    if path is None:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        group = Path("/proc/self/autogroup")
        try:
            with contextlib.suppress(OSError):
                group.write_text("-20")
            yield
        finally:
            with contextlib.suppress(OSError):
                group.write_text("0")
            fcntl.flock(f, fcntl.LOCK_UN)


def run_polled(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `cmd`; its wall time and peak memory (anonymous, and RSS with the mapped file pages), polled from
    /proc/PID/status every 0.2 s."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, **(env or {})})
    peak = {"anon": 0, "rss": 0}
    done = threading.Event()

    def poll() -> None:
        status = Path(f"/proc/{p.pid}/status")
        while not done.is_set():
            with contextlib.suppress(OSError, ValueError, StopIteration):
                kib = {k: int(v.split()[0]) for k, _, v in (x.partition(":") for x in status.read_text().splitlines())
                       if k in ("RssAnon", "VmRSS")}
                peak["anon"] = max(peak["anon"], kib["RssAnon"] * 1024)
                peak["rss"] = max(peak["rss"], kib["VmRSS"] * 1024)
            done.wait(0.2)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    out, _ = p.communicate()
    done.set()
    th.join()
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{out[-3000:]}")
    return {"seconds": round(time.perf_counter() - t0, 1), "peak_anon_gib": round(peak["anon"] / GIB, 3),
            "peak_rss_gib": round(peak["rss"] / GIB, 3)}


def size_gb(paths: list[Path]) -> float:
    return round(sum(p.stat().st_size for p in paths) / 1e9, 3)


def make_source(shape: str, path: Path, threads: int, **overrides: Any) -> float:
    if path.exists():
        return 0.0
    t0 = time.perf_counter()
    args = [f"--{k.replace('_', '-')}={v}" for k, v in overrides.items()]
    subprocess.run(["nice", "-n", "19", sys.executable, "-m", "rapidmoe.cli", "make-model", "--shape", shape,
                    "--dtype", "q8_0", "-t", str(threads), "-o", str(path), *args], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return round(time.perf_counter() - t0, 1)


def ours_convert(src: Path, out: Path, threads: int, lock: str | None,
                 resume: bool = False) -> tuple[dict[str, Any], Path, Path]:
    """`convert --preset refine-hq`; with `resume` an unfinished conversion in `out` is continued (its journal says
    how many of its items were done before: the time is then that of the rest)."""
    journal = out / "m.resplit.journal"
    done_before = items = None
    if resume and journal.exists():
        lines = journal.read_text().splitlines()
        items, done_before = json.loads(lines[0])["items"], sum(1 for x in lines[1:] if x.endswith("}"))
    else:
        shutil.rmtree(out, ignore_errors=True)
    with locked(lock):
        r = run_polled([sys.executable, "-m", "rapidmoe.cli", "convert", str(src), "-o", str(out), "--preset",
                        "refine-hq", "-t", str(threads), "--name", "m", *(["--resume"] if done_before else [])])
    if done_before:
        r.update(resumed_items_done_before=done_before, items=items)
    wq = sorted(out.glob("m.wq*.gguf"))
    wr = sorted(out.glob("m.wr*.gguf"))
    r["output_gb"] = size_gb(wq + wr)
    return r, wq[0], wr[0]


def stock_quantize(quantize: Path, src: Path, out: Path, threads: int, lock: str | None) -> dict[str, Any]:
    out.unlink(missing_ok=True)
    with locked(lock):
        r = run_polled([str(quantize), "--allow-requantize", str(src), str(out), "Q4_K_M", str(threads)])
    r["output_gb"] = size_gb([out])
    return r


def load_rss(model: Path, wr: Path | None, ctx: int, threads: int, stock_bin: Path | None,
             lock: str | None) -> dict[str, Any]:
    cfg = {"model": str(model), "wr": str(wr) if wr else None, "ctx": ctx, "threads": threads,
           "stock": stock_bin is not None}
    env = dict(os.environ)
    if stock_bin is not None:
        env.update(LLAMA_CPP_LIB_PATH=str(stock_bin), PYTHONPATH=str(ROOT / "vendor" / "llama_cpp_py"))
    with locked(lock):
        out = subprocess.run([sys.executable, "-c", LOAD, json.dumps(cfg)], capture_output=True, text=True, env=env,
                             cwd=ROOT / "vendor" if stock_bin is not None else None, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"load of {model} failed:\n{out.stderr[-3000:]}")
    r = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("RESULT ")).removeprefix("RESULT "))
    return {"load_s": round(r["load_s"], 2), "rss_gib": round((r["anon"] + r["file"]) / GIB, 3),
            "anon_gib": round(r["anon"] / GIB, 3), "file_gib": round(r["file"] / GIB, 3),
            "rss_after_decode_gib": round((r["anon_after_decode"] + r["file_after_decode"]) / GIB, 3)}


def scaling(shape: str, work: Path, threads: int, quantize: Path, lock: str | None, layers: int) -> dict[str, Any]:
    """Our conversion and llama-quantize's on `layers` layers of the shape, with 1 and `threads` threads."""
    src = work / f"{shape}-{layers}l-q8_0.gguf"
    make_source(shape, src, threads, n_layer=layers)
    res: dict[str, Any] = {"source_gb": size_gb([src]), "layers": layers}
    for t in sorted({1, threads}):
        ours, _, _ = ours_convert(src, work / "scaling-ours", t, lock)
        stock = stock_quantize(quantize, src, work / "scaling-q4km.gguf", t, lock)
        res[f"ours_t{t}_s"], res[f"stock_t{t}_s"] = ours["seconds"], stock["seconds"]
    shutil.rmtree(work / "scaling-ours", ignore_errors=True)
    (work / "scaling-q4km.gguf").unlink(missing_ok=True)
    src.unlink()
    res["ours_speedup"] = round(res["ours_t1_s"] / res[f"ours_t{threads}_s"], 2)
    res["stock_speedup"] = round(res["stock_t1_s"] / res[f"stock_t{threads}_s"], 2)
    return res


def extrapolate(res: dict[str, Any], spec_layers: int) -> dict[str, Any]:
    """DeepSeek-V3's 61 layers from the slice: see the module docstring."""
    sl = spec_for_shape("deepseek-v3", n_layer=spec_layers, dtype="q8_0")
    full = spec_for_shape("deepseek-v3", n_layer=DEEPSEEK_V3_LAYERS, dtype="q8_0")
    d_sl, d_full = describe(sl), describe(full)
    src_ratio = d_full["tensor_bytes"] / d_sl["tensor_bytes"]
    m = get_shape_set("deepseek-v3").model_shapes()
    whole = plan_shapes(m, "resplit", preset=get_preset("refine-hq"), gpu_mem=0, n_ctx=res["ctx"])
    out = {"source_q8_0_gb": round(d_full["tensor_bytes"] / 1e9, 1),
           "ours_convert_hours": round(res["ours"]["convert"]["seconds"] * src_ratio / 3600, 1),
           "stock_quantize_hours": round(res["stock"]["quantize"]["seconds"] * src_ratio / 3600, 1),
           "plan_rss_gib": round(whole.resident / GIB, 1),
           "rss_gib_at_measured_ratio": round(whole.resident / GIB * res["ours"]["rss_over_plan"], 1)}
    bpt = d_full["bytes_per_token"] / d_sl["bytes_per_token"]
    act = d_full["active_params_per_token"] / d_sl["active_params_per_token"]
    for side in ("ours", "stock"):
        sp = res[side]["speed"]
        out[f"{side}_tg_tps"] = round(sp["tg_tps"] / bpt, 2)
        out[f"{side}_pp_tps"] = round(sp["pp_tps"] / act, 2)
    return out


def markdown(res: dict[str, Any], cmd: str) -> str:
    m, o, s = res["machine"], res["ours"], res["stock"]
    lines = [f"# Real size: {res['shape']} ({res['n_layer']} layers) from Q8_0 ({res['source_gb']} GB)", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB; {res['threads']} threads. "
             f"Command: `{cmd}`", "",
             "| | ours: convert refine-hq | stock: llama-quantize Q4_K_M | ours / stock |", "|---|---|---|---|"]
    oc, sc = o["convert"], s["quantize"]
    if oc.get("resumed_items_done_before"):
        rest = 1 - oc["resumed_items_done_before"] / oc["items"]
        lines.append(f"| conversion time | {oc['seconds']} s for the last {rest:.0%} of the items (resumed), about "
                     f"{oc['seconds'] / rest:.0f} s whole | {sc['seconds']} s | throughput about "
                     f"{sc['seconds'] * rest / oc['seconds']:.2f}x |")
    else:
        lines.append(f"| conversion time | {oc['seconds']} s | {sc['seconds']} s | throughput "
                     f"{sc['seconds'] / oc['seconds']:.2f}x |")
    lines.append(f"| peak memory (anonymous / RSS) | {oc['peak_anon_gib']} / {oc['peak_rss_gib']} GiB | "
                 f"{sc['peak_anon_gib']} / {sc['peak_rss_gib']} GiB | |")
    lines.append(f"| output | {oc['output_gb']} GB | {sc['output_gb']} GB | |")
    ol, sl = o["load"], s["load"]
    lines.append(f"| RSS after load (anonymous + file) | {ol['rss_gib']} ({ol['anon_gib']} + {ol['file_gib']}) GiB | "
                 f"{sl['rss_gib']} ({sl['anon_gib']} + {sl['file_gib']}) GiB | |")
    lines.append(f"| plan (anonymous + file) | {o['plan']['resident_gib']} ({o['plan']['anon_gib']} + "
                 f"{o['plan']['file_gib']}) GiB | | measured / plan {o['rss_over_plan']:.3f} |")
    lines.append(f"| load time | {ol['load_s']} s | {sl['load_s']} s | |")
    lines.append(f"| prefill pp{res['pp']} (r = 1) | {o['speed']['pp_tps']:.2f} tok/s | "
                 f"{s['speed']['pp_tps']:.2f} tok/s | {o['speed']['pp_tps'] / s['speed']['pp_tps']:.2f}x |")
    lines.append(f"| decode tg{res['tg']} (r = 1) | {o['speed']['tg_tps']:.2f} tok/s | {s['speed']['tg_tps']:.2f} "
                 f"tok/s | {o['speed']['tg_tps'] / s['speed']['tg_tps']:.2f}x |")
    sc_ = res.get("scaling")
    if sc_:
        t = res["threads"]
        lines += ["", f"Scaling ({sc_['layers']} layers of the same shape, {sc_['source_gb']} GB): ours 1 -> {t} "
                  f"threads {sc_['ours_t1_s']} -> {sc_[f'ours_t{t}_s']} s ({sc_['ours_speedup']}x); llama-quantize "
                  f"{sc_['stock_t1_s']} -> {sc_[f'stock_t{t}_s']} s ({sc_['stock_speedup']}x)."]
    ex = res.get("extrapolated")
    if ex:
        lines += ["", f"EXTRAPOLATED to DeepSeek-V3's {DEEPSEEK_V3_LAYERS} layers (not measured): Q8_0 source "
                  f"{ex['source_q8_0_gb']} GB; ours {ex['ours_convert_hours']} h, llama-quantize "
                  f"{ex['stock_quantize_hours']} h on these {res['threads']} threads (by source bytes); plan "
                  f"{ex['plan_rss_gib']} GiB host memory CPU-only ({ex['rss_gib_at_measured_ratio']} GiB at the "
                  f"slice's measured/plan ratio); decode ours {ex['ours_tg_tps']} vs stock {ex['stock_tg_tps']} tok/s "
                  f"(by bytes read per token), prefill {ex['ours_pp_tps']} vs {ex['stock_pp_tps']} tok/s (by active "
                  "weights per token)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, choices=["qwen3-30b-a3b", "deepseek-v3"])
    ap.add_argument("--n-layer", type=int, default=None, help="layers of the shape (deepseek-v3: the slice's)")
    ap.add_argument("--work", type=Path, required=True, help="a folder with room for the source and one output")
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--pp", type=int, default=256)
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--scaling-layers", type=int, default=2, help="layers of the 1-vs-N-threads model (0: skip)")
    ap.add_argument("--lock", default=None, help="a lock file every timed step holds (flock)")
    ap.add_argument("--keep", action="store_true", help="keep the outputs (and the source)")
    ap.add_argument("--resume", action="store_true",
                    help="continue a run that stopped: keep the scaling figures of -o's JSON and continue the "
                         "unfinished conversion in --work (the time recorded is then that of its rest)")
    ap.add_argument("-o", "--output", type=Path, default=None)
    args = ap.parse_args()
    cmd = "python bench/bench_real.py " + " ".join(sys.argv[1:])
    args.work.mkdir(parents=True, exist_ok=True)
    stock_bin = build_stock(["llama", "llama-quantize", "llama-bench"])
    quantize = stock_bin / "llama-quantize"
    spec = spec_for_shape(args.shape, **({"n_layer": args.n_layer} if args.n_layer else {}))
    tag = f"{args.shape}" + (f"-{args.n_layer}l" if args.n_layer else "")
    out = args.output or ROOT / "bench" / "results" / f"real-size-{tag}.json"
    res: dict[str, Any] = {"shape": args.shape, "n_layer": spec.n_layer, "threads": args.threads, "ctx": args.ctx,
                           "pp": args.pp, "tg": args.tg, "machine": machine(), "command": cmd}

    def save() -> None:
        out.write_text(json.dumps(res, indent=1) + "\n")

    earlier = json.loads(out.read_text()) if args.resume and out.exists() else {}
    if "scaling" in earlier:
        res["scaling"] = earlier["scaling"]
    elif args.scaling_layers:
        res["scaling"] = scaling(args.shape, args.work, args.threads, quantize, args.lock, args.scaling_layers)
        save()
    src = args.work / f"{tag}-q8_0.gguf"
    res["make_model_s"] = make_source(args.shape, src, args.threads,
                                      **({"n_layer": args.n_layer} if args.n_layer else {}))
    res["source_gb"] = size_gb([src])
    conv, wq, wr = ours_convert(src, args.work / "ours", args.threads, args.lock, args.resume)
    p = plan_for_model(wq, wr, gpu_mem=0, n_ctx=args.ctx)
    load = load_rss(wq, wr, args.ctx, args.threads, None, args.lock)
    res["ours"] = {"convert": conv, "load": load,
                   "plan": {"resident_gib": round(p.resident / GIB, 3), "anon_gib": round((p.dram_anon + p.runtime)
                                                                                          / GIB, 3),
                            "file_gib": round(p.dram_file / GIB, 3)},
                   "rss_over_plan": round(load["rss_gib"] / (p.resident / GIB), 3)}
    save()
    with locked(args.lock):
        sp = run_ours(wq, wr, 1, args.pp, args.tg)
    res["ours"]["speed"] = {"pp_tps": sp["pp"], "tg_tps": sp["tg"]}
    save()
    if not args.keep:
        shutil.rmtree(args.work / "ours")
    q4 = args.work / f"{tag}-Q4_K_M.gguf"
    res["stock"] = {"quantize": stock_quantize(quantize, src, q4, args.threads, args.lock)}
    save()
    res["stock"]["load"] = load_rss(q4, None, args.ctx, args.threads, stock_bin, args.lock)
    with locked(args.lock):
        res["stock"]["speed"] = run_llama_bench(stock_bin / "llama-bench", q4, args.pp, args.tg, args.threads)
    if args.shape == "deepseek-v3":
        res["extrapolated"] = extrapolate(res, spec.n_layer)
    save()
    if not args.keep:
        q4.unlink()
        src.unlink()
    md = markdown(res, cmd)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
