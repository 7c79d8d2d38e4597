"""RapidMoE: fast Mixture-of-Experts inference on llama.cpp for machines whose GPU memory is too small.

Public API: `Llama` (a drop-in for llama_cpp.Llama on our patched libllama, with MoE placement knobs),
synthetic model generation (`rapidmoe.synthetic`) and the `rapidmoe-cli` command line.
"""
from __future__ import annotations

from ._runtime import _core, llama_cpp
from .errors import ModelFileError, RapidMoEError
from .llama import Llama, Timings

__version__ = "0.1.0"

__all__ = ["Llama", "Timings", "ModelFileError", "RapidMoEError", "llama_cpp", "_core", "__version__"]
