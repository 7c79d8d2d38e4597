#!/usr/bin/env python3
"""UMIA vs fixed r vs dropping non-critical experts: KL to the F16 model against MEASURED decode tokens/s, one run.

Steps, all on one RESplit pair (default: the `cpu` preset of the trained tiny-moe-a; --model for another F16 model,
e.g. the bench-size synthetic qwen3moe):
 1. calibrate-latency on this machine (the fit's measured vs predicted table is in the results);
 2. calibrate on text A (the frontier: fixed r, UMIA at equal predicted cost, drop), and again on text B (stability:
    how far the chosen parameters move, in steps of the 0.01 grid, at a fixed budget and at the knee);
 3. proof: fixed r = 0..4 (and k), drop r = 1..3 and the UMIA frontier points from text A are scored on held-out
    text B (KL to F16) and their decode speed is measured (median step time of --tg single-token steps after an
    8-token prompt, --reps repetitions in alternating order); the plot puts KL against measured tokens/s.

Usage: python bench/bench_umia.py [--model F16.gguf --preset cpu] [--text-a A.txt --text-b B.txt]
Writes bench/out/umia-<name>.{json,md,png} (copy to bench/results/ to publish).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from rapidmoe.calibration.measure import calibrate_latency, decode_step_ms
from rapidmoe.calibration.umia import CalibrationResult, Scorer, calibrate, evaluate, log_softmax, pick_chunks
from rapidmoe.resplit import convert, get_preset
from rapidmoe.umia import Policy
from rapidmoe.umia.frontier import choose, pareto
from rapidmoe.umia.latency import LatencyModel

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
SHARED = ROOT.parent / "shared" / "models" / "tiny-moe-a"


def convert_once(src: Path, preset: str, work: Path) -> tuple[Path, Path]:
    name = src.name.removesuffix(".gguf")
    d = work / f"{name}.{preset}"
    wq, wr = d / f"{name}.wq.gguf", d / f"{name}.wr.gguf"
    if not (wq.exists() and wr.exists()):
        convert(src, d, get_preset(preset), progress=True, force=True)
    return wq, wr


def measure_decode(wq: Path, wr: Path, policies: list[tuple[str, str, Policy]], tg: int, reps: int,
                   threads: int) -> dict[str, float]:
    """Decode tokens/s per policy label (drop ones on a drop-mode context)."""
    from rapidmoe import Llama  # noqa: PLC0415  (compiled part, loaded on first use)

    out: dict[str, list[float]] = {label: [] for label, _, _ in policies}
    for drop in (False, True):
        sel = [(lab, pol) for lab, kind, pol in policies if (kind == "drop") == drop]
        if not sel:
            continue
        llm = Llama(wq, residual_path=wr, n_ctx=64 + tg, n_threads=threads, n_threads_batch=threads,
                    verify_residual=False, skip_noncritical=drop, verbose=False)
        toks = llm.tokenize(b"The router of a mixture of experts picks a few experts for every token. " * 8)
        prompt, steps = toks[:8], toks[8:8 + tg]
        llm.eval(prompt)
        for rep in range(reps):
            for lab, pol in (sel if rep % 2 == 0 else sel[::-1]):
                llm.set_policy(replace(pol, phase="auto"))
                out[lab].append(1e3 / decode_step_ms(llm, prompt, steps))
        llm.close()
    return {lab: statistics.median(v) for lab, v in out.items()}


def score_heldout(wq: Path, wr: Path, ref: Path, text: Path, policies: list[tuple[str, str, Policy]], tokens: int,
                  chunk: int, threads: int, latency: LatencyModel) -> dict[str, dict[str, float]]:
    r = Scorer(ref, chunk, threads)
    chunks = pick_chunks(r.llm.tokenize(text.read_text(errors="replace").encode()), tokens, chunk, seed=1)
    ref_logp = [log_softmax(r.logits(c)) for c in chunks]
    r.close()
    res: dict[str, dict[str, float]] = {}
    bar = tqdm(total=len(policies) * len(chunks), desc="held-out KL", unit="chunk")
    for drop in (False, True):
        sel = [(lab, kind, pol) for lab, kind, pol in policies if (kind == "drop") == drop]
        if not sel:
            continue
        s = Scorer(wq, chunk, threads, residual_path=wr, verify_residual=False, skip_noncritical=drop)
        for lab, kind, pol in sel:
            e = evaluate(s, lab, kind, pol, chunks, ref_logp, latency, bar)
            res[lab] = {"kl_mean": e.kl_mean, "kl_p99": e.kl_p99, "top1_same": e.top1_same,
                        "critical_per_token": e.critical_per_token, "predicted_ms": e.predicted_ms}
        s.close()
    bar.close()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=SHARED / "model-f16.gguf", help="F16 MoE model (KL reference)")
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--wq", type=Path, default=None, help="an existing RESplit pair of --model (skips converting)")
    ap.add_argument("--wr", type=Path, default=None)
    ap.add_argument("--text-a", type=Path, default=SHARED / "calib.txt")
    ap.add_argument("--text-b", type=Path, default=SHARED / "eval.txt")
    ap.add_argument("--tokens", type=int, default=1024, help="calibration / held-out tokens per text")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--alphas", default="0,0.25,0.5,1")
    ap.add_argument("--levels", default=None, help="target mean r of the UMIA candidates (default: calibrate's)")
    ap.add_argument("--tg", type=int, default=32, help="decode steps per speed measurement")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=OUT / "umia-work")
    a = ap.parse_args()

    t_start = time.time()
    a.work.mkdir(parents=True, exist_ok=True)
    wq, wr = (a.wq, a.wr) if a.wq and a.wr else convert_once(a.model, a.preset, a.work)
    name = a.model.name.removesuffix(".gguf")
    lat = calibrate_latency(wq, wr, threads=a.threads, decode_tokens=16, repeats=3)
    lat.save(a.work / f"{name}.latency.json")
    print(lat.table())
    k = lat.k
    alphas = tuple(float(x) for x in a.alphas.split(","))
    levels = tuple(float(x) for x in a.levels.split(",")) if a.levels else None
    fixed_r = tuple(sorted({r for r in (0, 1, 2, 3, 4, k) if r <= k}))
    budget = lat.predict_ms(lat.n_moe_layers * 2)  # the cost of fixed r = 2: a common budget for both texts
    runs: dict[str, CalibrationResult] = {}
    for tag, text in (("A", a.text_a), ("B", a.text_b)):
        res = calibrate(wq, wr, text, lat, reference=a.model, budget_ms=budget, n_tokens=a.tokens, chunk=a.chunk,
                        seed=0, alphas=alphas, levels=levels, fixed_r=fixed_r, threads=a.threads, refine=True)
        runs[f"{tag}-budget"] = res
        res.save(a.work / f"calib-{tag}")
    stab = []
    for mode in ("budget", "knee"):
        pa, pb = (_choice(runs[f"{t}-budget"], mode) for t in ("A", "B"))
        stab.append({"choice": mode, "A": pa.describe(), "B": pb.describe(),
                     "theta_steps": round(abs(pa.theta - pb.theta) / 0.01), "alpha_steps":
                     round(abs(pa.alpha - pb.alpha) / 0.01)})

    # proof: fixed r, drop, and text A's UMIA frontier points, scored on held-out text B and timed
    ra = runs["A-budget"]
    fixed = list(fixed_r)
    pols: list[tuple[str, str, Policy]] = [(f"r={r}", "fixed", replace(Policy.fixed(r), phase="decode"))
                                           for r in fixed]
    pols += [(f"drop r={r}", "drop", replace(Policy.fixed(r), phase="decode")) for r in (1, 2, 3) if r < k]
    umia = [i for i in ra.frontier if ra.evaluations[i].kind == "umia"]
    umia_all = [i for i, e in enumerate(ra.evaluations) if e.kind == "umia"]
    # the best UMIA point at each cost level (frontier or not: each is compared with the fixed r of equal cost)
    by_level: dict[float, int] = {}
    for i in umia_all:
        e = ra.evaluations[i]
        lvl = round(e.critical_per_token / lat.n_moe_layers * 4) / 4
        if lvl not in by_level or e.kl_mean < ra.evaluations[by_level[lvl]].kl_mean:
            by_level[lvl] = i
    chosen_umia = sorted(set(umia) | set(by_level.values()))
    for i in chosen_umia:
        e = ra.evaluations[i]
        pols.append((f"umia {e.policy.describe()}", "umia", replace(e.policy, phase="decode", meta={})))
    held = score_heldout(wq, wr, a.model, a.text_b, pols, a.tokens, a.chunk, a.threads, lat)
    speed = measure_decode(wq, wr, pols, a.tg, a.reps, a.threads)
    rows: list[dict[str, Any]] = []
    for lab, kind, pol in pols:
        rows.append({"label": lab, "kind": kind, "policy": pol.to_dict(), **held[lab], "decode_tps": speed[lab]})
    tps, kls = [-r["decode_tps"] for r in rows], [r["kl_mean"] for r in rows]
    front = {rows[i]["label"] for i in pareto(tps, kls) if rows[i]["kind"] != "drop"}
    result = {"model": str(a.model), "preset": a.preset, "wq": str(wq), "wr": str(wr), "threads": a.threads,
              "latency": lat.to_dict(), "budget_ms": budget, "stability": stab,
              "calibration": {t: {"chosen": r.policy.to_dict(),
                                  "frontier": [r.evaluations[i].label for i in r.frontier],
                                  "evaluations": [e.to_dict() for e in r.evaluations]} for t, r in runs.items()},
              "proof": rows, "measured_frontier": sorted(front), "seconds": round(time.time() - t_start),
              "command": "python bench/bench_umia.py " + " ".join(sys.argv[1:])}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"umia-{name}.json").write_text(json.dumps(result, indent=2))
    (OUT / f"umia-{name}.md").write_text(to_markdown(result, lat, runs))
    plot(result, OUT / f"umia-{name}.png")
    print((OUT / f"umia-{name}.md").read_text())
    return 0


def _choice(res: CalibrationResult, mode: str) -> Policy:
    """The calibration's choice under the budget, or the knee of its (fixed + UMIA) frontier."""
    if mode == "budget":
        return res.policy
    ev = res.evaluations
    i = choose([e.predicted_ms for e in ev], [e.kl_mean for e in ev], None,
               [j for j, e in enumerate(ev) if e.kind != "drop"])
    return ev[i].policy


def to_markdown(r: dict[str, Any], lat: LatencyModel, runs: dict[str, CalibrationResult]) -> str:
    lines = [f"# UMIA vs fixed r vs drop: {Path(r['model']).name}, preset {r['preset']}, {r['threads']} threads",
             "", f"`{r['command']}` ({r['seconds']} s)", "", "## Latency model (this machine)", "", "```",
             lat.table(), "```", "",
             "## Proof: held-out KL (text B) vs measured decode speed", "",
             "| policy | kind | critical slots/token | decode tok/s (measured) | predicted ms/token | KL mean | KL p99 "
             "| top-1 same | on measured frontier |", "|---|---|---|---|---|---|---|---|---|"]
    for row in sorted(r["proof"], key=lambda x: -x["decode_tps"]):
        lines.append(f"| {row['label']} | {row['kind']} | {row['critical_per_token']:.2f} | {row['decode_tps']:.2f} "
                     f"| {row['predicted_ms']:.2f} | {row['kl_mean']:.5f} | {row['kl_p99']:.4f} | "
                     f"{row['top1_same']:.3f} | {'yes' if row['label'] in r['measured_frontier'] else ''} |")
    lines += ["", f"## Stability (budget = predicted cost of fixed r = 2: {r['budget_ms']:.2f} ms/token)", "",
              "| choice | text A | text B | theta moved (0.01 steps) | alpha moved (0.01 steps) |",
              "|---|---|---|---|---|"]
    for s in r["stability"]:
        lines.append(f"| {s['choice']} | {s['A']} | {s['B']} | {s['theta_steps']} | {s['alpha_steps']} |")
    lines += ["", "## Calibration on text A (budget)", "", runs["A-budget"].table(), ""]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415  (optional dependency: the bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415  (optional dependency: the bench extra)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, (m, c, name) in {"fixed": ("s", "tab:blue", "fixed r"), "umia": ("o", "tab:orange", "UMIA"),
                               "drop": ("x", "tab:red", "drop non-critical")}.items():
        pts = [x for x in r["proof"] if x["kind"] == kind]
        ax.scatter([x["decode_tps"] for x in pts], [x["kl_mean"] for x in pts], marker=m, color=c, label=name)
        if kind != "umia":
            for x in pts:
                ax.annotate(x["label"], (x["decode_tps"], x["kl_mean"]), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("decode tokens/s (measured)")
    ax.set_ylabel("KL to F16 on held-out text (mean)")
    ax.set_title(f"UMIA vs fixed r: {Path(r['model']).name}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
