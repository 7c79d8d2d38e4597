"""Our CPU kernels (src/rapidmoe_ggml/ops/mul-mat/cpu, patches 0006-0008 and 0016-0018) against stock llama.cpp's, bit
for bit, in the same run, and our repacked gemms against the gemvs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from testkit import ROOT

from rapidmoe import _core


@pytest.mark.stock
def test_repacked_q2k_gemv_is_stocks_bit_for_bit(stock_bin: Path) -> None:
    """tools/kernel_cost.py --check: the same quantized weights and activations through our build's and the stock
    build's ggml (Q2_K, Q3_K and Q4_K, plain and repacked, routed experts and a dense matmul, 2 threads), every
    output float compared byte for byte (plain Q3_K runs our dot product in our build, patch 0010). On an AVX-512
    CPU the repacked Q2_K gemv is our kernel in our build and upstream's in the stock one; on an AVX2 CPU without
    AVX-512 only our build repacks Q2_K (patch 0006), and its repacked outputs must equal its plain layout's to
    float rounding. Batches (16 tokens routed to 4 of 8 experts, 18 dense rows) run the gemm: our Q2_K and Q4_K
    gemms (patch 0008) must give the gemv's bits for the experts' rows, and the dense rows' outputs must equal the
    plain layout's to float rounding. Q8_0: stock keeps it plain on x86, our build repacks it (patch 0016) with our
    gemv and gemm: equal to the plain vec_dot (upstream's, unchanged) to float rounding, the gemm the gemv's bits.
    Q6_K the same (patch 0017), and Q3_K (patch 0021: our own layout, where the build has AVX-512 VNNI). The
    single-row matmuls ("experts": one input row for every slot, "dense") run
    patch 0018's path in our build (no barrier inside the op) and the AVX-512 VNNI gemvs where the CPU has them."""
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_cost.py"), "--check",
                          "--types", "q2_K,q3_K,q4_K,q8_0,q6_K"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bit-identical in ours and stock" in out.stdout
    info = _core.system_info()
    if "AVX2 = 1" in info:  # our gemm runs on AVX2 and AVX-512 CPUs; elsewhere upstream's repacked kernels run
        assert ("gemm (batched rows) against gemv: bit-identical: experts x16 q2_K repacked; experts x16 q3_K repacked"
                "; experts x16 q4_K repacked; experts x16 q8_0 repacked; experts x16 q6_K repacked" in out.stdout
                if "AVX512_VNNI = 1" in info else
                "gemm (batched rows) against gemv: bit-identical: experts x16 q2_K repacked; experts x16 q4_K repacked"
                "; experts x16 q8_0 repacked; experts x16 q6_K repacked" in out.stdout), out.stdout
        for ty in ("q8_0", "q6_K", "q3_K") if "AVX512_VNNI = 1" in info else ("q8_0", "q6_K"):
            for m in (f"experts {ty}", f"dense {ty}", f"experts x16 {ty}", f"dense x18 {ty}"):
                assert f"{m} repacked: only in ours" in out.stdout, out.stdout
    if "AVX512 = 1" in info:  # stock llama.cpp repacks Q2_K on x86 only with AVX-512: both builds run it
        assert "q2_K repacked;" in out.stdout.split("\n")[0], out.stdout
    elif "AVX2 = 1" in info:  # ours also repacks it with AVX2 alone, and the stock build has no such layout
        assert "experts q2_K repacked: only in ours" in out.stdout and "within float rounding" in out.stdout, out.stdout


@pytest.mark.stock
def test_repacked_kernels_avx2_paths(stock_bin: Path) -> None:
    """RAPIDMOE_GEMM=avx2 runs our kernels' AVX2 code (256-bit, maddubs) on an AVX-512 CPU, the code every AVX2-only
    CPU runs: the Q2_K and Q4_K gemvs bit for bit with stock llama.cpp's (the AVX-512 VNNI gemvs are checked by the
    test above), Q8_0 and Q6_K against the plain vec_dot to float rounding, and every gemm the gemv's bits. Repacked
    Q3_K (AVX-512 VNNI builds only) runs its portable C there: the same checks as its VNNI gemv."""
    del stock_bin  # kernel_cost --check builds against both; the fixture makes sure the stock build exists
    info = _core.system_info()
    if "AVX2 = 1" not in info:
        pytest.skip("no AVX2: these kernels are not built for this CPU")
    env = {**os.environ, "RAPIDMOE_GEMM": "avx2"}
    q3k = "AVX512_VNNI = 1" in info  # our Q3_K layout exists
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_cost.py"), "--check", "--types",
                          "q2_K,q3_K,q4_K,q8_0,q6_K"], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bit-identical in ours and stock" in out.stdout, out.stdout
    compared = out.stdout.split("\n")[0]
    if "AVX512 = 1" in info:  # stock repacks Q2_K only with AVX-512; Q4_K on every AVX2 CPU
        assert "experts q2_K repacked;" in compared, out.stdout
    assert "experts q4_K repacked;" in compared and "dense q4_K repacked;" in compared, out.stdout
    assert ("gemm (batched rows) against gemv: bit-identical: experts x16 q2_K repacked; "
            + ("experts x16 q3_K repacked; " if q3k else "")
            + "experts x16 q4_K repacked; experts x16 q8_0 repacked; experts x16 q6_K repacked"
            in out.stdout), out.stdout
    for ty in ("q8_0", "q6_K", "q3_K") if q3k else ("q8_0", "q6_K"):
        assert f"dense {ty} repacked: only in ours" in out.stdout and "within float rounding" in out.stdout, out.stdout
