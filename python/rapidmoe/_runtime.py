"""Load our native libraries exactly once: the ctypes layer and rapidmoe._core share one libllama.

The ctypes layer is llama-cpp-python's Python package, shipped privately as `rapidmoe._llama_cpp` (its self-imports
rewritten at build time, src/rapidmoe_ggml/private_pylayer.py), with our libllama/libggml in rapidmoe/_llama_cpp/lib
where it looks, and _core's RPATH pointing at the same folder. It never reads LLAMA_CPP_LIB_PATH, and a
llama-cpp-python installed beside RapidMoE (the top-level `llama_cpp`, with its own libllama) is a separate package
that neither replaces nor is replaced by ours.
"""
from __future__ import annotations

from pathlib import Path

from . import _llama_cpp as llama_cpp

LIB_DIR = Path(llama_cpp.__file__).resolve().parent / "lib"

# after the ctypes layer, which opened lib/libllama.so: _core's libllama.so.0 then resolves to that same loaded
# library (the loader matches its soname); the other order would map the file twice
from . import _core as _core  # noqa: E402

__all__ = ["LIB_DIR", "_core", "check_single_instance", "llama_cpp", "loaded_library_path"]


def loaded_library_path() -> Path:
    """The libllama file the ctypes layer loaded."""
    return Path(llama_cpp.llama_cpp._lib._name).resolve()


def check_single_instance() -> None:
    """Raise ImportError when the ctypes layer's libllama is not ours (a broken or mixed installation)."""
    lib = llama_cpp.llama_cpp._lib
    if not hasattr(lib, "rapidmoe_llama_build_info"):
        raise ImportError(
            f"rapidmoe's ctypes layer loaded {loaded_library_path()}, which is not RapidMoE's libllama; "
            "reinstall rapidmoe")


check_single_instance()
