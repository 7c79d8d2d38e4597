"""The sidecar's registry and the overlap worker under concurrency: a policy changes only between graph computes,
a detach while another thread decodes frees nothing under it (later graphs are rebuilt stock), a worker task
belongs to one begin/join and an exception in it reaches the join instead of ending the process."""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from testkit import TEXT

from rapidmoe import Llama, RapidMoEError, _core
from rapidmoe.umia import Policy


def test_worker_task_life_cycle() -> None:
    """Ids are fresh per task, a task is forgotten once every waiter has seen it, an exception in a task comes
    back from wait as its error and the worker runs on (today's main: std::terminate)."""
    passed, what = _core.worker_selftest()
    assert passed, what


def test_worker_failure_reaches_the_caller(make_split) -> None:  # type: ignore[no-untyped-def]
    """A residual task that throws on the worker thread: the process lives on, the step's logits are wrong, eval
    raises RapidMoEError naming the failure, and the same step computed again equals an undisturbed run bit for bit."""
    _, wq, wr = make_split("qwen3moe")
    kw: dict[str, Any] = {"residual_path": wr, "overlap": "on", "n_critical": 2, "n_ctx": 64, "n_threads": 2,
                          "logits_all": True, "verbose": False}
    ref = Llama(wq, **kw)
    toks = ref.tokenize(TEXT, add_bos=False)[:3]
    try:
        ref.eval(toks)
        want = np.array(ref.scores[2], dtype=np.float32)
    finally:
        ref.close()
    llm = Llama(wq, **kw)
    try:
        llm.eval(toks[:2])
        _core.worker_fail_next()
        with pytest.raises(RapidMoEError, match="injected failure"):
            llm.eval(toks[2:])
        # join wrote NaN; the quantized matmuls after it turn that into garbage, not always into NaN
        assert not np.array_equal(np.array(llm.scores[2], dtype=np.float32), want)
        llm.n_tokens = 2  # the failed step again
        llm.eval(toks[2:])
        assert np.array_equal(np.array(llm.scores[2], dtype=np.float32), want)
        assert _core.take_worker_error(llm._model.model) is None  # taken by the eval that raised
    finally:
        llm.close()


def _decode_r(raw: np.ndarray, layers: list[int]) -> list[int] | None:
    """r of each MoE layer for the one decode token counted since the last reset (None: no sidecar any more)."""
    if raw.shape[0] == 0:
        return None
    out = []
    for il in layers:
        hist = raw[il, 0]
        assert hist.sum() == 1, (il, hist)
        out.append(int(np.flatnonzero(hist)[0]))
    return out


def test_policy_and_detach_while_decoding(make_split) -> None:  # type: ignore[no-untyped-def]
    """One thread decodes token by token while another flips the fixed r between 0 and k (set_n_critical and
    set_policy) hundreds of times, then detaches the sidecar mid-run. Every decode step saw one r in all its MoE
    layers (a policy is never applied halfway through a graph); after the detach the graphs are rebuilt without
    the sidecar: the logits equal the WQ file alone, bit for bit."""
    _, wq, wr = make_split("qwen3moe")
    kw: dict[str, Any] = {"n_ctx": 256, "n_batch": 64, "n_threads": 2, "logits_all": True, "verbose": False}
    llm = Llama(wq, residual_path=wr, overlap="on", **kw)
    try:
        k, layers = llm.residual.n_expert_used, llm.moe_layers  # type: ignore[union-attr]
        toks = llm.tokenize(TEXT, add_bos=False)[:8]
        model = llm._model.model
        stop = threading.Event()
        detached = threading.Event()
        flips: list[int] = []
        errors: list[BaseException] = []

        def meddle() -> None:
            try:
                for i in range(400):
                    if stop.is_set():
                        break
                    r = 0 if i % 2 else k
                    if i % 4 < 2:
                        llm.set_n_critical(r)
                    else:
                        llm.set_policy(Policy.fixed(r))
                    flips.append(r)
                assert _core.detach_residual(model)
                detached.set()
            except BaseException as e:  # noqa: BLE001  # pragma: no cover - reported below
                errors.append(e)
                detached.set()

        steps, mixed = 0, []
        worker = threading.Thread(target=meddle)
        llm.eval(toks)
        _core.r_histogram(model, True)
        worker.start()
        try:
            while not detached.is_set() or steps < 40:
                if llm.n_tokens >= 200:
                    llm.reset()
                    llm.eval(toks)
                    if not detached.is_set():
                        _core.r_histogram(model, True)
                    continue
                llm.eval([toks[steps % len(toks)]])
                steps += 1
                if not detached.is_set():
                    rs = _decode_r(_core.r_histogram(model, True), layers)
                    if rs is not None and len(set(rs)) != 1:
                        mixed.append(rs)
        finally:
            stop.set()
            worker.join()
        assert not errors, errors
        assert len(flips) >= 100 and steps >= 40
        assert not mixed, f"{len(mixed)} decode steps saw a policy change halfway: {mixed[:3]}"
        # after the detach: the stock graph (rebuilt, not the reused split one)
        llm.reset()
        llm.eval(toks)
        after = np.array(llm.scores[len(toks) - 1], dtype=np.float32)
    finally:
        llm.close()
    ref = Llama(wq, **kw)
    try:
        ref.eval(toks)
        stock = np.array(ref.scores[len(toks) - 1], dtype=np.float32)
    finally:
        ref.close()
    assert np.array_equal(after, stock), float(np.abs(after - stock).max())


def test_detach_then_decode_rebuilds_the_graph(make_split) -> None:  # type: ignore[no-untyped-def]
    """A detach between two single-token decodes: llama.cpp would reuse the split graph (pointers into the freed
    sidecar); the guard makes it rebuild, so the second decode runs stock and equals the WQ file alone. The first
    token runs at r = 0 (the same logits and KV as stock), then r = k is set: a reused split graph would differ."""
    _, wq, wr = make_split("qwen3moe")
    kw: dict[str, Any] = {"n_ctx": 64, "n_threads": 2, "logits_all": True, "verbose": False}
    ref = Llama(wq, **kw)
    toks = ref.tokenize(TEXT, add_bos=False)[:2]
    try:
        for t in toks:
            ref.eval([t])
        stock = np.array(ref.scores[:2], dtype=np.float32)
    finally:
        ref.close()
    got = {}
    for detach in (False, True):
        llm = Llama(wq, residual_path=wr, n_critical=0, **kw)
        try:
            k = llm.residual.n_expert_used  # type: ignore[union-attr]
            llm.eval(toks[:1])
            llm.set_n_critical(k)  # read at compute time: the built graph stays reusable
            if detach:
                assert _core.detach_residual(llm._model.model)
            llm.eval(toks[1:])
            got[detach] = np.array(llm.scores[:2], dtype=np.float32)
        finally:
            llm.close()
    assert np.array_equal(got[False][0], stock[0]) and np.array_equal(got[True][0], stock[0])  # r = 0 is stock
    assert not np.array_equal(got[False][1], stock[1])  # r = k on the split graph differs: the check can tell
    assert np.array_equal(got[True][1], stock[1]), float(np.abs(got[True][1] - stock[1]).max())


def test_bad_model_address_is_refused() -> None:
    for fn in (_core.overlap_stats, _core.moe_counters, _core.r_histogram, _core.expert_cache_stats):
        with pytest.raises(ValueError, match="model address is null"):
            fn(0)


def test_no_sidecar_gives_empty_counters(make_split) -> None:  # type: ignore[no-untyped-def]
    """Without a sidecar the per-layer arrays are empty (sized from the model, not from a fixed maximum); with one
    they have a row per layer, and a clean run leaves no worker error."""
    _, wq, wr = make_split("qwen3moe")
    llm = Llama(wq, n_ctx=32, verbose=False)
    try:
        m = llm._model.model
        assert _core.moe_counters(m).shape == (0, 3)
        assert _core.r_histogram(m).shape == (0, 2, _core.max_top_k + 1)
        assert _core.take_worker_error(m) is None
    finally:
        llm.close()
    llm = Llama(wq, residual_path=wr, overlap="on", n_ctx=32, verbose=False)
    try:
        m = llm._model.model
        llm.eval(llm.tokenize(TEXT, add_bos=False)[:4])
        n_layer = _core.get_policy(m).shape[0] - 1
        assert _core.moe_counters(m).shape == (n_layer, 3)
        assert _core.r_histogram(m).shape == (n_layer, 2, _core.max_top_k + 1)
        assert _core.take_worker_error(m) is None
    finally:
        llm.close()
