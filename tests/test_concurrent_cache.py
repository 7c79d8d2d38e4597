"""Concurrent hits, misses and residuals in layers with a per-expert WQ cache (RPC stand-in as the device).

With overlap "auto" (the default) a cached layer hands the misses' WQ matmuls and the critical slots' residuals to
the residual worker while the device computes the cached experts; "off" computes them one after the other. Both
sum the same values in the same order, so the logits must EQUAL the serial graph's and the all-CPU run's
(np.array_equal) at r = 0, 1 and k, with the concurrent ops really in the graph (their begin/join pairs counted,
their join tensors captured) and the hit counters unchanged."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rapidmoe import Llama
from rapidmoe._runtime import _core
from rapidmoe.expert_cache import moe_layers_of
from rapidmoe.ggufio import GGUFFile
from rapidmoe.rpc import RPCServer

pytestmark = pytest.mark.native

# cpu-q8: one Q8_0 kernel on both sides of the stand-in (see tests/test_expert_cache.py)
PRESET = "cpu-q8"
TEXT = b"The mixture of experts routes every token to a few experts; the rest of the network is dense."


@pytest.fixture(scope="module")
def rpc() -> Iterator[RPCServer]:
    with RPCServer(threads=1) as srv:
        yield srv


def _shape(path: Path) -> tuple[int, int]:
    f = GGUFFile(path)
    arch = f.get("general.architecture")
    return int(f.get(f"{arch}.expert_count")), int(f.get(f"{arch}.expert_used_count"))


def _run(path: Path, toks: list[int], capture: list[str] | None = None, **kw):  # type: ignore[no-untyped-def]
    cap = _core.TensorCapture(capture) if capture else None
    llm = Llama(path, n_ctx=128, logits_all=True, verbose=False, n_threads=2, eval_callback=cap, **kw)
    try:
        llm.eval(toks[:-3])
        for t in toks[-3:]:  # decode steps: one token per ubatch
            llm.eval([t])
        logits = np.array(llm.scores[: len(toks)], dtype=np.float32)
        stats = llm.expert_cache_stats() if "expert_cache" in kw else None
        got = {n: cap.get(n) for n in capture} if cap is not None and capture else {}
        return logits, stats, llm.overlap_stats(), got
    finally:
        llm.close()


def test_concurrent_cached_layers_equal_serial_and_cpu(make_split, rpc: RPCServer) -> None:  # type: ignore[no-untyped-def]
    _, wq, wr = make_split("qwen3moe", PRESET)
    vocab = Llama(wq, n_ctx=128, vocab_only=True, verbose=False)
    toks = vocab.tokenize(TEXT, add_bos=False)[:24]
    vocab.close()
    n_expert, k = _shape(wq)
    layers = moe_layers_of(wq)
    # a different half of each layer's experts, in a scrambled slot order; the last layer caches nothing (its work
    # stays on the CPU, serial) so both kinds of layer meet in one graph
    cache = {il: sorted(range(n_expert), key=lambda e: (e * 5 + il) % n_expert)[: n_expert // 2][::-1]
             for il in layers[:-1]}
    cache[layers[-1]] = []
    dev = {"rpc_servers": [rpc.endpoint], "n_gpu_layers": -1, "override_tensor": "exps=CPU",
           "expert_cache": cache, "expert_cache_device": rpc.device.buffer_type}
    join = f"rapidmoe_cached_gate_up_join-{layers[0]}"
    results = {}
    for r in (0, 1, k):
        cpu, _, _, _ = _run(wq, toks, residual_path=wr, n_critical=r, override_tensor="exps=CPU")
        serial, s_stats, s_ov, _ = _run(wq, toks, residual_path=wr, n_critical=r, overlap="off", **dev)
        conc, c_stats, c_ov, got = _run(wq, toks, capture=[join], residual_path=wr, n_critical=r, **dev)
        print(f"r={r}: max |concurrent - serial| {np.abs(conc - serial).max()}, hit rate {c_stats.hit_rate:.3f}, "
              f"gate/up pairs {c_ov.gate_up.pairs}")
        assert np.array_equal(serial, cpu), r
        assert np.array_equal(conc, serial), r
        assert s_ov.pairs == 0
        # one begin/join pair per cached layer, stage and ubatch (the uncached last layer runs serially)
        assert c_ov.gate_up.pairs == c_ov.down.pairs == 4 * (len(layers) - 1), c_ov
        n_ff = np.asarray(got[join][0]).shape[-1]
        assert [np.asarray(a).shape for a in got[join]] == [(2, n, k, n_ff) for n in (len(toks) - 3, 1, 1, 1)]
        assert [(s.hits, s.slots) for s in c_stats.layers] == [(s.hits, s.slots) for s in s_stats.layers]
        results[r] = conc
    assert not np.array_equal(results[0], results[k])  # the residuals are in: r changes the result


def test_prefill_streaming_equals_the_cpu_run(make_split, rpc: RPCServer) -> None:  # type: ignore[no-untyped-def]
    """prefill_stream=N: a ubatch of >= N tokens computes every cached layer's WQ on the device from the stacked
    experts (copied there by the scheduler); the decode steps after it do not stream. The logits equal the CPU
    run's, serial and overlapped, and the streamed prompt never reaches the cache's route ops (its slots are not
    counted), while a threshold above the prompt leaves everything as without streaming."""
    _, wq, wr = make_split("qwen3moe", PRESET)
    vocab = Llama(wq, n_ctx=128, vocab_only=True, verbose=False)
    toks = vocab.tokenize(TEXT, add_bos=False)[:24]
    vocab.close()
    n_expert, k = _shape(wq)
    layers = moe_layers_of(wq)
    cache = {il: list(range(n_expert // 2)) for il in layers}
    dev = {"rpc_servers": [rpc.endpoint], "n_gpu_layers": -1, "override_tensor": "exps=CPU",
           "expert_cache": cache, "expert_cache_device": rpc.device.buffer_type}
    n_prompt = len(toks) - 3
    for r in (0, 1, k):
        cpu, _, _, _ = _run(wq, toks, residual_path=wr, n_critical=r, override_tensor="exps=CPU")
        for overlap in ("off", "auto"):
            got, stats, ov, _ = _run(wq, toks, residual_path=wr, n_critical=r, overlap=overlap, prefill_stream=8,
                                     **dev)
            print(f"r={r} overlap={overlap}: max |stream - cpu| {np.abs(got - cpu).max()}, slots {stats.slots}")
            assert np.array_equal(got, cpu), (r, overlap)
            assert stats.slots == 3 * k * len(layers)  # the 3 decode steps only: the prompt streamed
            # the residuals overlap with the streamed WQ (and the decode steps run concurrently) unless "off"
            assert (ov.pairs == 0) == (overlap == "off"), ov
        _, stats, _, _ = _run(wq, toks, residual_path=wr, n_critical=r, prefill_stream=n_prompt + 1, **dev)
        assert stats.slots == len(toks) * k * len(layers)


def test_prefill_stream_refuses_bad_values(make_split) -> None:  # type: ignore[no-untyped-def]
    _, wq, _ = make_split("qwen3moe", PRESET)
    for bad in (-1, 1.5, True):
        with pytest.raises(Exception, match="prefill_stream must be 0"):
            Llama(wq, n_ctx=64, verbose=False, prefill_stream=bad)
