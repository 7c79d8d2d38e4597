"""RapidMoE: fast Mixture-of-Experts inference on llama.cpp for machines whose GPU memory is too small.

Public API: `Llama` (a drop-in for llama_cpp.Llama on our patched libllama, with MoE placement knobs),
RESplit conversion (`rapidmoe.resplit`), synthetic models (`rapidmoe.synthetic`) and `rapidmoe-cli`.
The native libraries load on first use of `Llama`/`llama_cpp`/`_core`, so pure-Python parts import without them.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import ModelFileError, RapidMoEError

__version__ = "0.1.0"

if TYPE_CHECKING:
    import rapidmoe._core as _core

    from ._runtime import llama_cpp
    from .llama import Llama, Timings

_LAZY = {"Llama": ".llama", "Timings": ".llama", "llama_cpp": "._runtime", "_core": "._runtime"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'rapidmoe' has no attribute {name!r}")


__all__ = ["Llama", "ModelFileError", "RapidMoEError", "Timings", "__version__", "_core", "llama_cpp"]
