"""Concurrent hits, misses and residuals in layers with a per-expert WQ cache (RPC stand-in as the device).

With overlap "auto" (the default) a cached layer hands the misses' WQ matmuls and the critical slots' residuals to
the residual worker while the device computes the cached experts; "off" computes them one after the other. Both
sum the same values in the same order, so the logits must EQUAL the serial graph's and the plain-layout all-CPU
run's (np.array_equal) at r = 0, 1 and k, with the concurrent ops really in the graph (their begin/join pairs
counted, their join tensors captured) and the hit counters unchanged. The runs happen in a child process with one
CPU kernel per quant type (tests/cache_reference.py says why)."""
from __future__ import annotations

import numpy as np
import pytest
from cache_reference import eval_runs, expert_shape, prompt_tokens, without_tiled
from testkit import EXACT_PRESET

from rapidmoe import Llama
from rapidmoe.placement.cache.moepic import moe_layers_of

pytestmark = pytest.mark.native


def test_concurrent_cached_layers_equal_serial_and_cpu(make_split) -> None:  # type: ignore[no-untyped-def]
    _, wq, wr = make_split("qwen3moe", EXACT_PRESET)
    toks = prompt_tokens(wq)
    n_expert, k = expert_shape(wq)
    layers = moe_layers_of(wq)
    # a different half of each layer's experts, in a scrambled slot order; the last layer caches nothing (its work
    # stays on the CPU, serial) so both kinds of layer meet in one graph
    cache = {il: sorted(range(n_expert), key=lambda e: (e * 5 + il) % n_expert)[: n_expert // 2][::-1]
             for il in layers[:-1]}
    cache[layers[-1]] = []
    join = f"rapidmoe_cached_gate_up_join-{layers[0]}"
    runs = []
    for r in (0, 1, k):
        side = {"residual_path": str(wr), "n_critical": r}
        runs += [{"plain": True, **side}, {"device": True, "expert_cache": cache, "overlap": "off", **side},
                 {"device": True, "expert_cache": cache, "capture": [join], **side}]
    got_runs = without_tiled(eval_runs, str(wq), toks, 3, runs)
    results = {}
    for i, r in enumerate((0, 1, k)):
        (cpu, _, _, _), (serial, s_stats, s_ov, _), (conc, c_stats, c_ov, got) = got_runs[3 * i: 3 * i + 3]
        print(f"r={r}: max |concurrent - serial| {np.abs(conc - serial).max()}, hit rate {c_stats.hit_rate:.3f}, "
              f"gate/up pairs {c_ov.gate_up.pairs}")
        assert np.array_equal(serial, cpu), r
        assert np.array_equal(conc, serial), r
        assert s_ov.pairs == 0
        # one begin/join pair per cached layer, stage and ubatch (the uncached last layer runs serially)
        assert c_ov.gate_up.pairs == c_ov.down.pairs == 4 * (len(layers) - 1), c_ov
        n_ff = got[join][0].shape[-1]
        assert [a.shape for a in got[join]] == [(2, n, k, n_ff) for n in (len(toks) - 3, 1, 1, 1)]
        assert [(s.hits, s.slots) for s in c_stats.layers] == [(s.hits, s.slots) for s in s_stats.layers]
        results[r] = conc
    assert not np.array_equal(results[0], results[k])  # the residuals are in: r changes the result


def test_prefill_streaming_equals_the_cpu_run(make_split) -> None:  # type: ignore[no-untyped-def]
    """prefill_stream=N: a ubatch of >= N tokens computes every cached layer's WQ on the device from the stacked
    experts (copied there by the scheduler); the decode steps after it do not stream. The logits equal the CPU
    run's, serial and overlapped, and the streamed prompt never reaches the cache's route ops (its slots are not
    counted), while a threshold above the prompt leaves everything as without streaming. Run in a child process
    with one CPU kernel per quant type, against the plain-layout reference (tests/cache_reference.py)."""
    _, wq, wr = make_split("qwen3moe", EXACT_PRESET)
    toks = prompt_tokens(wq)
    n_expert, k = expert_shape(wq)
    layers = moe_layers_of(wq)
    dev = {"device": True, "expert_cache": {il: list(range(n_expert // 2)) for il in layers}}
    n_prompt = len(toks) - 3
    runs = []
    for r in (0, 1, k):
        side = {"residual_path": str(wr), "n_critical": r}
        streamed = [{**dev, **side, "overlap": o, "prefill_stream": 8} for o in ("off", "auto")]
        runs += [{"plain": True, **side}, *streamed, {**dev, **side, "prefill_stream": n_prompt + 1}]
    got_runs = iter(without_tiled(eval_runs, str(wq), toks, 3, runs))
    for r in (0, 1, k):
        cpu, _, _, _ = next(got_runs)
        for overlap in ("off", "auto"):
            got, stats, ov, _ = next(got_runs)
            print(f"r={r} overlap={overlap}: max |stream - cpu| {np.abs(got - cpu).max()}, slots {stats.slots}")
            assert np.array_equal(got, cpu), (r, overlap)
            assert stats.slots == 3 * k * len(layers)  # the 3 decode steps only: the prompt streamed
            # the residuals overlap with the streamed WQ (and the decode steps run concurrently) unless "off"
            assert (ov.pairs == 0) == (overlap == "off"), ov
        _, stats, _, _ = next(got_runs)
        assert stats.slots == len(toks) * k * len(layers)


def test_prefill_stream_refuses_bad_values(make_split) -> None:  # type: ignore[no-untyped-def]
    _, wq, _ = make_split("qwen3moe", EXACT_PRESET)
    for bad in (-1, 1.5, True):
        with pytest.raises(Exception, match="prefill_stream must be 0"):
            Llama(wq, n_ctx=64, verbose=False, prefill_stream=bad)  # type: ignore[arg-type]
