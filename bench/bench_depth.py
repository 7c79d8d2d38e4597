#!/usr/bin/env python3
"""Decode and prefill at context depth (llama-bench's -d convention), ours against stock llama.cpp and
ik_llama.cpp, flash attention on for all, per KV cache type (-ctk/-ctv f16, q8_0), with a plot of tok/s against depth.

At each depth D: tg = --tg decode steps after a D-token context (one random token per llama_decode, as llama-bench's
tg), pp = one --pp-token batch after the same D tokens (llama-bench's pp512 @ dD). How each engine gets there:
- ours (a preset's pair in bench/out/frontier-work at r): one process sweeps the depths in order, filling the
  context in --pp-token batches of random tokens; at each depth it times the tg steps, removes them from the cache,
  then times the next batch, which the context keeps (the protocol of ik_llama.cpp's sweep-bench);
- ik_llama.cpp (bench/ik_peer.py): its llama-sweep-bench with run-time repacking (-rtr) over the same depths
  (--sweep-stride: only the windows at the depths, and those between them, are measured), the same protocol;
- stock llama.cpp (tools/stock_llama.py): its llama-bench -d D -p PP -n TG (each test fills its own context); or,
  with --stock-states DIR, bench/depth_state.cpp built against stock's libllama: the same pp and tg tests, each from
  the depth's context restored from a state file (as llama-bench restores a depth between its repetitions), the
  file written once into DIR by the same program built against our libllama filling the same stock file. Stock's
  own fill of 32k tokens would take about two hours here with a q8_0 cache (pp512 at 4.6 tok/s at 16k, 2.4 at
  32k); a step's time depends on the cache's size, not its values.
Every engine runs 2 threads, one process per point and KV type, each under the cpu lock, the points in alternating
order over --reps passes (medians). The context of the deepest runs is large: --depths 32768 fills 32k tokens once
per point in a sweep (twice per depth for stock's llama-bench); budget its reps and tg with that in mind.

  python bench/bench_depth.py --ik build/ik-src [--presets refine-hq=1,cpu-fast=1] [--stock-types Q4_K_M]
      [--ik-types Q4_K_M] [--depths 0,4096,16384,32768] [--kv f16,q8_0] [--tg 16] [--pp 512] [--reps 1]
      [--stock-states bench/out/depth-states]
Writes --out (JSON), its .md table and .png plot beside it. `--merge A.json B.json ...` writes one table and plot
from earlier runs' files (their rows together, the first file's baseline; each run keeps its own command).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import cpu_name, pair_dir, pyplot
from ik_peer import locate_or_build, tool

from rapidmoe._runtime import LIB_DIR

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from stock_llama import build_stock  # noqa: E402  (tools/ on the path first)

WORK = ROOT / "bench" / "out" / "frontier-work"
LOCK = Path("/work/cpu.lock")
KV_TYPES = {"f16": 1, "q8_0": 8}  # ggml_type of llama.cpp's -ctk/-ctv names

# Our sweep in a fresh process: a JSON line {depth: {"tg": tok/s, "pp": tok/s}}
OURS = r"""
import json, random, sys, time
from rapidmoe import Llama
from rapidmoe._runtime import llama_cpp as lc
cfg = json.loads(sys.argv[1])
depths, pp, tg = cfg["depths"], cfg["pp"], cfg["tg"]
llm = Llama(model_path=cfg["wq"], residual_path=cfg["wr"], n_critical=cfg["r"], n_ctx=max(depths) + pp + tg + 16,
            n_batch=pp, n_ubatch=pp, n_threads=cfg["threads"], n_threads_batch=cfg["threads"], verbose=False,
            flash_attn="on", type_k=cfg["type_k"], type_v=cfg["type_v"])
ctx, rng, n_vocab = llm._ctx.ctx, random.Random(0), llm.n_vocab()
mem = lc.llama_get_memory(ctx)
def decode(tokens, pos0):
    batch = lc.llama_batch_init(len(tokens), 0, 1)
    for i, t in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, pos0 + i, 1, i == len(tokens) - 1
        batch.seq_id[i][0] = 0
    batch.n_tokens = len(tokens)
    if lc.llama_decode(ctx, batch) != 0:
        raise SystemExit("llama_decode failed")
    lc.llama_synchronize(ctx)
    lc.llama_batch_free(batch)
def ubatch():
    return [rng.randrange(n_vocab) for _ in range(pp)]
decode(ubatch(), 0)  # warm-up (llama-bench's), then an empty cache
lc.llama_memory_clear(mem, True)
n, out = 0, {}
for d in sorted(depths):
    while n < d:  # the context: whole batches of pp (depths are multiples of pp)
        decode(ubatch(), n)
        n += pp
    decode([rng.randrange(n_vocab)], n)  # one untimed step, as llama-bench warms up
    lc.llama_memory_seq_rm(mem, 0, n, -1)
    t0 = time.perf_counter()
    for i in range(tg):
        decode([rng.randrange(n_vocab)], n + i)
    t_tg = time.perf_counter() - t0
    lc.llama_memory_seq_rm(mem, 0, n, -1)
    toks = ubatch()
    t0 = time.perf_counter()
    decode(toks, n)
    t_pp = time.perf_counter() - t0
    n += pp
    out[d] = {"tg": tg / t_tg, "pp": pp / t_pp}
    print("DEPTH " + json.dumps({"depth": d, **out[d]}), flush=True)
llm.close()
print("RESULT " + json.dumps(out))
"""


def _locked(cmd: list[str]) -> list[str]:
    return ["flock", str(LOCK), *cmd] if LOCK.exists() else cmd


def run_ours(wq: Path, wr: Path, r: int, depths: list[int], pp: int, tg: int, kv: str,
             threads: int) -> dict[int, dict[str, float]]:
    cfg = {"wq": str(wq), "wr": str(wr), "r": r, "depths": depths, "pp": pp, "tg": tg, "threads": threads,
           "type_k": KV_TYPES[kv], "type_v": KV_TYPES[kv]}
    out = subprocess.run(_locked([sys.executable, "-c", OURS, json.dumps(cfg)]), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ours failed: {out.stderr[-3000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return {int(d): v for d, v in json.loads(line.removeprefix("RESULT ")).items()}


def run_stock(bench: Path, model: Path, depths: list[int], pp: int, tg: int, kv: str,
              threads: int) -> dict[int, dict[str, float]]:
    """Stock llama-bench with -d: each test (pp, tg) at each depth fills its own context first."""
    cmd = [str(bench), "-m", str(model), "-t", str(threads), "-p", str(pp), "-n", str(tg), "-r", "1", "-fa", "1",
           "-ctk", kv, "-ctv", kv, "-d", ",".join(map(str, depths)), "-o", "json"]
    out = subprocess.run(_locked(cmd), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {out.stderr[-3000:]}")
    res: dict[int, dict[str, float]] = {d: {} for d in depths}
    for t in json.loads(out.stdout[out.stdout.index("["):]):
        key = "pp" if t["n_prompt"] > 0 and t["n_gen"] == 0 else "tg"
        res[int(t.get("n_depth", 0))][key] = float(t["avg_ts"])
    return res


def build_depth_state(lib: Path, out: Path) -> Path:
    """bench/depth_state.cpp linked (rpath) to the libllama in lib."""
    inc = ROOT / "vendor" / "llama.cpp"
    subprocess.run(_locked(["g++", "-O2", "-std=c++17", str(ROOT / "bench" / "depth_state.cpp"),
                            f"-I{inc / 'include'}", f"-I{inc / 'ggml' / 'include'}", f"-L{lib}", "-lllama", "-lggml",
                            "-lggml-base", f"-Wl,-rpath,{lib}", "-o", str(out)]), check=True)
    return out


def run_depth_state(exe: Path, model: Path, depths: list[int], pp: int, tg: int, kv: str, threads: int,
                    *extra: str) -> dict[int, dict[str, Any]]:
    """depth_state's JSON lines by depth: tg and pp (tok/s), source ("fill" or "state")."""
    cmd = [str(exe), str(model), "--kv", kv, "--threads", str(threads), "--pp", str(pp), "--tg", str(tg),
           "--depths", ",".join(map(str, depths)), *extra]
    out = subprocess.run(_locked(cmd), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    return {int(r["depth"]): {"tg": r["tg"], "pp": r["pp"], "source": r["source"]} for r in rows}


def run_stock_restored(exes: tuple[Path, Path], model: Path, depths: list[int], pp: int, tg: int, kv: str,
                       threads: int, states: Path) -> dict[int, dict[str, Any]]:
    """Stock's libllama at each depth restored from states/<model>-<kv>-d<D>.state (depth_state.cpp's state_path),
    written first by our libllama."""
    ours, stock = exes
    missing = [d for d in depths if d and not (states / f"{model.name}-{kv}-d{d}.state").exists()]
    if missing:
        run_depth_state(ours, model, depths, pp, tg, kv, threads, "--save", str(states))
    res = run_depth_state(stock, model, depths, pp, tg, kv, threads, "--load", str(states))
    if any(v["source"] != "state" for d, v in res.items() if d):
        raise RuntimeError(f"stock filled a depth it should have restored: {res}")
    return res


def run_ik(sweep: Path, model: Path, depths: list[int], pp: int, tg: int, kv: str,
           threads: int) -> dict[int, dict[str, float]]:
    """ik's llama-sweep-bench (-rtr): tg then pp at every measured window of pp tokens; the windows at the depths."""
    stride = math.gcd(*[d // pp for d in depths if d]) if any(depths) else 1
    cmd = [str(sweep), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", str(max(depths) + pp),
           "-ub", str(pp), "-b", str(pp), "-n", str(tg), "-fa", "on", "-ctk", kv, "-ctv", kv, "-rtr",
           "--sweep-stride", str(stride), "--output-format", "jsonl"]
    out = subprocess.run(_locked(cmd), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"sweep-bench failed: {' '.join(cmd)}\n{out.stderr[-3000:]}")
    res: dict[int, dict[str, float]] = {}
    for line in out.stdout.splitlines() + out.stderr.splitlines():
        if line.startswith("{") and '"speed_pp"' in line:
            row = json.loads(line)
            if int(row["n_kv"]) in depths:
                res[int(row["n_kv"])] = {"pp": float(row["speed_pp"]), "tg": float(row["speed_tg"])}
    if set(res) != set(depths):
        raise RuntimeError(f"sweep-bench gave depths {sorted(res)}, not {depths}:\n{out.stdout[-2000:]}")
    return res


def _median_rows(times: dict[str, dict[str, dict[int, dict[str, list[float]]]]]) -> list[dict[str, Any]]:
    rows = []
    for kv, points in times.items():
        for name, per_depth in points.items():
            for d, v in sorted(per_depth.items()):
                rows.append({"kv": kv, "variant": name, "depth": d, "tg_tps": statistics.median(v["tg"]),
                             "pp_tps": statistics.median(v["pp"]), "tg_all": v["tg"], "pp_all": v["pp"]})
    return rows


def to_markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    depths = sorted({r["depth"] for r in rows})
    lines = [f"`{result['command']}`", "",
             f"{result['threads']} threads, pp{result['pp']} and tg{result['tg']} at each depth, flash attention on, "
             f"median of {result['reps']} pass(es); ik_llama.cpp {result['ik_commit']}; {result['cpu']}" +
             (f"; stock's contexts {result['stock_depths']}" if result.get("stock_depths") else ""), ""]
    for kv in result["kv"]:
        for what, key in (("decode", "tg_tps"), ("prefill", "pp_tps")):
            lines += [f"### {what} tok/s, KV cache {kv} (ratio to {result['baseline']} at the same depth)", "",
                      "| variant | " + " | ".join(f"depth {d}" for d in depths) + " |",
                      "|---|" + "---|" * len(depths)]
            base = {r["depth"]: r[key] for r in rows if r["kv"] == kv and r["variant"] == result["baseline"]}
            for name in dict.fromkeys(r["variant"] for r in rows if r["kv"] == kv):
                cells = []
                for d in depths:
                    x = next((r[key] for r in rows if r["kv"] == kv and r["variant"] == name and r["depth"] == d),
                             None)
                    cells.append("-" if x is None else f"{x:.2f}" + (f" ({x / base[d]:.2f}x)" if base.get(d) else ""))
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    kvs = result["kv"]
    fig, axes = plt.subplots(2, len(kvs), figsize=(6 * len(kvs), 8), squeeze=False)
    for col, kv in enumerate(kvs):
        for row, (what, key) in enumerate((("decode", "tg_tps"), ("prefill", "pp_tps"))):
            ax = axes[row][col]
            for name in dict.fromkeys(r["variant"] for r in result["rows"] if r["kv"] == kv):
                pts = sorted((r["depth"], r[key]) for r in result["rows"] if r["kv"] == kv and r["variant"] == name)
                ax.plot([d for d, _ in pts], [t for _, t in pts], marker="o", label=name)
            ax.set_xlabel("context depth (tokens)")
            ax.set_ylabel(f"{what} tok/s")
            ax.set_title(f"{what}, KV {kv}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def merge(files: list[Path]) -> dict[str, Any]:
    """Earlier runs' results as one: rows together (a variant, KV type and depth from one file only)."""
    runs = [json.loads(f.read_text()) for f in files]
    seen: set[tuple[str, str, int]] = set()
    for run in runs:
        for r in run["rows"]:
            key = (r["kv"], r["variant"], r["depth"])
            if key in seen:
                raise SystemExit(f"{key} is in more than one of {[str(f) for f in files]}")
            seen.add(key)
    first = runs[0]
    return {**first, "command": "`; `".join(r["command"] for r in runs),
            "kv": list(dict.fromkeys(k for r in runs for k in r["kv"])),
            "depths": sorted({d for r in runs for d in r["depths"]}),
            "ik_commit": next((r["ik_commit"] for r in runs if r.get("ik_commit")), None),
            "stock_depths": next((r["stock_depths"] for r in runs if r.get("stock_depths") and
                                  any(x["variant"].startswith("stock ") for x in r["rows"])), None),
            "baseline": next((r["baseline"] for r in runs if r["baseline"].startswith("stock ")), first["baseline"]),
            "merged": [str(f) for f in files], "rows": [x for r in runs for x in r["rows"]]}


def write_result(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    md = to_markdown(result)
    out.with_suffix(".md").write_text(md + "\n")
    plot(result, out.with_suffix(".png"))
    print(md)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--merge", type=Path, nargs="+", default=None, help="earlier runs' JSON files: one table")
    ap.add_argument("--ik", type=Path, default=None, help="ik_llama.cpp build folder or source (bench/ik_peer.py)")
    ap.add_argument("--model-stem", default="synthetic-qwen3moe-bench")
    ap.add_argument("--presets", default="refine-hq=1,cpu-fast=1", help="our pairs and their r: NAME=R,...")
    ap.add_argument("--stock-types", default="Q4_K_M", help="stock files run by the stock build's llama-bench")
    ap.add_argument("--ik-types", default="Q4_K_M", help="files run by ik's llama-sweep-bench -rtr (its own types too)")
    ap.add_argument("--depths", default="0,4096,16384,32768")
    ap.add_argument("--kv", default="f16,q8_0", help="KV cache types (-ctk/-ctv), comma-separated")
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--stock-states", type=Path, default=None,
                    help="stock at each depth restored from state files in this folder (bench/depth_state.cpp)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "depth.json")
    args = ap.parse_args()
    if args.merge:
        write_result(merge(args.merge), args.out)
        return 0
    depths = sorted(int(x) for x in args.depths.split(",") if x)
    if any(d % args.pp for d in depths):
        ap.error("depths must be multiples of --pp (the sweeps fill the context in whole batches)")
    kvs = [k for k in args.kv.split(",") if k]
    unknown = sorted(set(kvs) - set(KV_TYPES))
    if unknown:
        ap.error(f"unknown KV types {unknown} (supported: {', '.join(KV_TYPES)})")
    ik = locate_or_build(args.ik) if args.ik is not None and args.ik_types else None
    sweep = tool(ik, "llama-sweep-bench") if ik is not None else None
    stock_bench = build_stock(["llama-bench"]) / "llama-bench" if args.stock_types else None
    restored: tuple[Path, Path] | None = None
    if args.stock_states is not None and stock_bench is not None:
        args.stock_states.mkdir(parents=True, exist_ok=True)
        restored = (build_depth_state(LIB_DIR, args.stock_states / "depth_state-ours"),
                    build_depth_state(stock_bench.parent, args.stock_states / "depth_state-stock"))
    points: dict[str, tuple[str, Any]] = {}
    for t in (t for t in args.stock_types.split(",") if t):
        points[f"stock {t}"] = ("stock", WORK / f"{args.model_stem}.{t}.gguf")
    for t in (t for t in args.ik_types.split(",") if t and ik is not None):
        points[f"ik {t} -rtr"] = ("ik", WORK / f"{args.model_stem}.{t}.gguf")
    for spec in (x for x in args.presets.split(",") if x):
        name, _, r = spec.partition("=")
        pair = pair_dir(WORK, args.model_stem, name)
        points[f"ours {name} r={r or 1}"] = ("ours", (pair / f"{args.model_stem}.wq.gguf",
                                                      pair / f"{args.model_stem}.wr.gguf", int(r or 1)))
    times: dict[str, dict[str, dict[int, dict[str, list[float]]]]] = {kv: {} for kv in kvs}
    for rep in range(args.reps):
        order = [(kv, name) for kv in kvs for name in points]
        for kv, name in order if rep % 2 == 0 else order[::-1]:
            kind, spec = points[name]
            t0 = time.perf_counter()
            if kind == "stock":
                assert stock_bench is not None
                res = (run_stock_restored(restored, spec, depths, args.pp, args.tg, kv, args.threads,
                                          args.stock_states) if restored and args.stock_states
                       else run_stock(stock_bench, spec, depths, args.pp, args.tg, kv, args.threads))
            elif kind == "ik":
                assert sweep is not None
                res = run_ik(sweep, spec, depths, args.pp, args.tg, kv, args.threads)
            else:
                wq, wr, r = spec
                res = run_ours(wq, wr, r, depths, args.pp, args.tg, kv, args.threads)
            per = times[kv].setdefault(name, {})
            for d, v in res.items():
                per.setdefault(d, {"tg": [], "pp": []})
                per[d]["tg"].append(v["tg"])
                per[d]["pp"].append(v["pp"])
            print(f"rep {rep} KV {kv} {name} ({time.perf_counter() - t0:.0f} s): " +
                  ", ".join(f"d{d} tg {v['tg']:.2f} pp {v['pp']:.1f}" for d, v in sorted(res.items())), flush=True)
    result = {"command": " ".join(["python", "bench/bench_depth.py", *sys.argv[1:]]), "threads": args.threads,
              "pp": args.pp, "tg": args.tg, "reps": args.reps, "kv": kvs, "depths": depths,
              "ik_commit": ik.commit if ik is not None else None, "cpu": cpu_name(),
              "stock_depths": None if stock_bench is None else
              "restored from states written by our libllama" if restored else "filled by llama-bench",
              "baseline": next((n for n in points if n.startswith("stock ")), next(iter(points))),
              "rows": _median_rows(times)}
    write_result(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
