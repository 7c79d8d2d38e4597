"""The refine codec's matmul (sidecar codec "q3k-refine1"; ops/refine/cpu/rapidmoe-refine.cpp) against numpy.

The weights are stock ggml Q3_K blocks (ggml's own quantizer; their base values from ggml's own dequantization) with a
random refinement bit per weight; numpy decodes the sub-block scales itself and adds s_j/4 * (2t - 1). The activation
goes through Q8_K as the kernel's does (numpy reproduces ggml's reference quantize_row_q8_K), so the op must match the
float64 product to float rounding, not merely to quantization error.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from reference.refine import Q3_K, q8k_roundtrip, refined

from rapidmoe import _core


def _experts(rng: np.random.Generator, n_as: int, n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    w = rng.standard_normal((n_as * n_out, n_in)).astype(np.float32) * rng.uniform(0.01, 3.0, (n_as * n_out, 1))
    raw = _core.quantize(w.astype(np.float32), Q3_K).reshape(n_as, n_out, -1)
    bits = rng.integers(0, 256, size=(n_as, n_out, n_in // 8), dtype=np.uint8)
    return raw, bits


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("n_b", [1, 3])
def test_refine_mul_mat_id_matches_numpy(n_b: int) -> None:
    """Critical slots: the refined experts times the Q8_K activation; ids < 0: zero rows (a token with none, too)."""
    rng = np.random.default_rng(7)
    n_as, n_out, n_in, n_tok, k = 6, 40, 512, 5, 3
    raw, bits = _experts(rng, n_as, n_out, n_in)
    b = rng.standard_normal((n_tok, n_b, n_in)).astype(np.float32)
    ids = np.stack([rng.permutation(n_as)[:k] for _ in range(n_tok)]).astype(np.int32)
    ids[rng.random((n_tok, k)) < 0.4] = -1
    ids[0, :] = -1
    ids[1, :] = [2, 2, 2]  # one expert repeated within a token: every slot still computed
    got = _core.refine_mul_mat_id(raw, bits, n_in, b, ids, n_threads=2)
    w = refined(raw, bits, n_in)
    xq = q8k_roundtrip(b)
    for t in range(n_tok):
        for j in range(k):
            if ids[t, j] < 0:
                np.testing.assert_array_equal(got[t, j], 0.0)
            else:
                ref = w[ids[t, j]] @ xq[t, j % n_b]
                assert _rel(got[t, j], ref) < 1e-5, (t, j)
    # and against the unquantized activation: Q8_K's error only
    full = np.einsum("tkoi,tki->tko", w[np.maximum(ids, 0)], b[:, np.arange(k) % n_b].astype(np.float64))
    keep = ids >= 0
    assert _rel(got[keep], full[keep]) < 2e-2


def test_refine_threads_give_the_same_bits() -> None:
    """Each output is one row's dot product whatever the thread split: 1, 2 and 3 threads agree bit for bit."""
    rng = np.random.default_rng(3)
    raw, bits = _experts(rng, 4, 37, 256)
    b = rng.standard_normal((9, 1, 256)).astype(np.float32)
    ids = rng.integers(-1, 4, size=(9, 2)).astype(np.int32)
    runs = [_core.refine_mul_mat_id(raw, bits, 256, b, ids, n_threads=n) for n in (1, 2, 3)]
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0], runs[2])


def test_refine_simd_kernel_equals_the_scalar_reference() -> None:
    """The SIMD dot (AVX2 where built) gives the scalar reference's bits: exact integer sums, blocks added in order.
    Rows cover extreme scales (ggml's Q3_K of spiky rows), all-zero and all-one bit planes and zero rows."""
    rng = np.random.default_rng(11)
    n = 1024
    rows = [rng.standard_normal(n), np.zeros(n), np.r_[np.full(n - 1, 1e-3), 50.0],
            rng.standard_normal(n) * rng.integers(0, 2, n) * 30]
    for _ in range(60):
        rows.append(rng.standard_normal(n) * 10 ** rng.uniform(-3, 2))
    w = np.asarray(rows, dtype=np.float32)
    raw = _core.quantize(w, Q3_K)
    planes = [np.zeros(n // 8, np.uint8), np.full(n // 8, 255, np.uint8)]
    for i, row in enumerate(raw):
        bits = planes[i % 2] if i < 4 else rng.integers(0, 256, n // 8, dtype=np.uint8)
        x = (rng.standard_normal(n) * 10 ** rng.uniform(-2, 2)).astype(np.float32)
        fast = _core.refine_dot(row, bits, x, reference=False)
        ref = _core.refine_dot(row, bits, x, reference=True)
        assert np.float32(fast).tobytes() == np.float32(ref).tobytes(), i
        expect = refined(row[None], bits[None], n)[0] @ q8k_roundtrip(x)
        assert abs(ref - expect) <= 1e-5 * max(abs(expect), np.abs(refined(row[None], bits[None], n)).max()), i


def test_refine_op_refuses_inconsistent_shapes() -> None:
    rng = np.random.default_rng(0)
    raw, bits = _experts(rng, 2, 8, 256)
    b = np.zeros((1, 1, 256), np.float32)
    ids = np.zeros((1, 1), np.int32)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        _core.refine_mul_mat_id(raw, bits[:, :, :16], 256, b, ids)
    with pytest.raises(ValueError, match="inconsistent shapes"):
        _core.refine_dot(raw[0, 0], bits[0, 0], np.zeros(512, np.float32))


def test_batched_rows_give_the_single_row_kernel_s_bits() -> None:
    """A prompt batch: many tokens per expert, computed up to 8 at a time from each unpacked weight block, give
    exactly what the one-row kernel gives for each token alone (the same integer sums, added in the same order)."""
    rng = np.random.default_rng(5)
    n_as, n_out, n_in, n_tok = 2, 24, 512, 21
    raw, bits = _experts(rng, n_as, n_out, n_in)
    b = rng.standard_normal((n_tok, 1, n_in)).astype(np.float32)
    ids = rng.integers(0, n_as, size=(n_tok, 2)).astype(np.int32)
    got = _core.refine_mul_mat_id(raw, bits, n_in, b, ids, n_threads=2)
    for t in range(n_tok):
        for j in range(2):
            one = [_core.refine_dot(raw[ids[t, j], r], bits[ids[t, j], r], b[t, 0]) for r in range(n_out)]
            assert np.asarray(one, np.float32).tobytes() == got[t, j].tobytes(), (t, j)


def _has_q3k_layout() -> bool:
    return "AVX512_VNNI = 1" in _core.system_info()  # patch 0021 repacks Q3_K where our VNNI gemv is built


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return {w for line in f if line.startswith("flags") for w in line.split()}
    except OSError:
        return set()


@pytest.mark.parametrize("n_tok", [1, 21])
def test_repacked_wq_gives_the_plain_layout_s_bits(n_tok: int) -> None:
    """WQ in the CPU_REPACK buffer (our 8-row Q3_K layout, patch 0021): the op runs its 8-row kernel there (AVX-512
    BITALG: rapidmoe-refine-x8.cpp) or reads each row's bytes back from the interleave; either way every output is
    the plain layout's bit for bit, for a decode step (one token) and a prompt batch
    (tokens sharing experts: up to 8 activations per weight block), across thread splits that cut groups of 8 rows
    (3 threads over 40 rows), and extreme rows (ggml's Q3_K of spiky rows) among them; numpy agrees too."""
    if not _has_q3k_layout():
        pytest.skip("no repacked Q3_K layout in this build (needs AVX-512 VNNI)")
    if "avx512_bitalg" in _cpu_flags() and os.environ.get("RAPIDMOE_REFINE_X8", "1") != "0":
        assert _core.refine_x8_enabled()  # a native build on this CPU: the 8-row kernel is what runs below
    rng = np.random.default_rng(17)
    n_as, n_out, n_in, k = 4, 40, 768, 3
    raw, bits = _experts(rng, n_as, n_out, n_in)
    spiky = np.r_[np.full(n_in - 1, 1e-3), 50.0].astype(np.float32)
    raw[1, 5] = _core.quantize(spiky[None], Q3_K)[0]
    raw[2, 9] = _core.quantize(np.zeros((1, n_in), np.float32), Q3_K)[0]
    bits[3, 0] = 255
    b = rng.standard_normal((n_tok, 1, n_in)).astype(np.float32)
    ids = np.stack([rng.permutation(n_as)[:k] for _ in range(n_tok)]).astype(np.int32)
    ids[0, -1] = -1
    for threads in (1, 3):
        plain = _core.refine_mul_mat_id(raw, bits, n_in, b, ids, n_threads=threads)
        packed = _core.refine_mul_mat_id(raw, bits, n_in, b, ids, n_threads=threads, repacked=True)
        assert packed.tobytes() == plain.tobytes(), threads
    w, xq = refined(raw, bits, n_in), q8k_roundtrip(b)
    for t in range(n_tok):
        for j in range(k):
            if ids[t, j] >= 0:
                assert _rel(packed[t, j], w[ids[t, j]] @ xq[t, 0]) < 1e-5, (t, j)


def test_repacked_wq_needs_rows_in_groups_of_8() -> None:
    """Our layout takes 8 rows a group: a tensor of 12 rows has no repacked layout, and the op says so."""
    if not _has_q3k_layout():
        pytest.skip("no repacked Q3_K layout in this build (needs AVX-512 VNNI)")
    rng = np.random.default_rng(1)
    raw, bits = _experts(rng, 2, 12, 256)
    with pytest.raises(ValueError, match="no repacked layout"):
        _core.refine_mul_mat_id(raw, bits, 256, np.zeros((1, 1, 256), np.float32), np.zeros((1, 1), np.int32),
                                repacked=True)
