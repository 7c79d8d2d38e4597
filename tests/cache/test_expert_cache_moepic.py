"""The moepic policy at run time on the RPC stand-in (MoEpic: experts split vertically, tops of some experts resident,
the rest fetched per ubatch, the next layer's predicted experts assembled ahead), and the transfer queue every policy
copies through. Logits equal the all-CPU run at every step while tops are evicted under a budget smaller than one
layer's experts, with copies overlapped or waited for at once; the runtime's hits, bytes fetched on demand and
ahead equal the simulator's replay (placement.cache.simulator.MoEpicCache) of the trace recorded in the same run."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cache_reference import PlainLlama, step_logits
from testkit import ROOT, repeated_text

from rapidmoe import Llama, RapidMoEError
from rapidmoe.cli.budget import cache_placement
from rapidmoe.placement import GPU
from rapidmoe.placement.cache.config import CachePolicy, ExpertCacheConfig, MoEpicSettings, RefreshSettings
from rapidmoe.placement.cache.moepic import moe_layers_of, moepic_layers, wq_expert_bytes
from rapidmoe.placement.cache.simulator import LRUCache, MoEpicCache, RapidMoECache, ReplayPolicy, replay
from rapidmoe.placement.realize import plan_for_model, realize
from rapidmoe.resplit import convert, get_preset
from rapidmoe.rpc import RPCServer
from rapidmoe.synthetic import spec_for, write_model
from rapidmoe.trace import read_trace

TEXT = repeated_text(3)


def _cpu_steps(path: Path, n: int) -> tuple[list[int], list[int], list[np.ndarray]]:
    cpu = Llama(path, n_ctx=128, verbose=False, n_threads=2)
    toks = cpu.tokenize(TEXT)[:n]
    prompt, rest = toks[:8], toks[8:]
    want = step_logits(cpu, prompt, rest)
    cpu.close()
    return prompt, rest, want


@pytest.mark.parametrize(("arch", "overlap"), [("qwen3moe", True), ("qwen3moe", False), ("deepseek2", True)])
def test_moepic_is_exact_and_matches_the_simulator(make_tiny, rpc: RPCServer, tmp_path: Path, arch: str,  # type: ignore[no-untyped-def]
                                                   overlap: bool) -> None:
    path = make_tiny(arch)
    layers = moe_layers_of(path)
    prompt, rest, want = _cpu_steps(path, 24)
    settings = MoEpicSettings(split=0.5, capacity=3)  # tops of 3 experts: 1.5 experts' bytes of a layer's 8
    trace = tmp_path / "moepic.trace"
    llm = Llama(path, n_ctx=128, verbose=False, n_threads=2, rpc_servers=[rpc.endpoint], n_gpu_layers=-1,
                override_tensor="exps=CPU", trace=trace,
                expert_cache=ExpertCacheConfig(device=rpc.device.buffer_type, policy="moepic", moepic=settings,
                                               async_copies=overlap))
    try:
        got = step_logits(llm, prompt, rest)
        cache = llm.expert_cache
        assert cache is not None
        stats, moved, ml = cache.stats(), cache.bytes(), cache.moepic
        waited = cache.wait_us()
        for name in ("ffn_up_exps.cache", "ffn_down_exps.top"):  # the work area and the resident tops
            assert llm.tensor_buffer(f"blk.{layers[0]}.{name}") == rpc.device.buffer_type
    finally:
        llm.close()
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(a, b), f"step {i}: max |dev - cpu| {np.abs(a - b).max()}"
    k = ml[0].work_slots
    assert all(m.capacity == 3 and 0 < m.n_top < m.n_ff and m.work_slots == k for m in ml)
    assert 3 * ml[0].top_bytes < ml[0].expert_bytes * 8 // 2  # the resident tops: under half a layer's experts

    tr = read_trace(trace)
    ids, pred = tr.token_matrix()
    assert pred is not None
    eb = wq_expert_bytes(path, layers)
    assert all(m.expert_bytes == eb[m.layer] for m in ml)
    sim = MoEpicCache([m.capacity for m in ml], [m.split for m in ml], float(ml[0].expert_bytes),
                      work_slots=[m.work_slots for m in ml])
    res = replay(ids, sim, pred=pred, steps=[s.n_tokens for s in tr.steps])
    # the replay's split bytes, (1 - split) x expert bytes, are the runtime's bottom bytes
    assert ml[0].expert_bytes - ml[0].top_bytes == pytest.approx((1 - ml[0].split) * ml[0].expert_bytes)
    demand = sum(d for d, _ in moved.values())
    ahead = sum(p for _, p in moved.values())
    print(f"{arch} overlap={overlap}: runtime hits {stats.hits}/{stats.slots}, demand {demand} B, ahead {ahead} B; "
          f"replay hits {res.hits}/{res.slots}, {res.bytes_moved:.0f} B")
    assert 0 < stats.hits < stats.slots and ahead > 0 and demand > 0
    assert overlap or sum(waited.values()) > 0  # waited for at once: the copies' time is the compute thread's
    assert [layer.hits for layer in stats.layers] == res.layer_hits
    assert [layer.slots for layer in stats.layers] == res.layer_slots
    assert [sum(moved[il]) for il in layers] == pytest.approx(res.layer_bytes, rel=1e-12)


def test_lru_and_refresh_exact_with_copies_waited_at_once(make_tiny, rpc: RPCServer) -> None:  # type: ignore[no-untyped-def]
    """The queue off (every copy waited for as queued) gives the same logits and counters as the simulator."""
    path = make_tiny("qwen3moe")
    layers = moe_layers_of(path)
    prompt, rest, want = _cpu_steps(path, 16)
    eb = wq_expert_bytes(path, layers)
    for policy in ("lru", "rapidmoe"):
        llm = Llama(path, n_ctx=128, verbose=False, n_threads=2, rpc_servers=[rpc.endpoint], n_gpu_layers=-1,
                    override_tensor="exps=CPU",
                    expert_cache=ExpertCacheConfig(
                        experts={il: [3, 0, 5] for il in layers}, device=rpc.device.buffer_type, policy=policy,
                        refresh=RefreshSettings(4.0, 1, 0.0) if policy == "rapidmoe" else None, async_copies=False))
        try:
            got = step_logits(llm, prompt, rest)
            assert llm.expert_cache is not None
            moved = llm.expert_cache.bytes()
            copies = llm.expert_cache.copies()
        finally:
            llm.close()
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert np.array_equal(a, b), f"{policy} step {i}: max |dev - cpu| {np.abs(a - b).max()}"
        if policy == "lru":
            assert sum(copies.values()) > 0
            assert [moved[il][0] for il in layers] == [copies[il] * eb[il] for il in layers]
    # the simulator twins (LRUCache, RapidMoECache) are compared in test_expert_cache_refresh.py


def test_moepic_refusals(make_tiny, rpc: RPCServer) -> None:  # type: ignore[no-untyped-def]
    path = make_tiny("qwen3moe")
    with pytest.raises(RapidMoEError, match="go together"):
        ExpertCacheConfig(policy="moepic")
    with pytest.raises(RapidMoEError, match="go together"):
        ExpertCacheConfig(experts={1: [0]}, moepic=MoEpicSettings(0.5, 2))
    with pytest.raises(RapidMoEError, match="not experts"):
        ExpertCacheConfig(policy="moepic", experts={1: [0]}, moepic=MoEpicSettings(0.5, 2))
    with pytest.raises(RapidMoEError, match="splits in"):
        MoEpicSettings(1.5, 2)
    with pytest.raises(RapidMoEError, match="MoE layers"):
        Llama(path, verbose=False, rpc_servers=[rpc.endpoint],
              expert_cache=ExpertCacheConfig(device=rpc.device.buffer_type, policy="moepic",
                                             moepic=MoEpicSettings([0.5], 2)))


TINY_MOE_A = ROOT.parent / "shared" / "models" / "tiny-moe-a" / "model-f16.gguf"


@pytest.mark.skipif(not TINY_MOE_A.exists(), reason="the trained tiny-moe-a is not on this machine")
def test_tiny_moe_a_runtime_counters_equal_the_replay(rpc: RPCServer, tmp_path: Path) -> None:
    """Real routing (the trained tiny-moe-a): lru, rapidmoe and moepic on the stand-in, each one's hits and bytes moved
    per layer equal to the simulator's replay of the trace the same run recorded, logits equal to the CPU run."""
    path = TINY_MOE_A
    layers = moe_layers_of(path)
    text = (TINY_MOE_A.parent / "eval.txt").read_bytes()[:4000]
    cpu = Llama(path, n_ctx=128, verbose=False, n_threads=2)
    toks = cpu.tokenize(text)[:24]  # 16 decode steps: enough for evictions and refresh swaps (asserted below)
    prompt, rest = toks[:8], toks[8:]
    want = step_logits(cpu, prompt, rest)
    cpu.close()
    eb = wq_expert_bytes(path, layers)
    initial = {il: [0, 1, 2, 3] for il in layers}
    refresh = RefreshSettings(8.0, 2, 0.25)
    for policy in ("lru", "rapidmoe", "moepic"):
        trace = tmp_path / f"{policy}.trace"
        config = (ExpertCacheConfig(device=rpc.device.buffer_type, policy=policy, moepic=MoEpicSettings(0.5, 8))
                  if policy == "moepic" else
                  ExpertCacheConfig(experts=initial, device=rpc.device.buffer_type, policy=policy,
                                    refresh=refresh if policy == "rapidmoe" else None))
        llm = Llama(path, n_ctx=128, verbose=False, n_threads=2, rpc_servers=[rpc.endpoint], n_gpu_layers=-1,
                    override_tensor="exps=CPU", expert_cache=config, trace=trace)
        try:
            got = step_logits(llm, prompt, rest)
            cache = llm.expert_cache
            assert cache is not None
            stats, moved = cache.stats(), cache.bytes()
            swapped = cache.refresh_stats().bytes_moved if policy == "rapidmoe" else 0
            ml = cache.moepic if policy == "moepic" else None
        finally:
            llm.close()
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert np.array_equal(a, b), f"{policy} step {i}: max |dev - cpu| {np.abs(a - b).max()}"
        tr = read_trace(trace)
        ids, pred = tr.token_matrix()
        e0 = float(eb[layers[0]])
        if policy == "lru":
            sim: ReplayPolicy = LRUCache([4] * len(layers), e0, initial=[initial[il] for il in layers],
                                         overflow_on_cpu=True)
        elif policy == "rapidmoe":
            sim = RapidMoECache([set(initial[il]) for il in layers], tr.header.n_expert, e0,
                                half_life_tokens=refresh.half_life_tokens, copies_per_step=refresh.copies_per_step,
                                margin=refresh.margin)
        else:
            assert ml is not None
            sim = MoEpicCache([m.capacity for m in ml], [m.split for m in ml], e0,
                              work_slots=[m.work_slots for m in ml])
        res = replay(ids, sim, pred=pred if policy == "moepic" else None, steps=[s.n_tokens for s in tr.steps])
        runtime_bytes = [sum(moved[il]) for il in layers]
        print(f"tiny-moe-a {policy}: hits {stats.hits}/{stats.slots} (replay {res.hits}), "
              f"{sum(runtime_bytes) + swapped} B (replay {res.bytes_moved:.0f})")
        assert [layer.hits for layer in stats.layers] == res.layer_hits
        assert [layer.slots for layer in stats.layers] == res.layer_slots
        if policy == "rapidmoe":  # swaps are between steps: the replay adds them to the total, not to a layer
            assert swapped > 0 and swapped == pytest.approx(res.bytes_moved, rel=1e-12)
        else:
            assert sum(runtime_bytes) > 0 and runtime_bytes == pytest.approx(res.layer_bytes, rel=1e-12)


def test_moepic_on_quantized_wq_with_residuals_is_exact(rpc: RPCServer, tmp_path: Path, vocab_dir: Path) -> None:
    """A RESplit pair (Q2_K WQ experts, 256-element blocks) with an intermediate dimension of 512: the top is 256 rows,
    so down's top is the first quantized block of each of its rows (a strided copy), and split routing at r = 1 adds
    the sidecar's residuals to the composed WQ: logits equal the plain-layout all-CPU run's."""
    src = tmp_path / "tiny-ff512.gguf"
    write_model(dataclasses.replace(spec_for("qwen3moe", "tiny", seed=0), n_ff_exp=512), src, vocab_dir)
    res = convert(src, tmp_path / "split", get_preset("cpu-q8"), progress=False)
    kw: dict[str, Any] = {"residual_path": res.wr_path, "n_critical": 1, "n_ctx": 128, "n_threads": 2,
                          "verbose": False}
    # the plain layout, as the cache run keeps it (tests/cache_reference.py: exps=CPU alone still repacks)
    cpu = PlainLlama(res.wq_path, override_tensor="exps=CPU", **kw)
    toks = cpu.tokenize(TEXT)[:20]
    want = step_logits(cpu, toks[:8], toks[8:])
    cpu.close()
    llm = Llama(res.wq_path, rpc_servers=[rpc.endpoint], n_gpu_layers=-1, override_tensor="exps=CPU",
                expert_cache=ExpertCacheConfig(device=rpc.device.buffer_type, policy="moepic",
                                               moepic=MoEpicSettings(0.5, 3)), **kw)
    try:
        assert llm.expert_cache is not None
        ml = llm.expert_cache.moepic
        got = step_logits(llm, toks[:8], toks[8:])
        stats = llm.expert_cache.stats()
    finally:
        llm.close()
    assert all(m.n_top == 256 and m.n_ff == 512 and 2 * m.top_bytes == m.expert_bytes for m in ml)
    assert 0 < stats.hits < stats.slots
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(a, b), f"step {i}: max |dev - cpu| {np.abs(a - b).max()}"


def test_moepic_from_a_gpu_mem_plan_is_exact(make_tiny, rpc: RPCServer) -> None:  # type: ignore[no-untyped-def]
    """The path of run/serve --gpu-mem --cache-policy moepic: the planner's per-expert cache for half the routed
    experts, realized on the stand-in, its device memory spent on MoEpic's split experts (fixed point): the logits
    equal the all-CPU run's and the resident tops fit the memory the cache would have used."""
    path = make_tiny("qwen3moe")
    full = plan_for_model(path, gpu_mem=None, n_ctx=128, reserve=0)
    half = plan_for_model(path, gpu_mem=full.vram - full.device_bytes(GPU, "routed experts") // 2, n_ctx=128,
                          reserve=0)
    place = realize(half, cache_device=rpc.device.buffer_type)
    assert "expert_cache" in place and place["expert_cache"].experts
    kw = cache_placement(path, place, CachePolicy.moepic, None)
    assert kw["expert_cache"].experts is None and kw["expert_cache"].policy == "moepic"
    prompt, rest, want = _cpu_steps(path, 16)
    llm = Llama(path, verbose=False, n_threads=2, rpc_servers=[rpc.endpoint], **kw)
    try:
        got = step_logits(llm, prompt, rest)
        assert llm.expert_cache is not None
        ml = llm.expert_cache.moepic
    finally:
        llm.close()
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(a, b), f"step {i}: max |dev - cpu| {np.abs(a - b).max()}"
    layers = [m.layer for m in ml]
    planned = sum(len(place["expert_cache"].experts.get(il, ())) for il in layers)
    rounded = moepic_layers(path, layers, [m.split for m in ml], [m.capacity for m in ml], 1)
    assert sum(m.capacity * m.top_bytes for m in rounded) <= planned * ml[0].expert_bytes
