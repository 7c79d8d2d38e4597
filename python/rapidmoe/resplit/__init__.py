"""RESplit: the bit-level split of every routed expert into WQ (low-bit, a stock-runnable GGUF) and WR
(the quantized residual, in a sidecar GGUF). Conversion, presets, importance matrices, the sidecar format.
Collecting an importance matrix runs the model: rapidmoe.calibration.imatrix.collect_imatrix.
"""
from __future__ import annotations

from .convert import ConvertResult, convert
from .imatrix import Imatrix, read_imatrix, write_imatrix
from .presets import PRESETS, Preset, get_preset
from .sidecar import check_pair, read_sidecar_meta

__all__ = ["PRESETS", "ConvertResult", "Imatrix", "Preset", "check_pair", "convert",
           "get_preset", "read_imatrix", "read_sidecar_meta", "write_imatrix"]
