"""Our Q3_K dot product (patch 0010, ops/mul-mat/cpu/rapidmoe-vecdot-q3k.cpp) against upstream's kernel bit for bit, in
both of its SIMD paths: the file is compiled into a small program twice, for this CPU (its AVX-512 path where the
CPU has AVX-512 BW/VL) and for AVX2 alone (x86-64-v3), and each is compared with the ggml-cpu library's
ggml_vec_dot_q3_K_q8_K run with RAPIDMOE_VEC_DOT_Q3_K=0 (upstream's AVX2 kernel). tools/kernel_cost.py --check
(test_cpu_kernels.py) compares whole matmuls with the stock build."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import pytest
from testkit import ROOT

from rapidmoe import _core
from rapidmoe._runtime import LIB_DIR

GGML = ROOT / "vendor" / "llama.cpp" / "ggml"
EXT = ROOT / "src" / "rapidmoe_ggml" / "ops" / "mul-mat" / "cpu"
CHECK = Path(__file__).parent / "native" / "vec_dot_q3k_check.cpp"

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or "AVX2 = 1" not in _core.system_info(),
                                reason="the kernel is x86 with AVX2 or AVX-512")


def _run(exe: Path, march: str, ext: Path = EXT) -> subprocess.CompletedProcess[str]:
    """The check program built from ext's kernel file for `march`, run against upstream's kernel in the library."""
    subprocess.run(["g++", "-O2", "-std=c++17", f"-march={march}", str(CHECK), str(ext / "rapidmoe-vecdot-q3k.cpp"),
                    f"-I{GGML / 'include'}", f"-I{GGML / 'src'}", f"-I{ext}", f"-L{LIB_DIR}", "-lggml-cpu",
                    "-lggml-base", f"-Wl,-rpath,{LIB_DIR}", "-o", str(exe)], check=True)
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAPIDMOE_VEC_DOT_Q3_K": "0"})


@pytest.mark.parametrize("march", ["native", "x86-64-v3"])
def test_q3k_vec_dot_matches_upstream_bit_for_bit(tmp_path: Path, march: str) -> None:
    """3,000 random rows of 1-16 blocks (every byte random, -128 in the activations, scales of both signs)."""
    out = _run(tmp_path / f"check-{march}", march)
    assert out.returncode == 0 and "rows 3000 mismatches 0" in out.stdout, out.stdout + out.stderr


def test_q3k_vec_dot_check_can_fail(tmp_path: Path) -> None:
    """The comparison sees a wrong result: a copy of the source whose scales are off by one (32 subtracted as 31)
    against upstream's kernel reports mismatches and fails."""
    src = (EXT / "rapidmoe-vecdot-q3k.cpp").read_text()
    # both SIMD paths' scale offsets (the AVX-512 decode's and the AVX2 one's), whichever this CPU compiles
    broken = src.replace("_mm256_set1_epi16(32))", "_mm256_set1_epi16(31))").replace("_mm_set1_epi8(32))",
                                                                                       "_mm_set1_epi8(31))")
    assert src.count("(32))") == 2 and broken.count("(31))") == 2
    (tmp_path / "rapidmoe-vecdot-q3k.cpp").write_text(broken)
    (tmp_path / "rapidmoe-vecdot-q3k.h").write_text((EXT / "rapidmoe-vecdot-q3k.h").read_text())
    out = _run(tmp_path / "check-broken", "native", tmp_path)
    assert out.returncode == 1 and "mismatches 0" not in out.stdout, out.stdout
