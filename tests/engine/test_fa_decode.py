"""Our flash attention for one decode token (patch 0011, ops/flash-attn/cpu/rapidmoe-fa-decode.cpp) against a float64
reference: a small program (native/fa_decode_check.cpp) runs GGML_OP_FLASH_ATTN_EXT through the library's CPU
backend on decode-shaped inputs (Qwen3-MoE's 16 query heads on 4 KV heads, groupings of 1 to 16, masked positions,
700 cache positions; F16 and Q8_0 caches) and reports each case's largest error relative to the output's
magnitude; run with RAPIDMOE_FA_DECODE=0 it measures llama.cpp's kernel on the same inputs."""
from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

import pytest
from testkit import ROOT

from rapidmoe import _core
from rapidmoe._runtime import LIB_DIR

CHECK = Path(__file__).parent / "native" / "fa_decode_check.cpp"
OURS = ("gqa4-d128-kv37", "gqa4-d128-kv700-masked", "gqa8-d64-kv256", "mha-d80-kv100", "gqa16-d128-kv300",
        "seven-rows", "gqa4-d128-kv500-t1", "causal-gqa8", "deep-gqa4-kv1800", "sparse-deep")
Q8_0_CACHE = ("q8-gqa8-d128-kv600", "q8k-gqa4-d128-kv300", "q8v-gqa4-d64-kv300", "q8-prompt-rows", "causal-gqa4-q8",
              "deep-q8-gqa4-kv1800", "causal-deep-q8")
Q8_0_K = tuple(case for case in Q8_0_CACHE if not case.startswith("q8v"))
# our AVX-512 kernel quantizes the query for integer dot products with a Q8_0 K cache where the build has VNNI
INT_DOTS = "AVX512_VNNI = 1" in _core.system_info() and "AVX512 = 1" in _core.system_info()
LEFT_TO_UPSTREAM = ("gqa3", "sets-below-threads")

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or "AVX2 = 1" not in _core.system_info(),
                                reason="the kernel is x86 with AVX2 (F16C, FMA)")


@pytest.fixture(scope="module")
def errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, float]]:
    """Each case's relative error, with our kernel ("ours") and with RAPIDMOE_FA_DECODE=0 ("upstream")."""
    exe = tmp_path_factory.mktemp("fa") / "fa_decode_check"
    ggml = ROOT / "vendor" / "llama.cpp" / "ggml"
    subprocess.run(["g++", "-O2", "-std=c++17", str(CHECK), f"-I{ggml / 'include'}", f"-L{LIB_DIR}", "-lggml",
                    "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{LIB_DIR}", "-o", str(exe)], check=True)
    result = {}
    for name, env in (("ours", {}), ("upstream", {"RAPIDMOE_FA_DECODE": "0"})):
        env_all = {k: v for k, v in os.environ.items() if k != "RAPIDMOE_FA_DECODE"} | env
        out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env_all, check=True).stdout
        assert "checked 20" in out, out
        result[name] = {m[1]: float(m[2]) for m in re.finditer(r"\ncase (\S+) max_rel_err (\S+)", "\n" + out)}
        result[f"{name} quantized"] = {m[1]: float(m[2]) for m in re.finditer(r"qcase (\S+) max_rel_err (\S+)", out)}
        for what in ("threads", "alone"):
            result[f"{name} {what}"] = {m[1]: float(m[2])
                                        for m in re.finditer(rf"{what} (\S+) max_abs_diff (\S+)", out)}
    return result


def test_decode_attention_matches_the_float64_reference(errors: dict[str, dict[str, float]]) -> None:
    """Ours within float rounding of the reference (F32 throughout); llama.cpp's kernel, which rounds the query and
    its accumulator through F16, about 1e-3 off on the same inputs, so a case that fell back would fail here."""
    for case in OURS:
        assert errors["ours"][case] < 1e-5, (case, errors)
        assert 1e-4 < errors["upstream"][case] < 2e-2, (case, errors)
    # 70 query rows: upstream runs its tiled kernel (F32 too), ours still takes them (a token's attention must not
    # depend on the batch it came in); both within float rounding, by different kernels
    assert errors["ours"]["prompt-rows"] < 1e-5 and errors["upstream"]["prompt-rows"] < 1e-5, errors
    assert errors["ours"]["prompt-rows"] != errors["upstream"]["prompt-rows"], errors


def test_q8_0_cache_matches_the_float64_reference(errors: dict[str, dict[str, float]]) -> None:
    """A Q8_0 cache (K, V or both: -ctk/-ctv q8_0) takes our kernel too. With a Q8_0 K and VNNI, the query is
    quantized as llama.cpp's kernel quantizes it (blocks of 32, scale max|x| / 127) for integer dot products: within
    float rounding of the float64 reference on that quantized query, and as far from the reference on the exact
    query as llama.cpp's kernel is; without VNNI (or a Q8_0 V alone) the query stays F32, within float rounding of
    the exact reference. A case that fell back to llama.cpp's kernel (F16 accumulators) would fail the first."""
    for case in Q8_0_CACHE:
        int_dots = INT_DOTS and case in Q8_0_K
        exact = errors["ours quantized"][case] if int_dots else errors["ours"][case]
        assert exact < 1e-5, (case, errors)
        assert errors["upstream"][case] != errors["ours"][case], (case, errors)
        if int_dots:  # the query's rounding: the size of upstream's error, not more
            assert errors["ours"][case] < 1.5 * errors["upstream"][case] + 1e-4, (case, errors)
    for case in Q8_0_CACHE[:3]:  # decode steps: upstream's one-row kernel
        assert errors["upstream"][case] > 1e-4, (case, errors)


def test_the_thread_count_changes_no_bit(errors: dict[str, dict[str, float]]) -> None:
    """1 to 4 threads split the same node into work items of 4, 2 or 1 KV heads (and, for 9 query rows, deal them out
    or claim them; a decode step over several chunks of 512 cells spreads the chunks over the threads and folds them
    after a barrier): every output the same bits, for F16 and Q8_0 caches and chunks without a visible cell (a
    token's attention must not depend on how the work was cut)."""
    assert set(errors["ours threads"]) == {"threads-f16", "threads-q8", "threads-rows", "threads-deep-q8",
                                           "threads-sparse"}, errors
    assert all(d == 0.0 for d in errors["ours threads"].values()), errors


def test_a_row_gets_the_same_bits_in_a_batch_and_alone(errors: dict[str, dict[str, float]]) -> None:
    """Every query row of a batch computed again alone (its mask row, one query row): the same bits, for batches whose
    rows share passes over the cache (a causal prompt after a context, F16 and Q8_0) and for ones whose rows see
    unrelated cells (taken one at a time); llama.cpp's tiled kernel for 64 rows and more differs from its own one-row
    kernel on the same row (what made a server's repeated request and batched embeddings differ)."""
    alone = errors["ours alone"]
    assert set(alone) == {"seven-rows", "prompt-rows", "causal-gqa8", "causal-gqa4-q8", "q8-prompt-rows",
                          "causal-deep-q8"}, errors
    assert all(d == 0.0 for d in alone.values()), errors
    assert errors["upstream alone"]["prompt-rows"] > 0.0, errors


def test_other_shapes_are_left_to_llama_cpp(errors: dict[str, dict[str, float]]) -> None:
    """3 query heads per KV head, fewer sets of query heads than threads: llama.cpp's kernel in both runs (the
    same error to the digit), and still correct."""
    for case in LEFT_TO_UPSTREAM:
        assert errors["ours"][case] == errors["upstream"][case], (case, errors)
        assert errors["ours"][case] < 2e-2, (case, errors)
