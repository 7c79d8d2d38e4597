"""One libllama in the process: llama_cpp's ctypes layer and rapidmoe._core share it, and it is ours."""
from __future__ import annotations

import ast
import ctypes
import os
import subprocess
import sys
from pathlib import Path

import rapidmoe
from rapidmoe import _core, llama_cpp
from rapidmoe._runtime import LIB_DIR, loaded_library_path


def _mapped(name: str) -> set[str]:
    maps = Path("/proc/self/maps").read_text().splitlines()
    return {line.split()[-1] for line in maps if line.split()[-1].endswith(name) or f"/{name}." in line}


def test_ctypes_and_core_share_one_library_instance() -> None:
    add = llama_cpp.llama_cpp._lib.rapidmoe_llama_probe_add
    add.argtypes = [ctypes.c_int64]
    add.restype = ctypes.c_int64
    start = _core.probe_add(0)
    assert add(7) == start + 7          # ctypes writes ...
    assert _core.probe_add(0) == start + 7  # ... and _core reads the same counter
    assert _core.probe_add(-7) == start
    assert add(0) == start


def test_only_our_libraries_are_mapped() -> None:
    for name in ("libllama.so", "libggml-base.so", "libggml.so"):
        paths = {Path(p).resolve() for p in _mapped(name)}
        assert len(paths) == 1, f"{name} mapped from {paths}"
        assert next(iter(paths)).parent == LIB_DIR.resolve()
    assert loaded_library_path().parent == LIB_DIR.resolve()


def test_build_is_ours() -> None:
    info = _core.build_info()
    assert info.startswith(f"rapidmoe {rapidmoe.__version__} (llama.cpp ")
    assert "CPU" in _core.system_info()
    names = [n for n, _ in _core.buffer_types()]
    assert "CPU" in names


def test_foreign_lib_path_is_ignored(tmp_path: Path) -> None:
    """LLAMA_CPP_LIB_PATH is llama-cpp-python's variable: rapidmoe's private ctypes layer does not follow it (its own
    libllama either way) and leaves it set for a llama-cpp-python in the same process."""
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(tmp_path))
    code = ("import os, rapidmoe, rapidmoe._runtime as r; print(r.loaded_library_path()); "
            "print(os.environ['LLAMA_CPP_LIB_PATH']); print(r.llama_cpp.__name__)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lib, var, name = out.stdout.split()
    assert Path(lib).parent == LIB_DIR.resolve() and var == str(tmp_path) and name == "rapidmoe._llama_cpp"


def test_core_ships_type_stubs() -> None:
    """nanobind's stubgen output is installed beside _core and names every binding; the package is marked typed."""
    stub = Path(_core.__file__).with_name("_core.pyi")
    assert stub.is_file(), f"no stub beside {_core.__file__}"
    tree = ast.parse(stub.read_text())
    declared = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    public = {n for n in dir(_core) if not n.startswith("_") and callable(getattr(_core, n))}
    assert public and public <= declared, sorted(public - declared)
    assert (Path(rapidmoe.__file__).parent / "py.typed").is_file()
