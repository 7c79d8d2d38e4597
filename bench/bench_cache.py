#!/usr/bin/env python3
"""Expert caching, trace-driven: static, lru, moepic and rapidmoe replayed over real routing, priced by the planner's
cost model (rapidmoe.placement.cost) for machine profiles.

1. Traces: the trained tiny-moe-a (real routing) and a synthetic model (random routers) each run over a calibration
   text and an evaluation text with `Llama(trace=...)` (every layer routes every token: logits_all).
2. Own shape: every policy replays the evaluation trace at budgets of 1/16 .. 1/2 of each layer's experts (static
   and rapidmoe start from the calibration trace's frequencies; moepic's per-layer split and budget come from its
   fixed point over the calibration hit-rate curves): hit rate, experts copied per token.
3. Runtime vs simulator (measured): tiny-moe-a decodes --runtime-tokens tokens one per step with its WQ cache on a
   local rpc-server under the runtime's static, rapidmoe and lru policies, recording a trace; the runtime's hits, slots,
   swaps and bytes copied are compared with the simulator's replay of that trace.
4. Projections: the tiny-moe-a statistics (per-layer popularity, token-to-token reuse beyond chance, next-layer
   prediction accuracy) are mapped onto DeepSeek-V3 and Qwen3-235B-A22B shapes (cache.routing.scale_routing),
   and each scheme is priced on the 24gb and 48gb machine profiles with the GPU memory the planner leaves for
   experts: decode (one token per step) and prefill (512-token steps) tok/s, hit rate and bytes moved per token,
   against stock llama.cpp's `-ot exps=CPU` (all experts on the CPU, Q4_K_M-like, serial).

Usage: python bench/bench_cache.py [--tokens 2048] [--synthetic-size small] [--runtime-tokens 256] [--name cache]
Writes bench/out/<name>.{md,json} (copy to bench/results/ to publish) and the traces under bench/out/traces/.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rapidmoe.placement import ExpertFrequency, get_shape_set, plan
from rapidmoe.placement.cache import (
    ExpertCacheConfig,
    LRUCache,
    MoEpicCache,
    MoEpicConfig,
    MoEpicSettings,
    RapidMoECache,
    RefreshSettings,
    ReplayPolicy,
    StaticCache,
    hit_curve,
    moe_layers_of,
    moepic_config,
    plan_moepic,
    replay,
    routing_stats,
    scale_routing,
    wq_expert_bytes,
)
from rapidmoe.placement.cost import CostModel, ModelCosts
from rapidmoe.placement.machine import MACHINES
from rapidmoe.placement.tensors import read_gguf_shapes
from rapidmoe.resplit.presets import get_preset
from rapidmoe.trace import read_trace

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
SHARED = ROOT.parent / "shared" / "models" / "tiny-moe-a"
sys.path.insert(0, str(ROOT / "bench"))
from common import ensure_synthetic  # noqa: E402

FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 1 / 2)
R_CRITICAL = 2  # RESplit's critical slots per token (Llama's default n_critical) for static / rapidmoe


def record(model: Path, text: Path, out: Path, n_tokens: int, chunk: int = 256, threads: int = 2) -> Path:
    """A trace of n_tokens of `text` in independent chunks (the context reset between them)."""
    from rapidmoe import Llama  # noqa: PLC0415  (compiled part, loaded on first use)

    if out.exists():
        return out
    llm = Llama(model, n_ctx=chunk, n_batch=chunk, n_ubatch=chunk, logits_all=True, verbose=False, n_threads=threads,
                n_threads_batch=threads, trace=out)
    toks = llm.tokenize(text.read_text(encoding="utf-8", errors="replace").encode())
    if len(toks) < n_tokens:
        raise SystemExit(f"{text} has {len(toks)} tokens, fewer than --tokens {n_tokens}")
    for i in range(0, n_tokens, chunk):
        llm.reset()
        llm.eval(toks[i:i + chunk])
    llm.close()
    return out


def policies_for(ids_cal: np.ndarray, n_expert: int, capacity: list[int], eb: float, cost: CostModel,
                 pred_acc: np.ndarray) -> tuple[dict[str, ReplayPolicy], MoEpicConfig]:
    """The four policies at a per-layer capacity (experts), all set up from the calibration routing."""
    n_moe = ids_cal.shape[1]
    counts = np.stack([np.bincount(ids_cal[:, m][ids_cal[:, m] >= 0], minlength=n_expert) for m in range(n_moe)])
    static = [set(np.argsort(-counts[m], kind="stable")[: capacity[m]].tolist()) for m in range(n_moe)]
    share = counts / np.maximum(1, counts.sum(axis=1, keepdims=True))
    k = ids_cal.shape[2]
    cfg = moepic_config([hit_curve(c) for c in counts], float(sum(capacity)) * eb, n_expert=n_expert, k=k,
                        expert_bytes=eb, pcie_bw=cost.machine.pcie_bw, windows_s=[cost.window_s(k, k)] * n_moe,
                        accuracy=[float(a) if np.isfinite(a) else 0.0 for a in pred_acc])
    return {
        "static": StaticCache(static),
        "lru": LRUCache(capacity, eb),
        "moepic": MoEpicCache(cfg.capacity, cfg.splits, eb),
        "rapidmoe": RapidMoECache(static, n_expert, eb, prior=share),
    }, cfg


def own_shape(name: str, model: Path, cal: Path, ev: Path) -> dict[str, Any]:
    """Hit rates and experts copied per token at fractions of each layer's experts, on the model's own shape."""
    tc, te = read_trace(cal), read_trace(ev)
    ids_cal, _ = tc.token_matrix()
    ids, pred = te.token_matrix()
    n_expert, n_moe = te.header.n_expert, te.header.n_moe
    st = routing_stats(ids, n_expert, pred)
    shapes = read_gguf_shapes(model)
    cost = CostModel(MACHINES["24gb"], ModelCosts.of(shapes))
    eb = cost.model.expert_bytes
    rows = []
    for f in FRACTIONS:
        cap = [max(1, round(f * n_expert))] * n_moe
        pols, cfg = policies_for(ids_cal, n_expert, cap, eb, cost, st.accuracy)
        for pname, pol in pols.items():
            r = replay(ids, pol, None, pred=pred if pname == "moepic" else None)
            rows.append({"fraction": f, "capacity": cap[0], "policy": pname, "hit_rate": r.hit_rate,
                         "experts_moved_per_token": r.bytes_per_token / eb,
                         "layer_hit_rates": r.layer_hit_rates(),
                         **({"moepic_capacity": cfg.capacity, "moepic_split": cfg.splits}
                            if pname == "moepic" else {})})
    return {"name": name, "model": str(model), "n_moe": n_moe, "n_expert": n_expert, "k": te.header.k,
            "eval_tokens": te.n_tokens, "calib_tokens": tc.n_tokens,
            "reuse": st.reuse.tolist(), "excess_reuse": st.excess_reuse.tolist(),
            "prediction_accuracy": [None if not np.isfinite(a) else float(a) for a in st.accuracy],
            "rows": rows}


def project(cal: Path, ev: Path, shape_name: str, machine_name: str, n_decode: int, n_prefill: int,
            seed: int = 0) -> dict[str, Any]:
    machine = MACHINES[machine_name]
    model = get_shape_set(shape_name).model_shapes()
    layers, n_expert, k = model.moe_layers, model.n_expert, model.n_expert_used
    n_moe = len(layers)
    tc, te = read_trace(cal), read_trace(ev)
    st_cal = routing_stats(tc.token_matrix()[0], tc.header.n_expert, tc.token_matrix()[1])
    ids_e, pred_e = te.token_matrix()
    st_ev = routing_stats(ids_e, te.header.n_expert, pred_e)
    big_cal, _ = scale_routing(st_cal, n_tokens=2048, n_moe=n_moe, n_expert=n_expert, k=k, seed=seed)
    n_ev = max(n_decode, n_prefill)
    big, big_pred = scale_routing(st_ev, n_tokens=n_ev, n_moe=n_moe, n_expert=n_expert, k=k, seed=seed + 1)
    counts = np.stack([np.bincount(big_cal[:, m].reshape(-1), minlength=n_expert) for m in range(n_moe)])
    freq = ExpertFrequency.from_counts({il: counts[i] for i, il in enumerate(layers)}, "tiny-moe-a calibration, mapped")
    preset = get_preset("paper")
    p_res = plan(model, "resplit", preset=preset, gpu_mem=machine.gpu_mem, frequency=freq)
    p_q4 = plan(model, "cpu-offload", gpu_mem=machine.gpu_mem, frequency=freq)
    c_res = CostModel(machine, ModelCosts.of(model, preset))
    c_q4 = CostModel(machine, ModelCosts.of(model))
    q4_free = max(0, machine.gpu_mem - p_q4.vram)  # the experts' share of the GPU once the rest is placed
    eb_q4 = c_q4.model.expert_bytes
    cap_lru = [int(q4_free // eb_q4 // n_moe)] * n_moe
    static_sets = [set(p_res.cached.get(il, ())) for il in layers]
    share = counts / counts.sum(axis=1, keepdims=True)
    acc = [float(st_ev.accuracy[m * st_ev.accuracy.size // n_moe]) for m in range(n_moe)]
    acc = [a if np.isfinite(a) else 0.0 for a in acc]
    cfg = moepic_config([hit_curve(c) for c in counts], float(q4_free), n_expert=n_expert, k=k, expert_bytes=eb_q4,
                        pcie_bw=machine.pcie_bw, windows_s=[c_q4.window_s(k, k)] * n_moe, accuracy=acc)
    schemes: dict[str, tuple[Callable[[], ReplayPolicy], CostModel, dict[str, Any]]] = {
        "stock -ot exps=CPU": (lambda: StaticCache([set()] * n_moe), c_q4, {"overlap": False}),
        "static": (lambda: StaticCache(static_sets), c_res, {"r_critical": R_CRITICAL}),
        "lru": (lambda: LRUCache(cap_lru, eb_q4), c_q4, {}),
        "moepic": (lambda: MoEpicCache(cfg.capacity, cfg.splits, eb_q4), c_q4, {"pred": big_pred}),
        "rapidmoe": (lambda: RapidMoECache(static_sets, n_expert, c_res.model.expert_bytes, prior=share), c_res,
                     {"r_critical": R_CRITICAL}),
    }
    out = []
    for name, (make, cost, kw) in schemes.items():
        dec = replay(big[:n_decode], make(), cost, batch=1,
                     **{**kw, "pred": kw["pred"][:n_decode]} if "pred" in kw else kw)
        pre = replay(big[:n_prefill], make(), cost, batch=512,
                     **{**kw, "pred": kw["pred"][:n_prefill]} if "pred" in kw else kw)
        out.append({"scheme": name, "form": cost.model.form, "hit_rate": dec.hit_rate,
                    "bytes_per_token_decode": dec.bytes_per_token, "bytes_per_token_prefill": pre.bytes_per_token,
                    "decode_tok_s": dec.tok_s, "prefill_tok_s": pre.tok_s, "prefill_hit_rate": pre.hit_rate})
    return {"shape": shape_name, "machine": machine.to_dict(), "resplit_vram": p_res.vram,
            "resplit_experts_cached": p_res.experts_on_gpu, "resplit_planned_hit_rate": p_res.hit_rate,
            "q4_vram_without_experts": p_q4.vram, "q4_expert_budget": q4_free, "lru_capacity": cap_lru[0],
            "moepic_capacity": cfg.capacity, "moepic_split": [round(s, 3) for s in cfg.splits],
            "n_moe": n_moe, "n_expert": n_expert, "k": k, "results": out}


def runtime_check(model: Path, cal: Path, text: Path, n_tokens: int, fraction: float = 0.25) -> dict[str, Any]:
    """The runtime policies (static, rapidmoe, lru) on the RPC stand-in against the simulator: the model decodes
    n_tokens of `text` one token per step with its WQ cache on a local rpc-server, recording a trace; the trace is
    replayed through the same policy with the run's own steps; hits, slots, swaps and bytes copied are compared."""
    from rapidmoe import Llama  # noqa: PLC0415  (compiled part, loaded on first use)
    from rapidmoe.rpc import RPCServer  # noqa: PLC0415  (compiled part, loaded on first use)

    layers = moe_layers_of(model)
    tc = read_trace(cal)
    n_expert, k = tc.header.n_expert, tc.header.k
    counts = tc.counts()
    cap = max(1, round(fraction * n_expert))
    initial = {il: sorted(np.argsort(-counts[m], kind="stable")[:cap].tolist()) for m, il in enumerate(layers)}
    eb = wq_expert_bytes(model, layers)
    settings = RefreshSettings()
    # moepic with the same device memory as the others' caches: its fixed point (the 24gb profile's link and
    # windows, the calibration trace's hit-rate curves and prediction accuracy) picks each layer's split and tops;
    # "moepic-half" fixes split 0.5 and spends the budget on twice the tops (what the split buys on a faster link)
    ids_cal, pred_cal = tc.token_matrix()
    acc = routing_stats(ids_cal, n_expert, pred_cal).accuracy
    cost = CostModel(MACHINES["24gb"], ModelCosts.of(read_gguf_shapes(model)))
    cfg = plan_moepic(counts, float(cap * len(layers) * eb[layers[0]]), expert_bytes=float(eb[layers[0]]), k=k,
                      cost=cost, accuracy=list(acc))
    moepic = {"moepic": MoEpicSettings.from_config(cfg), "moepic-half": MoEpicSettings(0.5, 2 * cap)}
    out: dict[str, Any] = {
        "model": str(model), "tokens": n_tokens, "cached_per_layer": cap, "n_expert": n_expert, "policies": [],
        "moepic_fixed_point": {"splits": cfg.splits, "capacity": cfg.capacity, "budgets": cfg.budgets}}
    with RPCServer(threads=1) as srv:
        # "-sync": the same policy with every batch of copies waited for as soon as it is queued (no transfer queue
        # overlap): the compute's wait for copies with and without the queue
        for run in ("static", "rapidmoe", "lru", *moepic, "lru-sync", "moepic-half-sync"):
            policy = run.removesuffix("-sync")
            tpath = OUT / "traces" / f"runtime-{run}.trace"
            t0 = time.time()
            device, queued = srv.device.buffer_type, not run.endswith("-sync")
            config = (ExpertCacheConfig(device=device, policy="moepic", moepic=moepic[policy], async_copies=queued)
                      if policy in moepic else
                      ExpertCacheConfig(experts=initial, device=device, policy=policy,
                                        refresh=settings if policy == "rapidmoe" else None, async_copies=queued))
            llm = Llama(model, n_ctx=n_tokens + 8, verbose=False, n_threads=1, rpc_servers=[srv.endpoint],
                        n_gpu_layers=-1, override_tensor="exps=CPU", expert_cache=config, trace=tpath)
            toks = llm.tokenize(text.read_text(encoding="utf-8", errors="replace").encode())[:n_tokens]
            for t in toks:
                llm.eval([t])
            cache = llm.expert_cache
            assert cache is not None
            st = cache.stats()
            ref = cache.refresh_stats() if policy == "rapidmoe" else None
            copies = sum(cache.copies().values())
            moved = cache.bytes()
            waited = sum(cache.wait_us().values())
            ml = cache.moepic if policy in moepic else None
            llm.close()
            wall = time.time() - t0
            tr = read_trace(tpath)
            ids, pred = tr.token_matrix()
            sets = [set(initial[il]) for il in layers]
            sim: Any = StaticCache(sets)
            if policy == "rapidmoe":
                sim = RapidMoECache(sets, n_expert, float(eb[layers[0]]), half_life_tokens=settings.half_life_tokens,
                                    copies_per_step=settings.copies_per_step, margin=settings.margin)
            elif policy == "lru":
                sim = LRUCache([cap] * len(layers), float(eb[layers[0]]), initial=[initial[il] for il in layers],
                               overflow_on_cpu=True)
            elif ml is not None:
                sim = MoEpicCache([m.capacity for m in ml], [m.split for m in ml], float(eb[layers[0]]),
                                  work_slots=[m.work_slots for m in ml])
            r = replay(ids, sim, pred=pred if ml is not None else None, steps=[s.n_tokens for s in tr.steps])
            runtime_bytes = (ref.bytes_moved if ref else
                             sum(d + p for d, p in moved.values()) if ml is not None else copies * eb[layers[0]])
            out["policies"].append({
                "policy": run, "copy_wait_ms_per_token": waited / 1e3 / n_tokens, "runtime_hits": st.hits,
                "runtime_slots": st.slots, "runtime_hit_rate": st.hit_rate,
                "replay_hits": r.hits, "replay_slots": r.slots, "replay_hit_rate": r.hit_rate,
                "runtime_swaps": ref.swaps if ref else copies,
                "replay_swaps": getattr(sim, "swaps", round(r.bytes_moved / eb[layers[0]])),
                "runtime_bytes": runtime_bytes, "replay_bytes": r.bytes_moved,
                "runtime_bytes_ahead": sum(p for _, p in moved.values()),
                "runtime_layer_hits": [x.hits for x in st.layers], "replay_layer_hits": r.layer_hits,
                "device_bytes": (cap * len(layers) * eb[layers[0]] if ml is None else
                                 sum(m.capacity * m.top_bytes for m in ml)),
                "work_area_bytes": 0 if ml is None else sum(m.work_slots * m.expert_bytes for m in ml),
                **({"moepic_split": [m.split for m in ml], "moepic_capacity": [m.capacity for m in ml]}
                   if ml is not None else {}),
                "wall_s": wall})
    return out


def fmt_runtime(d: dict[str, Any]) -> str:
    lines = [f"{d['tokens']} tokens of the evaluation text decoded one per step by {Path(d['model']).name}, "
             f"{d['cached_per_layer']} of {d['n_expert']} experts per layer cached on a local rpc-server (initially "
             "the calibration trace's hottest), stacked experts in CPU memory. Counters of the run against the "
             "simulator's replay of the trace the same run recorded (same steps):", "",
             "| policy | hits runtime / replay | slots runtime / replay | hit rate | experts copied runtime / replay | "
             "bytes copied runtime / replay | of which ahead | MB/token | cache MB (+ work area) | "
             "copy wait ms/token | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in d["policies"]:
        swaps = "-" if p["policy"].startswith("moepic") else f"{p['runtime_swaps']} / {p['replay_swaps']}"
        lines.append(f"| {p['policy']} | {p['runtime_hits']} / {p['replay_hits']} | {p['runtime_slots']} / "
                     f"{p['replay_slots']} | {p['runtime_hit_rate']:.1%} | {swaps} | "
                     f"{p['runtime_bytes']} / {p['replay_bytes']:.0f} | {p.get('runtime_bytes_ahead', 0)} | "
                     f"{p['runtime_bytes'] / d['tokens'] / 1e6:.2f} | {p.get('device_bytes', 0) / 1e6:.1f}"
                     + (f" (+ {p['work_area_bytes'] / 1e6:.1f})" if p.get("work_area_bytes") else "")
                     + f" | {p.get('copy_wait_ms_per_token', 0):.3f} | {p['wall_s']:.1f} |")
    fp = d.get("moepic_fixed_point")
    if fp:
        lines += ["", "moepic's fixed point for this budget (24gb profile: PCIe 25 GB/s against a window of one "
                  f"layer's compute): split per layer {', '.join(f'{x:.2f}' for x in fp['splits'])}, tops per layer "
                  f"{', '.join(str(c) for c in fp['capacity'])}. moepic-half: split 0.5, twice the tops, same memory. "
                  "moepic's work area (top-k experts per layer, rebuilt each step) is device memory beside the cache. "
                  "-sync: the same policy with each batch of copies waited for as soon as it is queued (no overlap "
                  "through the transfer queue); copy wait: time the computing thread waited for copies. On the RPC "
                  "stand-in the 'device' shares this machine's two cores: neither speed says what a GPU does."]
    return "\n".join(lines)


def fmt_own(d: dict[str, Any]) -> str:
    lines = [f"### {d['name']} ({d['n_moe']} MoE layers x {d['n_expert']} experts, top-{d['k']}; "
             f"calibration {d['calib_tokens']} tokens, evaluation {d['eval_tokens']} tokens)", "",
             "Reuse (share of a token's experts the previous token used), per layer: "
             + " ".join(f"{x:.2f}" for x in d["reuse"]) + "; beyond chance: "
             + " ".join(f"{x:.2f}" for x in d["excess_reuse"]) + ". Next-layer prediction accuracy: "
             + " ".join("-" if a is None else f"{a:.2f}" for a in d["prediction_accuracy"]) + ".", "",
             "| experts cached per layer | policy | hit rate | experts copied per token |", "|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['capacity']} / {d['n_expert']} | {r['policy']} | {r['hit_rate']:.1%} | "
                     f"{r['experts_moved_per_token']:.2f} |")
    return "\n".join(lines)


def fmt_proj(d: dict[str, Any]) -> str:
    gib = 1 << 30
    m = d["machine"]
    lines = [f"### {d['shape']} on {m['name']} ({m['gpu_mem'] / gib:.0f} GiB GPU, PCIe {m['pcie_bw'] / 1e9:.0f} GB/s, "
             f"CPU {m['cpu_bw'] / 1e9:.0f} GB/s)", "",
             f"RESplit (paper preset) caches {d['resplit_experts_cached']} of {d['n_moe'] * d['n_expert']} WQ experts "
             f"(planned hit rate {d['resplit_planned_hit_rate']:.1%}); Q4_K_M-like: "
             f"{d['q4_expert_budget'] / gib:.1f} GiB left for experts after the rest "
             f"({d['q4_vram_without_experts'] / gib:.1f} GiB): lru {d['lru_capacity']} "
             f"experts per layer, moepic tops per layer {min(d['moepic_capacity'])}-{max(d['moepic_capacity'])} at "
             f"split {min(d['moepic_split']):.2f}-{max(d['moepic_split']):.2f}.", "",
             "| scheme | expert form | hit rate (decode) | MB moved/token decode | decode tok/s | prefill tok/s |",
             "|---|---|---|---|---|---|"]
    for r in d["results"]:
        lines.append(f"| {r['scheme']} | {r['form']} | {r['hit_rate']:.1%} | {r['bytes_per_token_decode'] / 1e6:.1f} | "
                     f"{r['decode_tok_s']:.2f} | {r['prefill_tok_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=SHARED / "model-f16.gguf")
    ap.add_argument("--calib-text", type=Path, default=SHARED / "calib.txt")
    ap.add_argument("--eval-text", type=Path, default=SHARED / "eval.txt")
    ap.add_argument("--synthetic-size", default="small", help="synthetic qwen3moe size for the second trace pair")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per trace")
    ap.add_argument("--decode-tokens", type=int, default=256, help="mapped tokens replayed for decode projections")
    ap.add_argument("--prefill-tokens", type=int, default=1024, help="mapped tokens replayed for prefill projections")
    ap.add_argument("--runtime-tokens", type=int, default=256, help="tokens decoded for the RPC runtime check")
    ap.add_argument("--name", default="cache")
    ap.add_argument("--runtime-only", action="store_true",
                    help="only the runtime-vs-simulator check on tiny-moe-a (writes <name>-runtime.{md,json})")
    a = ap.parse_args()

    t0 = time.time()
    tdir = OUT / "traces"
    tdir.mkdir(parents=True, exist_ok=True)
    if a.runtime_only:
        cal = record(a.model, a.calib_text, tdir / f"tiny-moe-a-calib-{a.tokens}.trace", a.tokens)
        rt = runtime_check(a.model, cal, a.eval_text, a.runtime_tokens)
        cmd = ("python bench/bench_cache.py " + " ".join(sys.argv[1:])).strip()
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"{a.name}-runtime.json").write_text(json.dumps({"command": cmd, **rt}, indent=1) + "\n")
        (OUT / f"{a.name}-runtime.md").write_text(
            f"# Expert-cache policies at run time vs the simulator (RPC stand-in, measured)\n\n`{cmd}` "
            f"({time.time() - t0:.0f} s on this machine)\n\n" + fmt_runtime(rt) + "\n")
        print(f"wrote {OUT / (a.name + '-runtime.md')} ({time.time() - t0:.0f} s)")
        return
    syn = ensure_synthetic(OUT / f"synthetic-qwen3moe-{a.synthetic_size}.gguf", "qwen3moe", a.synthetic_size)
    pairs = {}
    for name, model in (("tiny-moe-a", a.model), (f"synthetic qwen3moe {a.synthetic_size}", syn)):
        stem = name.replace(" ", "-")
        cal = record(model, a.calib_text, tdir / f"{stem}-calib-{a.tokens}.trace", a.tokens)
        ev = record(model, a.eval_text, tdir / f"{stem}-eval-{a.tokens}.trace", a.tokens)
        pairs[name] = (model, cal, ev)
        print(f"traces of {name}: {cal}, {ev} ({time.time() - t0:.0f} s)", flush=True)
    own = [own_shape(n, m, c, e) for n, (m, c, e) in pairs.items()]
    print(f"own-shape replays done ({time.time() - t0:.0f} s)", flush=True)
    rt = runtime_check(a.model, pairs["tiny-moe-a"][1], a.eval_text, a.runtime_tokens)
    print(f"runtime check on the RPC stand-in done ({time.time() - t0:.0f} s)", flush=True)
    _, cal, ev = pairs["tiny-moe-a"]
    proj = []
    for shape in ("deepseek-v3", "qwen3-235b-a22b"):
        for mach in ("24gb", "48gb"):
            proj.append(project(cal, ev, shape, mach, a.decode_tokens, a.prefill_tokens))
            print(f"projection {shape} {mach} ({time.time() - t0:.0f} s)", flush=True)
    cmd = "python bench/bench_cache.py " + " ".join(sys.argv[1:])
    doc = {"command": cmd.strip(), "tokens": a.tokens, "r_critical": R_CRITICAL, "own_shape": own, "runtime": rt,
           "projections": proj, "seconds": time.time() - t0}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{a.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = [f"# Expert caching: trace replay and projections\n\n`{cmd.strip()}` "
          f"({doc['seconds']:.0f} s on this machine)\n",
          "## Hit rates on the traced models' own shapes (measured routing, replayed)\n",
          *[fmt_own(d) + "\n" for d in own],
          "## The runtime policies on the RPC stand-in vs the simulator (tiny-moe-a, measured)\n",
          fmt_runtime(rt) + "\n",
          "## Projections for DeepSeek-V3 and Qwen3-235B-A22B (mapped routing, modelled machines)\n",
          "PROJECTIONS, not measurements: routing is tiny-moe-a's per-layer statistics mapped onto the shape "
          "(cache.routing.scale_routing), times come from the planner's cost model (placement/cost.py) with the "
          "machine profiles of placement/machine.py (datasheet figures, assumed efficiencies). "
          f"static and rapidmoe run RESplit's WQ (paper preset) with r = {R_CRITICAL} critical slots per token on "
          "the CPU; lru, moepic and the stock baseline use a Q4_K_M-like model.\n",
          *[fmt_proj(d) + "\n" for d in proj]]
    (OUT / f"{a.name}.md").write_text("\n".join(md))
    print(f"wrote {OUT / (a.name + '.md')} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
