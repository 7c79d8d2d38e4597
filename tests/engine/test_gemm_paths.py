"""Our repacked Q2_K and Q4_K gemms (patch 0008, ops/mul-mat/cpu/rapidmoe-gemm-q2k.cpp, -q4k.cpp) against the library's
repacked gemvs bit for bit, in both SIMD paths: the kernel files are compiled into a small program twice, for this
CPU (the AVX-512 VNNI paths where the CPU has AVX-512 VNNI, BW and VL) and for AVX2 alone (x86-64-v3), and each
compares its gemm with ggml_gemv_q2_K_8x8_q8_K / ggml_gemv_q4_K_8x8_q8_K of the ggml-cpu library on every
activation row. tools/kernel_cost.py --check (test_cpu_kernels.py) compares whole matmuls with the stock build."""
from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import pytest
from testkit import ROOT

from rapidmoe import _core
from rapidmoe._runtime import LIB_DIR

GGML = ROOT / "vendor" / "llama.cpp" / "ggml"
EXT = ROOT / "src" / "rapidmoe_ggml" / "ops" / "mul-mat" / "cpu"
COMMON = ROOT / "src" / "rapidmoe_ggml" / "ops" / "common" / "cpu"  # rapidmoe-simd.h
CHECK = Path(__file__).parent / "native" / "gemm_check.cpp"
KERNELS = ("rapidmoe-gemm-q2k.cpp", "rapidmoe-gemm-q4k.cpp")

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or "AVX2 = 1" not in _core.system_info(),
                                reason="the kernels are x86 with AVX2 or AVX-512")


def _run(exe: Path, march: str, ext: Path = EXT) -> subprocess.CompletedProcess[str]:
    """The check program built from ext's kernel files for `march`, run against the library's gemvs."""
    subprocess.run(["g++", "-O2", "-std=c++17", f"-march={march}", str(CHECK), *(str(ext / k) for k in KERNELS),
                    f"-I{GGML / 'include'}", f"-I{GGML / 'src'}", f"-I{GGML / 'src' / 'ggml-cpu'}", f"-I{ext}",
                    f"-I{COMMON}", f"-L{LIB_DIR}", "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{LIB_DIR}", "-o",
                    str(exe)], check=True)
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("march", ["native", "x86-64-v3"])
def test_gemms_match_the_gemv_bit_for_bit(tmp_path: Path, march: str) -> None:
    """Six shapes (1-8 blocks a row, 4-128 rows, 8-32 columns) of random blocks and rows, per type."""
    out = _run(tmp_path / f"check-{march}", march)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("q2_K", "q4_K"):
        assert f"{name} outputs 3968 mismatches 0" in out.stdout, out.stdout


def test_gemm_check_can_fail(tmp_path: Path) -> None:
    """The comparison sees a wrong result: a copy whose shared column loop adds the mins term instead of subtracting
    it (every path and type goes through it) reports mismatches for both types and fails."""
    for name in (*KERNELS, "rapidmoe-gemm.h"):
        (tmp_path / name).write_text((EXT / name).read_text())
    (tmp_path / "rapidmoe-simd.h").write_text((COMMON / "rapidmoe-simd.h").read_text())
    loop = (EXT / "rapidmoe-gemm-loop.h").read_text()
    difference = "_mm256_sub_ps(acc[2 * row], acc[2 * row + 1])"
    broken = loop.replace(difference, difference.replace("sub", "add"))
    assert broken != loop
    (tmp_path / "rapidmoe-gemm-loop.h").write_text(broken)
    out = _run(tmp_path / "check-broken", "native", tmp_path)
    assert out.returncode == 1 and "q2_K outputs 3968 mismatches 0" not in out.stdout, out.stdout
    assert "q4_K outputs 3968 mismatches 0" not in out.stdout, out.stdout
