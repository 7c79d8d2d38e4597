"""The moepic policy at run time on the RPC stand-in (MoEpic: experts split vertically, tops of some experts resident,
the rest fetched per ubatch, the next layer's predicted experts assembled ahead), and the transfer queue every policy
copies through. Logits equal the all-CPU run at every step while tops are evicted under a budget smaller than one
layer's experts, with copies overlapped or waited for at once; the runtime's hits, bytes fetched on demand and
ahead equal the simulator's replay (placement.cache_policies.MoEpicCache) of the trace recorded in the same run."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rapidmoe import Llama, RapidMoEError
from rapidmoe.expert_cache import moe_layers_of, wq_expert_bytes
from rapidmoe.placement.cache_policies import (
    LRUCache,
    MoEpicCache,
    MoEpicSettings,
    RefreshSettings,
    RapidMoECache,
    replay,
)
from rapidmoe.rpc import RPCServer
from rapidmoe.trace import read_trace

TEXT = b"The mixture of experts routes every token to a few experts; the rest of the network is dense. " * 3


@pytest.fixture(scope="module")
def rpc() -> Iterator[RPCServer]:
    with RPCServer(threads=1) as srv:
        yield srv


def _steps(llm: Llama, prompt: list[int], rest: list[int]) -> list[np.ndarray]:
    out = []
    llm.eval(prompt)
    out.append(np.array(llm.scores[llm.n_tokens - 1]))
    for t in rest:
        llm.eval([t])
        out.append(np.array(llm.scores[llm.n_tokens - 1]))
    return out


def _cpu_steps(path: Path, n: int) -> tuple[list[int], list[int], list[np.ndarray]]:
    cpu = Llama(path, n_ctx=128, verbose=False, n_threads=2)
    toks = cpu.tokenize(TEXT)[:n]
    prompt, rest = toks[:8], toks[8:]
    want = _steps(cpu, prompt, rest)
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
                override_tensor="exps=CPU", expert_cache_device=rpc.device.buffer_type,
                expert_cache_policy="moepic", expert_cache_moepic=settings, expert_cache_async=overlap, trace=trace)
    try:
        got = _steps(llm, prompt, rest)
        stats, moved, ml = llm.expert_cache_stats(), llm.expert_cache_bytes(), llm.expert_cache_moepic
        assert llm.tensor_buffer(f"blk.{layers[0]}.ffn_up_exps.cache") == rpc.device.buffer_type
    finally:
        llm.close()
    for i, (a, b) in enumerate(zip(got, want)):
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
                    override_tensor="exps=CPU", expert_cache={il: [3, 0, 5] for il in layers},
                    expert_cache_device=rpc.device.buffer_type, expert_cache_policy=policy, expert_cache_async=False,
                    expert_cache_refresh=RefreshSettings(4.0, 1, 0.0) if policy == "rapidmoe" else None)
        try:
            got = _steps(llm, prompt, rest)
            moved = llm.expert_cache_bytes()
            copies = llm.expert_cache_copies()
        finally:
            llm.close()
        for i, (a, b) in enumerate(zip(got, want)):
            assert np.array_equal(a, b), f"{policy} step {i}: max |dev - cpu| {np.abs(a - b).max()}"
        if policy == "lru":
            assert sum(copies.values()) > 0
            assert [moved[il][0] for il in layers] == [copies[il] * eb[il] for il in layers]
    assert LRUCache and RapidMoECache  # the simulator twins are compared in test_expert_cache_refresh.py


def test_moepic_refusals(make_tiny, rpc: RPCServer) -> None:  # type: ignore[no-untyped-def]
    path = make_tiny("qwen3moe")
    with pytest.raises(RapidMoEError, match="go together"):
        Llama(path, verbose=False, expert_cache_policy="moepic")
    with pytest.raises(RapidMoEError, match="not expert_cache"):
        Llama(path, verbose=False, expert_cache_policy="moepic", expert_cache={1: [0]},
              expert_cache_moepic=MoEpicSettings(0.5, 2))
    with pytest.raises(RapidMoEError, match="splits in"):
        MoEpicSettings(1.5, 2)
    with pytest.raises(RapidMoEError, match="MoE layers"):
        Llama(path, verbose=False, expert_cache_policy="moepic", expert_cache_moepic=MoEpicSettings([0.5], 2),
              expert_cache_device=rpc.device.buffer_type, rpc_servers=[rpc.endpoint])
