"""Split expert routing (critical experts WQ+WR, the rest WQ only) against independent references:
stock llama.cpp on the .wq.gguf (r = 0), stock on an F32 model of deq(WQ)+deq(WR) (r = k), a numpy split MoE
layer (0 < r < k), KL to the F16 model falling with r, the masked mul_mat_id op against numpy."""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from reference.critical_model import write_critical_model
from reference.numpy_forward import ffn, load, route
from reference.split_logits import STOCK_ORDER_ENV, stock_logits
from reference.split_logits import all_logits as _logits
from reference.split_logits import prompt_tokens as _tokens
from reference.split_logits import rel_error as _rel

from rapidmoe import Llama, ModelFileError, RapidMoEError, _core
from rapidmoe import llama_cpp as lc
from rapidmoe.ggufio import GGUFFile, tensor_f32
from rapidmoe.resplit import Preset, convert, get_preset

EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


@pytest.fixture(scope="module", params=["qwen3moe", "deepseek2"])
def split_pair(request: pytest.FixtureRequest, make_split):  # type: ignore[no-untyped-def]
    """(F16 source, .wq.gguf, .wr.gguf) with the CPU preset (Q2_K WQ, Q2_K residual, Q4_K down copy)."""
    return make_split(request.param)






@pytest.mark.stock
def test_r0_is_exactly_stock_on_the_wq_file(split_pair, stock_bin: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Bit for bit, with our repacked MUL_MAT_ID's 4-row gemm off (patch 0005: on, prompt batches sum in another
    order than stock's one gemv per row; test_repacked_mul_mat_id_gemm_rows_match_the_gemv checks that path). The
    experts are repacked on an AVX-512 CPU, so this also holds our Q2_K gemv (patch 0006) to upstream's. On an AVX2
    CPU without AVX-512 stock keeps Q2_K plain and our build repacks it (patch 0006): RAPIDMOE_Q2_K_REPACK=0 keeps
    it plain here too (tools/kernel_cost.py --check compares that repacked gemv with the plain kernel). Our Q2_K and
    Q4_K gemms (patch 0008) give the gemv's bits, where upstream's add in another order: RAPIDMOE_GEMM=0 keeps
    upstream's for the prompt's dense rows. On x86 stock keeps Q8_0, Q6_K and Q3_K plain: RAPIDMOE_Q8_0_REPACK=0,
    RAPIDMOE_Q6_K_REPACK=0 and RAPIDMOE_Q3_K_REPACK=0 (patches 0016, 0017, 0021)."""
    for k, v in STOCK_ORDER_ENV.items():
        monkeypatch.setenv(k, v)
    _, wq, wr = split_pair
    toks = _tokens(wq)
    ours = _logits(wq, toks, residual_path=wr, n_critical=0)
    np.testing.assert_array_equal(ours, stock_logits(wq, toks, stock_bin, tmp_path))


def test_r_equal_k_matches_the_summed_model(split_pair, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, wq, wr = split_pair
    toks = _tokens(wq)
    ref_path = tmp_path / "sum.gguf"
    write_critical_model(wq, wr, ref_path)
    ref = _logits(ref_path, toks)  # no sidecar: the stock graph on F32 experts
    k = GGUFFile(wq).get(f"{GGUFFile(wq).get('general.architecture')}.expert_used_count")
    full = _logits(wq, toks, residual_path=wr, n_critical=k)
    low = _logits(wq, toks, residual_path=wr, n_critical=0)
    # the split computes WQ and WR matmuls separately on quantized activations: float-level, not bitwise
    assert _rel(full, ref) < 0.03, _rel(full, ref)
    assert _rel(full, ref) < 0.2 * _rel(low, ref)
    assert (full.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def _split_references(src: Path, wq: Path, wr: Path, il: int, h: np.ndarray, k: int) -> list[np.ndarray]:
    """numpy: one MoE layer's routed output, for r = 0..k, with each token's top-r (by weight) slots using
    deq(WQ)+deq(WR) for gate/up and the down copy, the others deq(WQ). Router and hparams from the F16 source
    (the router stays F32 in the .wq.gguf); expert weights dequantized from the converted files."""
    m = load(src)
    base, side = GGUFFile(wq), GGUFFile(wr)
    p = f"blk.{il}."
    ds = m.arch == "deepseek2"
    gating = {1: "softmax", 2: "sigmoid"}[m.hp("expert_gating_func", 1)] if ds else "softmax"
    experts, w = route(h, m.w(p + "ffn_gate_inp.weight"), k, gating,
                       m.w(p + "exp_probs_b.bias") if m.has(p + "exp_probs_b.bias") else None,
                       m.hp("expert_group_count", 0), m.hp("expert_group_used_count", 0),
                       bool(m.hp("expert_weights_norm", True)) if ds else True, m.hp("expert_weights_scale", 0.0))
    q = {n: tensor_f32(base.tensor(f"{p}ffn_{n}_exps.weight")).astype(np.float64) for n in ("gate", "up", "down")}
    res = {n: tensor_f32(side.tensor(f"{p}ffn_{n}_exps.wr")).astype(np.float64) for n in ("gate", "up")}
    down_hi = tensor_f32(side.tensor(f"{p}ffn_down_exps.hi")).astype(np.float64)
    lo = np.zeros((h.shape[0], k, h.shape[1]))  # per slot: WQ-only expert output
    hi = np.zeros_like(lo)  # per slot: high-precision expert output
    for t in range(h.shape[0]):
        for slot in range(k):
            e = experts[t, slot]
            lo[t, slot] = ffn(h[t:t + 1], q["gate"][e], q["up"][e], q["down"][e])[0]
            hi[t, slot] = ffn(h[t:t + 1], q["gate"][e] + res["gate"][e], q["up"][e] + res["up"][e], down_hi[e])[0]
    rank = np.argsort(np.argsort(-w, axis=1, kind="stable"), axis=1)  # rank of each slot by weight
    return [np.einsum("ts,tsd->td", w, np.where((rank < r)[..., None], hi, lo)) for r in range(k + 1)]


def test_partial_r_matches_numpy_split_layer(split_pair) -> None:  # type: ignore[no-untyped-def]
    src, wq, wr = split_pair
    toks = _tokens(wq)
    f = GGUFFile(wq)
    arch = f.get("general.architecture")
    k = int(f.get(f"{arch}.expert_used_count"))
    il = int(f.get(f"{arch}.leading_dense_block_count", 0))  # the first MoE layer
    cap = _core.TensorCapture([f"ffn_norm-{il}", f"ffn_moe_out-{il}"])
    r = 1
    llm = Llama(wq, n_ctx=128, logits_all=True, verbose=False, residual_path=wr, n_critical=r, eval_callback=cap)
    llm.eval(toks)
    counters = llm.moe_counters()
    llm.close()
    h = cap.get(f"ffn_norm-{il}")[-1].reshape(len(toks), -1).astype(np.float64)
    got = cap.get(f"ffn_moe_out-{il}")[-1].reshape(len(toks), -1).astype(np.float64)
    errs = {rr: _rel(got, ref) for rr, ref in enumerate(_split_references(src, wq, wr, il, h, k))}
    assert errs[r] < 0.06, errs  # ggml quantizes activations to 8 bits for K-quant dot products
    assert all(errs[r] < 0.5 * e for rr, e in errs.items() if rr != r), errs  # it really is r = 1
    layer = next(c for c in counters if c.layer == il)
    assert layer.tokens == len(toks) and layer.slots == len(toks) * k and layer.critical_slots == len(toks) * r
    assert layer.wr_bytes > 0 and layer.wq_bytes > layer.wr_bytes


def test_r_changes_at_run_time_and_counts_decode(split_pair) -> None:  # type: ignore[no-untyped-def]
    _, wq, wr = split_pair
    llm = Llama(wq, n_ctx=128, verbose=False, residual_path=wr, n_critical=0)
    k = llm.residual.n_expert_used  # type: ignore[union-attr]
    a = llm.create_completion("Hello there", max_tokens=6, temperature=0.0)["choices"][0]["text"]  # type: ignore[index]
    first = llm.moe_counters(reset=True)
    assert first and all(c.critical_slots == 0 and c.tokens > 0 for c in first)
    assert llm.set_n_critical(k) == k
    llm.reset()
    llm.create_completion("Hello there", max_tokens=6, temperature=0.0)
    second = llm.moe_counters()
    # prefill (many tokens per batch) then 5 single-token decodes, every slot critical
    assert all(c.critical_slots == c.slots == c.tokens * k for c in second)
    n_prompt = len(llm.tokenize(b"Hello there", add_bos=True))
    assert second[0].tokens == n_prompt + 5
    with pytest.raises(RapidMoEError, match=f"n_critical must be in 0..{k}"):
        llm.set_n_critical(k + 1)
    llm.close()
    assert isinstance(a, str)


def test_mismatched_sidecar_is_refused(split_pair, make_tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src, wq, wr = split_pair
    other = convert(src, tmp_path, get_preset("cpu"), name="other", progress=False)  # same pair: same source
    ok = Llama(other.wq_path, residual_path=wr, verbose=False, n_ctx=64)
    assert ok.residual is not None
    ok.close()
    with pytest.raises(ModelFileError, match="does not belong"):
        Llama(src, residual_path=wr, verbose=False)
    arch = "qwen3moe" if GGUFFile(wq).get("general.architecture") == "deepseek2" else "deepseek2"
    foreign = convert(make_tiny(arch, "f16"), tmp_path / "f", get_preset("cpu"), progress=False)
    with pytest.raises(ModelFileError, match="does not belong"):
        Llama(wq, residual_path=foreign.wr_path, verbose=False)


def test_kl_to_f16_falls_as_r_grows(split_pair, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Monotone with a Q4_K residual. With the cpu preset's Q2_K residual the last step (adding the
    lowest-weight expert's residual) can cost more than it gains: deepseek2 tiny went 0.068 -> 0.072."""
    src = split_pair[0]
    res = convert(src, tmp_path, Preset("q2k-q4k", "Q2_K", "Q4_K", "copy", "Q4_K"), progress=False)
    wq, wr = res.wq_path, res.wr_path
    toks = _tokens(wq)
    ref = _logits(src, toks)

    def kl(x: np.ndarray) -> float:
        lp = ref - ref.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        lq = x - x.max(-1, keepdims=True)
        lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
        return float((np.exp(lp) * (lp - lq)).sum(-1).mean())

    llm = Llama(wq, n_ctx=128, logits_all=True, verbose=False, residual_path=wr, n_critical=0)
    kls = []
    for r in range(llm.residual.n_expert_used + 1):  # type: ignore[union-attr]
        llm.set_n_critical(r)
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval(toks)
        kls.append(kl(np.array(llm.scores[: len(toks)], dtype=np.float64)))
    llm.close()
    assert all(a > b for a, b in itertools.pairwise(kls)), kls


def _experts(rng: np.random.Generator, n_as: int, n_out: int, n_in: int,
             type_name: str) -> tuple[np.ndarray, np.ndarray, GGMLQuantizationType]:
    """Random stacked experts [n_as, n_out, n_in] in a ggml type: (raw bytes, their dequantization, the type)."""
    w = rng.standard_normal((n_as, n_out, n_in)).astype(np.float32)
    qt = GGMLQuantizationType[type_name]
    if qt == GGMLQuantizationType.F32:
        return w.view(np.uint8).reshape(n_as, n_out, -1), w, qt
    raw = _core.quantize(w.reshape(-1, n_in), int(qt)).reshape(n_as, n_out, -1)
    return raw, _core.dequantize(raw.reshape(-1, raw.shape[-1]), int(qt), n_in).reshape(w.shape), qt


@pytest.mark.parametrize("type_name", ["Q2_K", "Q4_K", "F32"])
def test_masked_mul_mat_id_matches_numpy(type_name: str) -> None:
    """The ggml patch: ids < 0 skip their slot (zero rows); others equal ggml_mul_mat_id and numpy."""
    rng = np.random.default_rng(1)
    n_as, n_out, n_in, T, k = 6, 32, 256, 5, 3
    raw, deq, qt = _experts(rng, n_as, n_out, n_in, type_name)
    b = rng.standard_normal((T, 1, n_in)).astype(np.float32)
    ids = rng.integers(0, n_as, size=(T, k)).astype(np.int32)
    masked_ids = ids.copy()
    masked_ids[rng.random((T, k)) < 0.5] = -1
    masked_ids[0, :] = -1  # a token with every slot skipped
    full = _core.mul_mat_id(raw, int(qt), n_in, b, ids)
    got = _core.mul_mat_id(raw, int(qt), n_in, b, masked_ids, masked=True)
    ref = np.einsum("tkoi,ti->tko", deq[ids], b[:, 0].astype(np.float64))
    tol = 1e-4 if qt == GGMLQuantizationType.F32 else 2e-2
    assert _rel(full, ref) < tol
    keep = masked_ids >= 0
    np.testing.assert_array_equal(got[~keep], 0.0)
    np.testing.assert_array_equal(got[keep], full[keep])  # same kernels, same numbers for kept slots


def _require_repacked(type_name: str) -> None:
    """Skip where this CPU's ggml has no repacked layout for the type: on x86 our build repacks Q2_K where the
    CPU reports AVX2 or AVX-512 (llama.cpp alone: only AVX-512; patch 0006)."""
    rng = np.random.default_rng(0)
    raw, _, qt = _experts(rng, 2, 8, 256, type_name)
    try:
        _core.mul_mat_id(raw, int(qt), 256, np.zeros((1, 1, 256), np.float32), np.zeros((1, 1), np.int32),
                         repacked=True)
    except ValueError as e:
        pytest.skip(f"no repacked {type_name} layout on this CPU ({e})")


@pytest.mark.parametrize("type_name", ["Q2_K", "Q4_K", "Q8_0"])
def test_masked_mul_mat_id_on_repacked_weights_matches_numpy(type_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The op on the CPU's repacked layout (CPU_REPACK claims it): skipped slots are zero rows, kept ones equal the
    repacked plain MUL_MAT_ID bit for bit and numpy to quantization error. Before patch 0002 made the masked matmul
    its own op, this kernel asserted on the negative ids. Bit for bit needs one kernel per row, so patch 0005's
    4-row gemm is off here (masking changes how an expert's rows group into fours)."""
    _require_repacked(type_name)
    monkeypatch.setenv("RAPIDMOE_REPACK_MMID_GEMM", "0")
    rng = np.random.default_rng(2)
    n_as, n_out, n_in, T, k = 6, 32, 256, 7, 4
    raw, deq, qt = _experts(rng, n_as, n_out, n_in, type_name)
    b = rng.standard_normal((T, 1, n_in)).astype(np.float32)
    # distinct experts per token, as routing gives (the repacked kernel sizes its row map for at most T rows each)
    ids = np.stack([rng.permutation(n_as)[:k] for _ in range(T)]).astype(np.int32)
    masked_ids = ids.copy()
    masked_ids[rng.random((T, k)) < 0.5] = -1
    masked_ids[0, :] = -1
    full = _core.mul_mat_id(raw, int(qt), n_in, b, ids, repacked=True)
    got = _core.mul_mat_id(raw, int(qt), n_in, b, masked_ids, masked=True, repacked=True)
    plain = _core.mul_mat_id(raw, int(qt), n_in, b, ids)
    ref = np.einsum("tkoi,ti->tko", deq[ids], b[:, 0].astype(np.float64))
    assert _rel(full, ref) < 2e-2 and _rel(full, plain) < 1e-5
    keep = masked_ids >= 0
    np.testing.assert_array_equal(got[~keep], 0.0)
    np.testing.assert_array_equal(got[keep], full[keep])
    with pytest.raises(ValueError, match="no repacked layout"):  # F32 has none: refused, not silently plain
        _core.mul_mat_id(deq.astype(np.float32).view(np.uint8).reshape(n_as, n_out, -1), int(GGMLQuantizationType.F32),
                         n_in, b, ids, repacked=True)


@pytest.mark.parametrize("type_name", ["Q2_K", "Q4_K", "Q8_0"])
@pytest.mark.parametrize("masked", [False, True])
def test_repacked_mul_mat_id_gemm_rows_match_the_gemv(type_name: str, masked: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Patch 0005: on repacked weights an expert's routed rows go four at a time through the gemm kernel, the rest
    (count % 4) through the gemv. A prompt-sized batch (experts with 0 to many rows, groups and remainders): with
    our gemm (patch 0008, AVX2) equal to the gemv-only path (RAPIDMOE_REPACK_MMID_GEMM=0) bit for bit, with
    upstream's (RAPIDMOE_GEMM=0, which adds in another order) to float rounding, to numpy to quantization error,
    and the masked op's skipped slots are zero rows."""
    _require_repacked(type_name)
    rng = np.random.default_rng(5)
    n_as, n_out, n_in, T, k = 8, 64, 512, 61, 4
    raw, deq, qt = _experts(rng, n_as, n_out, n_in, type_name)
    b = rng.standard_normal((T, 1, n_in)).astype(np.float32)
    p = np.array([8, 4, 2, 1, 1, 0.5, 0.25, 0.0])  # skewed routing: one expert gets most rows, one none
    ids = np.stack([rng.choice(n_as, size=k, replace=False, p=p / p.sum()) for _ in range(T)]).astype(np.int32)
    if masked:
        ids[rng.random((T, k)) < 0.4] = -1
    monkeypatch.setenv("RAPIDMOE_REPACK_MMID_GEMM", "1")
    gemm = _core.mul_mat_id(raw, int(qt), n_in, b, ids, masked=masked, repacked=True)
    monkeypatch.setenv("RAPIDMOE_GEMM", "0")
    upstream_gemm = _core.mul_mat_id(raw, int(qt), n_in, b, ids, masked=masked, repacked=True)
    monkeypatch.setenv("RAPIDMOE_REPACK_MMID_GEMM", "0")
    gemv = _core.mul_mat_id(raw, int(qt), n_in, b, ids, masked=masked, repacked=True)
    keep = ids >= 0
    counts = np.bincount(ids[keep], minlength=n_as)
    assert counts.max() >= 8 and (counts % 4 != 0).any()  # the batch takes both paths
    assert not np.array_equal(upstream_gemm[keep], gemv[keep])  # the gemm ran (upstream's sums in another order)
    assert _rel(upstream_gemm[keep], gemv[keep]) < 1e-5
    if "AVX2 = 1" in _core.system_info():  # our gemm: the gemv's bits
        np.testing.assert_array_equal(gemm[keep], gemv[keep])
    else:
        assert _rel(gemm[keep], gemv[keep]) < 1e-5
    ref = np.einsum("tkoi,ti->tko", deq[np.where(keep, ids, 0)], b[:, 0].astype(np.float64))
    assert _rel(gemm[keep], ref[keep]) < 2e-2
    np.testing.assert_array_equal(gemm[~keep], 0.0)


def _decode_batch(llm: Llama, seqs: list[list[int]]) -> list[np.ndarray]:
    """One llama_decode of several sequences (ids 0..n-1); the logits of each sequence's last token."""
    n = sum(len(s) for s in seqs)
    batch = lc.llama_batch_init(n, 0, len(seqs))
    i = 0
    last = []
    for sid, seq in enumerate(seqs):
        for pos, tok in enumerate(seq):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0] = sid
            batch.logits[i] = pos == len(seq) - 1
            i += 1
        last.append(i - 1)
    batch.n_tokens = n
    assert lc.llama_decode(llm.ctx, batch) == 0
    n_vocab = lc.llama_vocab_n_tokens(llm._model.vocab)
    out = [np.ctypeslib.as_array(lc.llama_get_logits_ith(llm.ctx, j), shape=(n_vocab,)).astype(np.float64).copy()
           for j in last]
    lc.llama_batch_free(batch)
    return out


def test_batch_of_several_sequences(split_pair, make_split) -> None:  # type: ignore[no-untyped-def]
    """Two sequences in one batch get the logits each gets alone, with the split active (r = 1)."""
    # preset cpu-q8 (Q8_0 attention): the cpu preset's Q4_K attention is repacked on this CPU, whose kernels take
    # rows in groups of 4 (gemm) and the rest one by one (gemv) with different rounding, so stock llama.cpp's rows
    # already depend on the batch they are in (a random-weight model amplifies it); Q8_0 has one kernel for both
    _, wq, wr = make_split(split_pair[0].name.split("-")[1], "cpu-q8")
    toks = _tokens(wq)
    seqs = [toks[:9], toks[9:20]]
    both = Llama(wq, n_ctx=128, verbose=False, residual_path=wr, n_critical=1, n_seq_max=2)
    together = _decode_batch(both, seqs)
    counters = both.moe_counters()
    both.close()
    for seq, got in zip(seqs, together, strict=True):
        alone = Llama(wq, n_ctx=128, verbose=False, residual_path=wr, n_critical=1)
        ref = _decode_batch(alone, [seq])[0]
        alone.close()
        assert _rel(got, ref) < 1e-3
    first = counters[0]
    assert first.tokens == sum(map(len, seqs)) and first.critical_slots == first.tokens
