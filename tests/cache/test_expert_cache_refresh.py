"""The runtime cache policies on the RPC stand-in: rapidmoe (the expert cache refreshed between decode steps) and
lru (each ubatch's missing experts copied into least recently used slots before the layer computes). Logits equal
the all-CPU run at every step while experts move, and the runtime's hits, copies and bytes equal the simulator's
replay (rapidmoe.placement.cache.simulator) of the trace recorded in the same run."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cache_reference import step_logits
from testkit import repeated_text
from typer.testing import CliRunner

from rapidmoe import Llama, RapidMoEError
from rapidmoe._runtime import _core
from rapidmoe.cli.app import app
from rapidmoe.placement.cache.config import ExpertCacheConfig, RefreshSettings
from rapidmoe.placement.cache.moepic import moe_layers_of, wq_expert_bytes
from rapidmoe.placement.cache.simulator import LRUCache, RapidMoECache, replay
from rapidmoe.placement.planner import GPU
from rapidmoe.placement.realize import plan_for_model
from rapidmoe.rpc import RPCServer
from rapidmoe.trace import read_trace

TEXT = repeated_text(3)


def test_refresh_is_exact_and_matches_the_simulator(make_tiny, rpc: RPCServer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = make_tiny("qwen3moe")
    layers = moe_layers_of(path)
    initial = {il: [0, 1] for il in layers}
    settings = RefreshSettings(half_life_tokens=4.0, copies_per_step=1, margin=0.0)
    cpu = Llama(path, n_ctx=128, verbose=False, n_threads=2)
    toks = cpu.tokenize(TEXT)[:24]
    prompt, rest = toks[:8], toks[8:]
    want = step_logits(cpu, prompt, rest)
    cpu.close()
    trace = tmp_path / "run.trace"
    llm = Llama(path, n_ctx=128, verbose=False, n_threads=2, rpc_servers=[rpc.endpoint], n_gpu_layers=-1,
                override_tensor="exps=CPU", trace=trace,
                expert_cache=ExpertCacheConfig(experts=initial, device=rpc.device.buffer_type, policy="rapidmoe",
                                               refresh=settings))
    try:
        got = step_logits(llm, prompt, rest)
        assert llm.expert_cache is not None
        stats, ref = llm.expert_cache.stats(), llm.expert_cache.refresh_stats()
        final = llm.expert_cache.experts
        assert llm.tensor_buffer(f"blk.{layers[0]}.ffn_up_exps.cache") == rpc.device.buffer_type
    finally:
        llm.close()
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(a, b), f"step {i}: max |dev - cpu| {np.abs(a - b).max()}"
    assert ref.steps == 1 + len(rest) and ref.swaps > 0
    assert final != initial and all(len(v) == 2 for v in final.values())

    tr = read_trace(trace)
    assert [s.n_tokens for s in tr.steps] == [len(prompt)] + [1] * len(rest)
    ids, _ = tr.token_matrix()
    eb = wq_expert_bytes(path, layers)
    sim = RapidMoECache([set(initial[il]) for il in layers], tr.header.n_expert, float(eb[layers[0]]),
                        half_life_tokens=settings.half_life_tokens, copies_per_step=settings.copies_per_step,
                        margin=settings.margin)
    res = replay(ids, sim, steps=[s.n_tokens for s in tr.steps])  # refreshed after each of the run's steps
    print(f"runtime: hits {stats.hits}/{stats.slots}, swaps {ref.swaps}, {ref.bytes_moved} B; "
          f"replay: hits {res.hits}/{res.slots}, swaps {sim.swaps}, {res.bytes_moved:.0f} B")
    assert [layer.hits for layer in stats.layers] == res.layer_hits
    assert [layer.slots for layer in stats.layers] == res.layer_slots
    assert ref.swaps == sim.swaps and ref.bytes_moved == res.bytes_moved
    assert {il: sorted(c) for il, c in zip(layers, sim.cached, strict=True)} == final


def test_lru_is_exact_and_matches_the_simulator(make_tiny, rpc: RPCServer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = make_tiny("qwen3moe")
    layers = moe_layers_of(path)
    initial = {il: [3, 0, 5] for il in layers}  # slot order = least recently used first
    cpu = Llama(path, n_ctx=128, verbose=False, n_threads=2)
    toks = cpu.tokenize(TEXT)[:24]
    prompt, rest = toks[:8], toks[8:]  # the prompt needs more experts than the 3 slots: some stay on the CPU
    want = step_logits(cpu, prompt, rest)
    cpu.close()
    trace = tmp_path / "lru.trace"
    llm = Llama(path, n_ctx=128, verbose=False, n_threads=2, rpc_servers=[rpc.endpoint], n_gpu_layers=-1,
                override_tensor="exps=CPU", trace=trace,
                expert_cache=ExpertCacheConfig(experts=initial, device=rpc.device.buffer_type, policy="lru"))
    try:
        got = step_logits(llm, prompt, rest)
        assert llm.expert_cache is not None
        stats, copies = llm.expert_cache.stats(), llm.expert_cache.copies()
    finally:
        llm.close()
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(a, b), f"step {i}: max |dev - cpu| {np.abs(a - b).max()}"
    tr = read_trace(trace)
    ids, _ = tr.token_matrix()
    eb = wq_expert_bytes(path, layers)
    sim = LRUCache([3] * len(layers), float(eb[layers[0]]), initial=[initial[il] for il in layers],
                   overflow_on_cpu=True)
    res = replay(ids, sim, steps=[s.n_tokens for s in tr.steps])
    print(f"runtime: hits {stats.hits}/{stats.slots}, copies {sum(copies.values())}; "
          f"replay: hits {res.hits}/{res.slots}, copies {res.bytes_moved / eb[layers[0]]:.0f}")
    assert sum(copies.values()) > 0
    assert [layer.hits for layer in stats.layers] == res.layer_hits
    assert [layer.slots for layer in stats.layers] == res.layer_slots
    assert [copies[il] * eb[il] for il in layers] == res.layer_bytes


def test_refresh_refusals(make_tiny, rpc: RPCServer) -> None:  # type: ignore[no-untyped-def]
    path = make_tiny("qwen3moe")
    layers = moe_layers_of(path)
    with pytest.raises(RapidMoEError, match="one of"):
        ExpertCacheConfig(experts={layers[0]: [0]}, device="CPU", policy="belady")
    with pytest.raises(RapidMoEError, match="need experts="):
        ExpertCacheConfig(policy="rapidmoe")
    llm = Llama(path, n_ctx=64, verbose=False, n_threads=2, rpc_servers=[rpc.endpoint], n_gpu_layers=-1,
                override_tensor="exps=CPU",
                expert_cache=ExpertCacheConfig(experts={layers[0]: [0, 1]}, device=rpc.device.buffer_type))
    try:
        assert llm.expert_cache is not None
        with pytest.raises(RapidMoEError, match="rapidmoe"):
            llm.expert_cache.refresh_stats()
        m = llm._model.model
        with pytest.raises(ValueError, match="is not cached"):
            _core.expert_cache_replace(m, layers[0], 5, 6)
        with pytest.raises(ValueError, match="already cached"):
            _core.expert_cache_replace(m, layers[0], 0, 1)
        with pytest.raises(ValueError, match="out of range"):
            _core.expert_cache_replace(m, layers[0], 0, 99)
        with pytest.raises(ValueError, match="no expert cache"):
            _core.expert_cache_replace(m, 99, 0, 2)
        _core.expert_cache_replace(m, layers[0], 0, 5)
        assert llm.expert_cache.stats().layers[0].cached == 2
        if len(layers) > 1:
            with pytest.raises(ValueError, match="needs at least one"):
                _core.expert_cache_set_lru(m, layers[1], True)  # named with no experts: no slot to load into
    finally:
        llm.close()


def test_cli_cache_policy(tiny_qwen: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--cache-policy rapidmoe reaches the server's Llama when --gpu-mem realizes a per-expert cache (a GPU named
    here by monkeypatching: there is none), and is a usage error where there is no such cache."""
    runner = CliRunner()
    res = runner.invoke(app, ["run", str(tiny_qwen), "-n", "2", "--cache-policy", "rapidmoe"])
    assert res.exit_code != 0 and "only on a machine with a GPU" in res.output
    res = runner.invoke(app, ["run", str(tiny_qwen), "-n", "2", "--cache-policy", "moepic"])
    assert res.exit_code != 0 and "only on a machine with a GPU" in res.output
    res = runner.invoke(app, ["run", str(tiny_qwen), "-n", "2", "--cache-policy", "fifo"])
    assert res.exit_code != 0 and "'fifo' is not one of" in res.output
    full = plan_for_model(tiny_qwen, gpu_mem=None, n_ctx=512, reserve=0)
    budget = full.vram - full.device_bytes(GPU, "routed experts") // 2
    seen: list[Any] = []
    monkeypatch.setattr("rapidmoe.server.run_server", seen.append)
    monkeypatch.setattr("rapidmoe.cli.budget.gpu_devices", lambda: ["CUDA0"])
    res = runner.invoke(app, ["serve", str(tiny_qwen), "--gpu-mem", str(budget), "--reserve", "0", "-c", "512",
                              "--cache-policy", "rapidmoe"])
    assert res.exit_code == 0, res.output
    cfg = seen[0]
    assert cfg.expert_cache.policy == "rapidmoe" and cfg.expert_cache.experts and cfg.expert_cache.device == "CUDA0"
    assert cfg.override_tensor == ("exps=CPU",)
    # moepic spends the planned cache's device memory on split experts (MoEpic's fixed point): no expert_cache,
    # per-layer splits and tops whose bytes fit what the cache would have used, at least as many experts' tops
    res = runner.invoke(app, ["serve", str(tiny_qwen), "--gpu-mem", str(budget), "--reserve", "0", "-c", "512",
                              "--cache-policy", "moepic"])
    assert res.exit_code == 0, res.output
    mcfg = seen[1]
    mc = mcfg.expert_cache
    assert mc.policy == "moepic" and mc.experts is None and mc.device == "CUDA0" and mc.moepic is not None
    layers = moe_layers_of(tiny_qwen)
    splits, caps = mc.moepic.per_layer(len(layers))
    eb = wq_expert_bytes(tiny_qwen, layers)
    planned = sum(len(cfg.expert_cache.experts.get(il, ())) for il in layers)
    spent = sum(c * s * eb[il] for c, s, il in zip(caps, splits, layers, strict=True))
    assert spent <= planned * eb[layers[0]] * (1 + 1e-9)
    assert sum(caps) >= planned and all(0 < s <= 1 for s in splits)
