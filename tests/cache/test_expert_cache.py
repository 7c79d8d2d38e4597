"""The per-expert WQ cache on a device (llama.cpp's RPC stand-in here): routed experts stacked in CPU memory, some
experts of each MoE layer copied to the device. Every slot takes exactly one backend's value, and the stand-in runs
the same CPU kernels, so the logits must EQUAL the plain-layout all-CPU run's, for a plain model and a RESplit pair
(the sidecar's residuals added on top of the cache's WQ; Q2_K experts, compared with one CPU kernel per quant type,
and with the default kernels different only where tests/cache_reference.py says); the hit counters must match a
count made in numpy from the router's probabilities; bad requests are refused with one clear line."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cache_reference import PlainLlama, eval_runs, expert_shape, prompt_tokens, run_logits, without_tiled
from testkit import EXACT_PRESET

from rapidmoe import Llama, RapidMoEError
from rapidmoe._runtime import _core
from rapidmoe.cache import ExpertCacheConfig
from rapidmoe.ggufio import GGUFFile
from rapidmoe.placement.cache.moepic import moe_layers_of
from rapidmoe.rpc import RPCServer


def _on_device(rpc: RPCServer, cache: dict[int, list[int]]) -> dict[str, Any]:
    """Llama arguments: experts stacked in CPU memory, everything else and the cache on the stand-in."""
    return {"rpc_servers": [rpc.endpoint], "n_gpu_layers": -1, "override_tensor": "exps=CPU",
            "expert_cache": ExpertCacheConfig(experts=cache, device=rpc.device.buffer_type)}


def _run(path: Path, toks: list[int], where: tuple[str, ...] = (), capture: list[str] | None = None, **kw):  # type: ignore[no-untyped-def]
    """Logits of every position, the cache's counters (None without a cache), where the named tensors are, and
    the captured graph tensors."""
    names = capture or []
    cap = _core.TensorCapture(names) if names else None
    llm = Llama(path, n_ctx=128, logits_all=True, verbose=False, n_threads=2, eval_callback=cap, **kw)
    try:
        llm.eval(toks)
        logits = np.array(llm.scores[: len(toks)], dtype=np.float32)
        stats = llm.expert_cache.stats() if llm.expert_cache is not None else None
        got = {n: cap.get(n) for n in names} if cap is not None else {}
        return logits, stats, {n: llm.tensor_buffer(n) for n in where}, got
    finally:
        llm.close()


def _half(layers: list[int], n_expert: int) -> dict[int, list[int]]:
    """A different half of the experts in each layer (so the cache's slot order is not the expert order)."""
    return {il: sorted(range(n_expert), key=lambda e: (e * 5 + il) % n_expert)[: n_expert // 2][::-1] for il in layers}


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_plain_model_equals_the_cpu_run(arch: str, make_tiny, rpc: RPCServer) -> None:  # type: ignore[no-untyped-def]
    path = make_tiny(arch)
    toks = prompt_tokens(path)
    n_expert, k = expert_shape(path)
    layers = moe_layers_of(path)
    il = layers[0]
    names = tuple(f"blk.{il}.ffn_{p}_exps.{s}" for p in ("up", "gate", "down") for s in ("cache", "weight"))
    cpu, _, _, _ = _run(path, toks)
    dev, stats, where, _ = _run(path, toks, where=names, **_on_device(rpc, _half(layers, n_expert)))
    buft = rpc.device.buffer_type
    assert all(where[n] == buft for n in names if n.endswith(".cache")), where
    assert all(where[n].startswith("CPU") for n in names if n.endswith(".weight")), where  # stacked: host memory
    assert where[names[1]] == "CPU" or where[names[1]] == "CPU_Mapped", where  # plain layout, not CPU_REPACK
    print(f"{arch}: max |dev - cpu| {np.abs(dev - cpu).max()}, hit rate {stats.hit_rate:.3f}")
    assert np.array_equal(dev, cpu)
    assert [s.layer for s in stats.layers] == layers
    assert stats.slots == len(toks) * k * len(layers)
    assert 0 < stats.hits < stats.slots


def _layer_names(path: Path) -> list[str]:
    """The graph tensors compared at every layer: each MoE layer's composed WQ results (+ residuals) and its
    output, and every layer's output."""
    f = GGUFFile(path)
    n_layer = int(f.get(f"{f.get('general.architecture')}.block_count"))
    moe = [f"{n}-{il}" for il in moe_layers_of(path) for n in ("ffn_moe_gate", "ffn_moe_down", "ffn_moe_out")]
    return moe + [f"l_out-{il}" for il in range(n_layer)]


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_resplit_pair_equals_the_cpu_run(arch: str, make_split) -> None:  # type: ignore[no-untyped-def]
    """WQ from the cache or the CPU, residuals from the sidecar (CPU memory) on top: at r = 0, 1, k, and with the
    residual work overlapped, over a prompt and 3 decode steps, the logits and every layer's composed expert
    results equal the plain-layout all-CPU run bit for bit, with one CPU kernel per quant type
    (tests/cache_reference.py says why the tiled one is off)."""
    _, wq, wr = make_split(arch, EXACT_PRESET)
    toks = prompt_tokens(wq)
    n_expert, k = expert_shape(wq)
    names = _layer_names(wq)
    cache = _half(moe_layers_of(wq), n_expert)
    cases = [{"residual_path": str(wr), "n_critical": r} for r in (0, 1, k)]
    cases.append({"residual_path": str(wr), "n_critical": 1, "overlap": "on"})
    # the all-CPU references: one per r (the overlapped case's is r = 1's, run once), then the device runs
    refs = [{key: v for key, v in kw.items() if key != "overlap"} for kw in cases]
    plain = [dict(t) for t in dict.fromkeys(tuple(r.items()) for r in refs)]
    runs = [{"plain": True, "capture": names, **r} for r in plain]
    runs += [{"device": True, "expert_cache": cache, "capture": names, **kw} for kw in cases]
    got = without_tiled(eval_runs, str(wq), toks, 3, runs)
    for i, kw in enumerate(cases):
        (cpu, _, _, cpu_t), (dev, stats, _, dev_t) = got[plain.index(refs[i])], got[len(plain) + i]
        print(f"{arch} r={kw['n_critical']} {kw.get('overlap', 'auto')}: max |dev - cpu| {np.abs(dev - cpu).max()}, "
              f"hit rate {stats.hit_rate:.3f}")
        assert 0 < stats.hits < stats.slots
        assert np.array_equal(dev, cpu), kw
        for n in names:
            assert len(cpu_t[n]) == len(dev_t[n]) == 4, (kw, n)  # the prompt and 3 decode steps
            assert all(np.array_equal(a, b) for a, b in zip(cpu_t[n], dev_t[n], strict=True)), (kw, n)
    dev_r0, dev_rk = got[len(plain)][0], got[len(plain) + 2][0]
    assert not np.array_equal(dev_r0, dev_rk)  # the sidecar is active: r (0 vs k) changes the result


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_resplit_pair_with_default_kernels_differs_only_in_slot_0(arch: str, make_split,  # type: ignore[no-untyped-def]
                                                                  rpc: RPCServer) -> None:
    """With the CPU's default kernels a cache run differs from the plain all-CPU run only where the tiled kernel's
    batch threshold can tell them apart: at r = 0, in the first MoE layer (the same input in both runs), every slot
    of the composed gate and down is equal bit for bit, except the hit slots of the expert in cache slot 0 (the
    device's matmul parks the misses there: more rows, maybe another kernel), which are within a few ulps. (At
    r > 0 copy-mode down differs elsewhere too: the all-CPU run computes WQ down for the non-critical slots only.)"""
    _, wq, wr = make_split(arch, EXACT_PRESET)
    toks = prompt_tokens(wq)
    n_expert, k = expert_shape(wq)
    il = moe_layers_of(wq)[0]
    cache = _half(moe_layers_of(wq), n_expert)
    names = [f"ffn_moe_topk-{il}", f"ffn_moe_gate-{il}", f"ffn_moe_down-{il}"]
    side = (f"blk.{il}.ffn_up_exps.weight", f"blk.{il}.ffn_up_exps.wr", f"blk.{il}.ffn_up_exps.cache")
    ref = PlainLlama(wq, n_ctx=64, verbose=False, residual_path=wr, override_tensor="exps=CPU")
    try:  # the reference really is in the plain layout (override_tensor="exps=CPU" alone repacks)
        assert ref.tensor_buffer(side[0]) in ("CPU", "CPU_Mapped") and ref.tensor_buffer(side[1]) == "CPU_Mapped"
    finally:
        ref.close()
    _, cpu = run_logits(PlainLlama, str(wq), toks, names, residual_path=wr, n_critical=0, override_tensor="exps=CPU")
    _, _, where, dev = _run(wq, toks, where=side, capture=names, residual_path=wr, n_critical=0,
                            **_on_device(rpc, cache))
    # plain, host memory (the sidecar's plain weights are used in place in its mapping: CPU_Mapped)
    assert where[side[0]] in ("CPU", "CPU_Mapped") and where[side[1]] == "CPU_Mapped", where
    assert where[side[2]] == rpc.device.buffer_type, where
    sel = cpu[names[0]][0].reshape(len(toks), k).astype(int)
    assert np.array_equal(dev[names[0]][0].reshape(len(toks), k), sel)
    slot0 = sel == cache[il][0]  # [T, k]: the slots the device computes with the parked misses beside them
    for n in names[1:]:
        a, b = (x[n][0].reshape(len(toks), k, -1) for x in (cpu, dev))
        assert np.array_equal(a[~slot0], b[~slot0]), n
        ulps = np.abs(a[slot0] - b[slot0]) / np.spacing(np.abs(a[slot0]).max(axis=-1, keepdims=True))
        print(f"{arch} {n}: slot 0's expert, {int(slot0.sum())} slots, up to {ulps.max():.1f} ulps of the row's max")
        assert ulps.max() <= 8, n


def test_hit_counters(make_tiny, rpc: RPCServer) -> None:  # type: ignore[no-untyped-def]
    """All experts cached: rate 1; none: 0; half: the hits a numpy top-k of the router's probabilities gives, and
    the hit slots of the composed gate are the device matmul's values."""
    path = make_tiny("qwen3moe")  # softmax routing: the top-k of ffn_moe_probs are the selected experts
    toks = prompt_tokens(path)
    n_expert, k = expert_shape(path)
    layers = moe_layers_of(path)
    slots = len(toks) * k * len(layers)
    cpu, _, _, _ = _run(path, toks)

    every, stats, _, _ = _run(path, toks, **_on_device(rpc, {il: list(range(n_expert)) for il in layers}))
    assert (stats.hits, stats.slots, stats.hit_rate) == (slots, slots, 1.0)
    assert np.array_equal(every, cpu)
    _, stats, where, _ = _run(path, toks, where=("blk.0.ffn_up_exps.cache",), **_on_device(rpc, {}))
    assert (stats.hits, stats.slots, stats.hit_rate) == (0, slots, 0.0)
    assert where["blk.0.ffn_up_exps.cache"] == ""  # nothing cached, nothing allocated

    cache = _half(layers, n_expert)
    il = layers[0]
    names = [f"ffn_moe_probs-{i}" for i in layers] + [f"rapidmoe_gate_cache-{il}", f"ffn_moe_gate-{il}"]
    _, stats, _, got = _run(path, toks, capture=names, **_on_device(rpc, cache))
    for layer in stats.layers:
        probs = np.concatenate([p.reshape(-1, n_expert) for p in got[f"ffn_moe_probs-{layer.layer}"]])
        selected = np.argsort(-probs, axis=1, kind="stable")[:, :k]  # [T, k]
        want = int(np.isin(selected, cache[layer.layer]).sum())
        assert (layer.hits, layer.slots) == (want, len(toks) * k), layer
    print(f"half: hit rate {stats.hit_rate:.3f} ({stats.hits}/{stats.slots})")
    # hit slots of the layer's gate are the device's values exactly (misses: the CPU's)
    probs = np.concatenate([p.reshape(-1, n_expert) for p in got[f"ffn_moe_probs-{il}"]])
    hit = np.isin(np.argsort(-probs, axis=1, kind="stable")[:, :k], cache[il])  # [T, k]
    dev = np.concatenate([g[0] for g in got[f"rapidmoe_gate_cache-{il}"]])  # [T, k, n_ff]
    gate = np.concatenate([g[0] for g in got[f"ffn_moe_gate-{il}"]])
    assert np.array_equal(gate[hit], dev[hit]) and not np.array_equal(gate[~hit], dev[~hit])


def test_counters_reset(make_tiny, rpc: RPCServer) -> None:  # type: ignore[no-untyped-def]
    path = make_tiny("qwen3moe")
    toks = prompt_tokens(path)
    n_expert, _ = expert_shape(path)
    llm = Llama(path, n_ctx=128, verbose=False, n_threads=2, **_on_device(rpc, _half(moe_layers_of(path), n_expert)))
    try:
        llm.eval(toks)
        assert llm.expert_cache is not None
        first = llm.expert_cache.stats(reset=True)
        assert first.slots > 0
        assert llm.expert_cache.stats().slots == 0
    finally:
        llm.close()


def test_bad_requests_are_refused(make_tiny, rpc: RPCServer) -> None:  # type: ignore[no-untyped-def]
    path = make_tiny("deepseek2")  # layer 0 is dense
    n_expert, _ = expert_shape(path)
    il = moe_layers_of(path)[0]
    dev = _on_device(rpc, {il: [0]})

    def refused(match: str, cache: ExpertCacheConfig | None = None, **kw) -> None:  # type: ignore[no-untyped-def]
        with pytest.raises(RapidMoEError, match=match):
            Llama(path, n_ctx=64, verbose=False, **{**dev, **({"expert_cache": cache} if cache else {}), **kw})

    def on(experts: dict[int, list[int]], device: str | None = rpc.device.buffer_type) -> ExpertCacheConfig:
        return ExpertCacheConfig(experts=experts, device=device)

    refused("layer 99 is out of range", on({99: [0]}))
    refused("layer 0 is not an MoE layer", on({0: [0]}))
    refused(f"expert id {n_expert} is out of range", on({il: [1, n_expert]}))
    refused("expert id 2 is listed twice", on({il: [2, 3, 2]}))
    refused(r"ExpertCacheConfig\.device 'RPC7' is not a known device", on({il: [0]}, "RPC7"))
    refused(r"needs ExpertCacheConfig\.device", on({il: [0]}, None))
    refused("not in plain host memory", override_tensor=None)  # -ngl put the experts on the device
    refused("does not combine", skip_noncritical=True)
    with pytest.raises(RapidMoEError, match="needs experts="):
        ExpertCacheConfig(device="CPU")
    with pytest.raises(TypeError, match=r"takes a rapidmoe\.cache\.ExpertCacheConfig"):  # the mapping of old
        Llama(path, n_ctx=64, verbose=False, expert_cache={il: [0]})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword argument"):  # the expert_cache_* keywords of old
        Llama(path, n_ctx=64, verbose=False, expert_cache_device=rpc.device.buffer_type)
    llm = Llama(path, n_ctx=64, verbose=False)
    try:
        assert llm.expert_cache is None and llm.expert_cache_config is None
    finally:
        llm.close()

