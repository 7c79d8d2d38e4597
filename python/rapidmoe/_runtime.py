"""Load our native libraries exactly once: llama_cpp's ctypes layer and rapidmoe._core share one libllama.

The wheel puts our libllama/libggml in llama_cpp/lib, where llama_cpp looks by default, and _core's RPATH
points at the same folder. The only way to get a second copy is LLAMA_CPP_LIB_PATH; we refuse that here.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)


def _import_llama_cpp() -> ModuleType:
    override = os.environ.get("LLAMA_CPP_LIB_PATH")
    if override:
        log.warning("ignoring LLAMA_CPP_LIB_PATH=%s: rapidmoe runs on its own libllama", override)
        del os.environ["LLAMA_CPP_LIB_PATH"]
    import llama_cpp  # noqa: PLC0415 - must follow the environment fix above

    return llama_cpp


llama_cpp = _import_llama_cpp()
from . import _core  # noqa: E402  - after llama_cpp so both resolve the same files

LIB_DIR = Path(llama_cpp.__file__).resolve().parent / "lib"


def loaded_library_path() -> Path:
    """The libllama file the ctypes layer loaded."""
    return Path(llama_cpp.llama_cpp._lib._name).resolve()


def check_single_instance() -> None:
    """Raise ImportError when the ctypes layer's libllama is not ours (e.g. another llama_cpp was imported)."""
    lib = llama_cpp.llama_cpp._lib
    if not hasattr(lib, "rapidmoe_llama_build_info"):
        raise ImportError(
            f"llama_cpp loaded {loaded_library_path()}, which is not RapidMoE's libllama; "
            "import rapidmoe before llama_cpp and do not set LLAMA_CPP_LIB_PATH")


check_single_instance()
