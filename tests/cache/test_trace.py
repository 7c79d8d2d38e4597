"""Routing traces: the file format round-trips and refuses bad files; `Llama(trace=...)` records the experts the
graph chose (equal to a numpy top-k of the router's captured probabilities), their weights, and the next-layer
predictions (equal to a numpy top-k of the next router applied to the captured FFN input); `run --trace` and
`serve --trace` write traces."""
from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from testkit import repeated_text

from rapidmoe import Llama, RapidMoEError
from rapidmoe._runtime import _core
from rapidmoe.ggufio import GGUFFile, tensor_f32
from rapidmoe.placement.cache.moepic import moe_layers_of
from rapidmoe.trace import MAGIC, TraceError, TraceHeader, TraceWriter, read_trace

TEXT = repeated_text(2)


def _random_steps(rng: np.random.Generator, n_moe: int, n_expert: int, k: int, sizes: list[tuple[int, int]]):  # type: ignore[no-untyped-def]
    """(n_tokens, rows of the last layer) per step -> ids, weights and predictions per layer."""
    out = []
    for n, last in sizes:
        rows = [n] * (n_moe - 1) + [last]
        ids = [np.stack([rng.choice(n_expert, k, replace=False) for _ in range(r)]).reshape(r, k) for r in rows]
        w = [rng.random((r, k)).astype(np.float32) for r in rows]
        pred = [np.stack([rng.choice(n_expert, k, replace=False) for _ in range(r)]).reshape(r, k) for r in rows[:-1]]
        out.append((n, ids, w, pred))
    return out


@pytest.mark.parametrize("n_expert", [16, 300])  # one- and two-byte ids
def test_round_trip(tmp_path: Path, n_expert: int) -> None:
    rng = np.random.default_rng(0)
    header = TraceHeader(n_expert, 3, (1, 2, 4), {"model": "x", "predicted": True})
    steps = _random_steps(rng, 3, n_expert, 3, [(5, 1), (1, 1), (4, 4)])
    path = tmp_path / "t.trace"
    with TraceWriter(path, header) as w:
        for n, ids, wt, pred in steps:
            w.write_step(n, ids, wt, pred)
    assert not list(tmp_path.glob("*.tmp*"))  # renamed into place
    tr = read_trace(path)
    assert tr.header.n_expert == n_expert and tr.header.moe_layers == (1, 2, 4) and tr.header.meta["model"] == "x"
    assert tr.n_tokens == 10 and len(tr.steps) == 3
    for (n, ids, wt, pred), s in zip(steps, tr.steps, strict=True):
        assert s.n_tokens == n
        for a, b in zip(ids, s.ids, strict=True):
            assert np.array_equal(a, b)
        for a, b in zip(wt, s.weights, strict=True):
            np.testing.assert_allclose(b.astype(np.float32), a, rtol=1e-3, atol=1e-4)  # stored as float16
        for a, b in zip(pred, s.pred, strict=True):
            assert np.array_equal(a, b)
    ids, pred = tr.token_matrix()
    assert pred is not None
    assert ids.shape == (10, 3, 3)
    # the first step's last layer routed only its last token
    assert (ids[:4, 2] == -1).all() and np.array_equal(ids[4, 2], steps[0][1][2][0])
    assert np.array_equal(ids[6:10, 0], steps[2][1][0])
    assert (pred[:, 0] == -1).all() and np.array_equal(pred[6:10, 1], steps[2][3][0])
    assert (pred[:4, 2] == -1).all()  # no prediction for a token the layer did not route
    counts = tr.counts()
    assert counts.sum() == 3 * (10 + 10 + 6) and counts[0].sum() == 30


def test_bad_files_and_arguments(tmp_path: Path) -> None:
    p = tmp_path / "t.trace"
    header = TraceHeader(8, 2, (0, 1))
    with TraceWriter(p, header) as w:
        w.write_step(2, [np.array([[0, 1], [2, 3]])] * 2, [np.zeros((2, 2))] * 2)
        with pytest.raises(TraceError, match="out of range"):
            w.write_step(1, [np.array([[0, 8]])] * 2, [np.zeros((1, 2))] * 2)
        with pytest.raises(TraceError, match="rows"):
            w.write_step(1, [np.array([[0, 1], [2, 3]])] * 2, [np.zeros((2, 2))] * 2)
        with pytest.raises(TraceError, match="predictions"):
            w.write_step(1, [np.array([[0, 1]])] * 2, [np.zeros((1, 2))] * 2, [np.array([[0, 1]])])
    data = p.read_bytes()
    assert read_trace(p).n_tokens == 2
    (tmp_path / "short").write_bytes(data[:-3])
    with pytest.raises(TraceError, match="truncated"):
        read_trace(tmp_path / "short")
    (tmp_path / "magic").write_bytes(b"GGUF" + data[4:])
    with pytest.raises(TraceError, match="not a rapidmoe routing trace"):
        read_trace(tmp_path / "magic")
    (tmp_path / "version").write_bytes(MAGIC + struct.pack("<I", 9) + data[12:])
    with pytest.raises(TraceError, match="version 9"):
        read_trace(tmp_path / "version")
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "missing")
    with pytest.raises(TraceError, match="bad trace header"):
        TraceWriter(tmp_path / "x", TraceHeader(4, 5, (0,)))
    # an aborted writer leaves nothing behind
    with pytest.raises(RuntimeError), TraceWriter(tmp_path / "aborted", header):
        raise RuntimeError
    assert not (tmp_path / "aborted").exists() and not list(tmp_path.glob("aborted.tmp*"))


def _capture_run(path: Path, toks: list[int], names: list[str]) -> tuple[np.ndarray, dict[str, list[np.ndarray]]]:
    cap = _core.TensorCapture(names)
    llm = Llama(path, n_ctx=128, n_batch=16, n_ubatch=16, logits_all=True, verbose=False, n_threads=2,
                eval_callback=cap)
    try:
        llm.eval(toks)
        return np.array(llm.scores[: len(toks)]), {n: cap.get(n) for n in names}
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_llama_records_the_graphs_choices(arch: str, make_tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = make_tiny(arch)
    layers = moe_layers_of(path)
    out = tmp_path / "r.trace"
    llm = Llama(path, n_ctx=128, n_batch=16, n_ubatch=16, logits_all=True, verbose=False, n_threads=2, trace=out)
    toks = llm.tokenize(TEXT)[:40]
    llm.eval(toks)
    traced = np.array(llm.scores[: len(toks)])
    assert not out.exists()  # complete only after close
    llm.close()
    tr = read_trace(out)
    k, n_expert = tr.header.k, tr.header.n_expert
    assert tr.header.moe_layers == tuple(layers) and tr.header.meta["arch"] == arch
    assert tr.n_tokens == len(toks) and len(tr.steps) > 1 and all(s.n_tokens <= 16 for s in tr.steps)  # per ubatch
    gf = GGUFFile(path)
    # what the graph takes the top-k of: the probabilities, + the selection bias (DeepSeek-V3), with the groups
    # not chosen masked out (group-limited routing)
    kinds = ("ffn_moe_probs_masked", "ffn_moe_probs_biased", "ffn_moe_probs")
    plain, got = _capture_run(path, toks, [f"{n}-{il}" for n in kinds for il in layers] +
                              [f"ffn_norm-{il}" for il in layers])
    sel = [next(f"{n}-{il}" for n in kinds if got[f"{n}-{il}"]) for il in layers]
    assert np.array_equal(traced, plain)  # recording does not change the computation
    ids, pred = tr.token_matrix()
    assert pred is not None
    assert ids.shape == (len(toks), len(layers), k) and (ids >= 0).all()  # logits_all: every layer routes all
    for m, il in enumerate(layers):
        probs = np.concatenate([x.reshape(-1, n_expert) for x in got[f"ffn_moe_probs-{il}"]])
        score = np.concatenate([x.reshape(-1, n_expert) for x in got[sel[m]]])
        want = np.argsort(-score, axis=1, kind="stable")[:, :k]
        assert np.array_equal(np.sort(ids[:, m], axis=1), np.sort(want, axis=1)), il
        np.testing.assert_allclose(tr.layer_weights(m), np.take_along_axis(probs, ids[:, m], 1), rtol=2e-3,
                                   atol=1e-4)
        if m + 1 < len(layers):  # next layer's router on this layer's FFN input
            x = np.concatenate([a.reshape(-1, a.shape[-1]) for a in got[f"ffn_norm-{il}"]])
            w = tensor_f32(gf.tensor(f"blk.{layers[m + 1]}.ffn_gate_inp.weight"))
            score = x @ w.T
            if gf.get(f"{arch}.expert_gating_func") == 2:  # sigmoid gating + selection bias (groups not applied)
                bias = tensor_f32(gf.tensor(f"blk.{layers[m + 1]}.exp_probs_b.bias"))
                score = 1.0 / (1.0 + np.exp(-score)) + bias
            want_p = np.argsort(-score, axis=1, kind="stable")[:, :k]
            assert np.array_equal(np.sort(pred[:, m + 1], axis=1), np.sort(want_p, axis=1)), il
    assert (pred[:, 0] == -1).all()


def test_trace_refuses_an_eval_callback(tiny_qwen: Path, tmp_path: Path) -> None:
    with pytest.raises(RapidMoEError, match="not both"):
        Llama(tiny_qwen, trace=tmp_path / "t", eval_callback=_core.TensorCapture(["x"]), verbose=False)
    assert not list(tmp_path.iterdir())


def test_run_and_serve_write_traces(tiny_qwen: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.trace"
    res = subprocess.run([sys.executable, "-m", "rapidmoe.cli", "run", str(tiny_qwen), "-p", "Hello there", "-n", "6",
                          "--temp", "0", "-t", "2", "--trace", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert f"trace:   {out}" in res.stderr
    tr = read_trace(out)
    # the prompt in one step (its last layer routes only the token that gives logits), then one token per step
    assert tr.steps[0].n_tokens > 1 and tr.steps[0].ids[-1].shape[0] == 1
    assert [s.n_tokens for s in tr.steps[1:]] == [1] * (len(tr.steps) - 1) and len(tr.steps) >= 5

    from server_proc import ServerProc  # noqa: PLC0415

    sout = tmp_path / "serve.trace"
    srv = ServerProc(tiny_qwen, "-t", "2", "-np", "2", "--trace", str(sout), log_path=tmp_path / "serve.log")
    try:
        status, body = srv.request("POST", "/completion", {"prompt": "Hello", "n_predict": 4, "temperature": 0})
        assert status == 200, body
    finally:
        srv.stop()
    tr = read_trace(sout)
    assert tr.n_tokens >= 4 and tr.header.meta["arch"] == "qwen3moe"
