#!/usr/bin/env python3
"""UMIA's latency model with a device: fitted on the device llama.cpp has here, and priced from machine profiles.

1. Measured (`--wq/--wr`, default the bench-size qwen3moe cpu-q8 pair): a local rpc-server as the device (the
   stand-in of a CPU-only machine; `--device CUDA0` on a GPU machine), a per-expert cache of half and of all of
   each layer's experts, serial and concurrent, r = 0, 1, 2, decode and prefill. The device terms are fitted
   (umia/device.py: the CPU worker's and the device's stage times for C and D, the step times for fixed_ms) and
   every run's step time is predicted: serial runs by D + C, concurrent ones by max(D, C).
2. Machine profiles (`--machines`, JSON files or built-in names): the terms for DeepSeek-V3 (paper preset) with the
   planner's cache for the profile's GPU memory, decode and prefill (512-token batches) at r = 0..3, serial vs
   concurrent, and the prefill streaming threshold.

Usage: python bench/bench_umia_device.py [--wq M.wq.gguf --wr M.wr.gguf] [--threads 1] [--reps 2]
                                         [--machines bench/machines/h200.json 24gb] [--skip-measure]
Writes bench/out/umia-device.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rapidmoe.atomic import write_text
from rapidmoe.calibration.measure import measure_device_points
from rapidmoe.umia.device import DevicePoint, fit_stage_terms, points_table
from rapidmoe.umia.profile import profile_report

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
DEFAULT = ROOT / "bench" / "out" / "frontier-work" / "qwen3moe-bench.cpu-q8" / "qwen3moe-bench"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from rapidmoe.rpc import RPCServer  # noqa: PLC0415  (compiled part, loaded on first use)

    with RPCServer(threads=args.threads) as srv:
        points, n_moe, k = measure_device_points(
            args.wq, args.wr, device=srv.device.buffer_type, rpc_servers=[srv.endpoint], threads=args.threads,
            r_values=(0, 1, 2), cache_fractions=(0.5, 1.0), repeats=args.reps, progress=True)
    return fit_all(points, n_moe, k)


def fit_all(points: list[DevicePoint], n_moe: int, k: int) -> dict[str, Any]:
    out: dict[str, Any] = {"n_moe": n_moe, "k": k, "phases": {}}
    for phase in ("decode", "prefill"):
        costs, pts = fit_stage_terms([p for p in points if p.phase == phase], n_moe, k)
        out["phases"][phase] = {"terms": costs.to_dict(), "points": [asdict(p) for p in pts],
                                "table": points_table(pts),
                                "mean_abs_err": sum(abs(p.rel_err) for p in pts) / len(pts),
                                "max_abs_err": max(abs(p.rel_err) for p in pts)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wq", type=Path, default=DEFAULT.with_suffix(".wq.gguf"))
    ap.add_argument("--wr", type=Path, default=DEFAULT.with_suffix(".wr.gguf"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--machines", nargs="+", default=[str(ROOT / "bench" / "machines" / "h200.json"), "24gb"])
    ap.add_argument("--skip-measure", action="store_true")
    ap.add_argument("--refit", type=Path, default=None, help="fit the points of an earlier run's JSON again")
    args = ap.parse_args()
    res: dict[str, Any] = {"command": " ".join(["python", "bench/bench_umia_device.py", *sys.argv[1:]]),
                 "wq": str(args.wq), "wr": str(args.wr), "threads": args.threads, "reps": args.reps}
    if args.refit is not None:
        old = json.loads(args.refit.read_text())
        res.update({k: old[k] for k in ("command", "wq", "wr", "threads", "reps")})
        m = old["measured"]
        pts = [DevicePoint(**{k: v for k, v in p.items() if k != "predicted_ms"})
               for ph in m["phases"].values() for p in ph["points"]]
        res["measured"] = fit_all(pts, m["n_moe"], m["k"])
    elif not args.skip_measure:
        res["measured"] = measure(args)
    res["profiles"] = [profile_report(m, "deepseek-v3", "paper") for m in args.machines]
    OUT.mkdir(parents=True, exist_ok=True)
    write_text(OUT / "umia-device.json", json.dumps(res, indent=1, default=str))
    write_text(OUT / "umia-device.md", to_markdown(res))
    print(to_markdown(res))
    return 0


def to_markdown(res: dict[str, Any]) -> str:
    lines = ["# UMIA's latency model with a device", "", f"`{res['command']}`", ""]
    if "measured" in res:
        m = res["measured"]
        lines += [f"## Fitted on the RPC stand-in ({Path(res['wq']).name} + {Path(res['wr']).name}, "
                  f"{m['n_moe']} MoE layers, top-{m['k']}; {res['threads']} thread(s) each for the rpc-server, this "
                  f"process and the worker; medians of {res['reps']} alternating runs)", ""]
        for phase, ph in m["phases"].items():
            t = ph["terms"]
            lines += [f"### {phase}", "",
                      "Terms (ms per token; per slot and layer for hit/miss/wr; per layer for active/xfer): "
                      + ", ".join(f"{k} {v:.4f}" for k, v in t.items() if v is not None), "",
                      ph["table"], "",
                      f"mean |error| {100 * ph['mean_abs_err']:.1f}%, max {100 * ph['max_abs_err']:.1f}% (the "
                      "stage terms come from the concurrent runs' worker and device times alone; the step times "
                      "fit fixed_ms and the serial schedule's extra hand-over per layer, serial_sync_ms)", ""]
    lines += ["## Priced from machine profiles (DeepSeek-V3, preset paper, the planner's static cache)", ""]
    for p in res["profiles"]:
        lines += [p["markdown"], ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
