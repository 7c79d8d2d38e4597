#!/usr/bin/env python3
"""Build STOCK llama.cpp (the same pinned tarball, none of our patches) for tests and benchmarks.

Stock is the reference our numbers are compared against in the same run. The build lives in
build/stock/ (git-ignored) and is reused; only the requested targets are built.
Usage: python tools/stock_llama.py [TARGET ...]   (default: llama; prints the bin folder; test-* targets such as
test-llama-archs switch llama.cpp's tests on in that build)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
STOCK = ROOT / "build" / "stock"


def _fetch_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fetch_upstream",
                                                  ROOT / "src" / "rapidmoe_ggml" / "fetch_upstream.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def no_amx_flags() -> list[str]:
    """The compile flags that keep llama.cpp's AMX kernels out, as our own build does by default (RAPIDMOE_AMX in
    CMakeLists.txt: GCC 12 miscompiles them into a SIGSEGV); nothing where the compiler has no such flag."""
    probe = subprocess.run(["cc", "-mno-amx-tile", "-x", "c", "-E", "-", "-o", os.devnull], input=b"",
                           capture_output=True)
    if probe.returncode != 0:
        return []
    flags = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    return [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]


def build_stock(targets: list[str], jobs: int | None = None, quiet: bool = True) -> Path:
    """Configure (once) and build the given targets of unpatched llama.cpp; returns the folder with binaries/libs."""
    fetch = _fetch_module()
    src = STOCK / "src"
    build = STOCK / "build"
    if not (src / "llama.cpp" / "CMakeLists.txt").exists():
        sdist = fetch.ensure_sdist(ROOT / "vendor")
        fetch.extract_pristine(sdist, src)
    out = subprocess.DEVNULL if quiet else None
    amx = no_amx_flags()
    if not (build / "build.ninja").exists() and not (build / "Makefile").exists():
        gen = ["-G", "Ninja"] if subprocess.run(["ninja", "--version"], capture_output=True).returncode == 0 else []
        subprocess.run(["cmake", "-S", str(src / "llama.cpp"), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release",
                        "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=ON",
                        "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", *amx],
                       check=True, stdout=out)
    cache = build / "CMakeCache.txt"
    if amx and "-mno-amx-tile" not in cache.read_text():  # configured before the AMX flags: the same flags as ours
        subprocess.run(["cmake", "-S", str(src / "llama.cpp"), "-B", str(build), *amx], check=True, stdout=out)
    if any(t.startswith("test-") for t in targets) and "LLAMA_BUILD_TESTS:BOOL=ON" not in cache.read_text():
        # llama.cpp's test programs (test-llama-archs writes its random-weight models per architecture)
        subprocess.run(["cmake", "-S", str(src / "llama.cpp"), "-B", str(build), "-DLLAMA_BUILD_TESTS=ON"],
                       check=True, stdout=out)
    cmd = ["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs or os.cpu_count() or 2),
           "--target", *targets]
    subprocess.run(cmd, check=True, stdout=out)
    return build / "bin"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("targets", nargs="*", default=["llama"])
    ap.add_argument("-j", "--jobs", type=int, default=None)
    args = ap.parse_args()
    print(build_stock(args.targets, args.jobs, quiet=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
