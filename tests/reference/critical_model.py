"""The r = k reference of split routing: the .wq.gguf with its routed experts replaced, in F32, by what a critical
slot computes with (gate/up: deq(WQ) + deq(WR); down: the copy, or deq(WQ) + deq(WR) in residual mode), dequantized
by gguf-py's numpy code (not ggml's), everything else as stored. Shared by the split-routing, mix and refine tests."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as np_dequantize

from rapidmoe.ggufio import GGUFFile, Tensor, copy_metadata


def _dq(t: Tensor) -> np.ndarray:
    return np.asarray(np_dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float64)


def write_with_experts(wq: Path, out: Path, experts: Callable[[Tensor], np.ndarray]) -> None:
    """The .wq.gguf with each routed-expert tensor replaced by experts(tensor) in F32, everything else as stored."""
    base = GGUFFile(wq)
    w = GGUFWriter(out, arch=str(base.get("general.architecture")))
    copy_metadata(base, w)
    for t in base.tensors:
        if t.name.endswith("_exps.weight"):
            w.add_tensor(t.name, experts(t).astype(np.float32))
        elif t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(t.name, np.array(t.data))
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_critical_model(wq: Path, wr: Path, out: Path) -> None:
    sides = {t.name: t for t in GGUFFile(wr).tensors}

    def critical(t: Tensor) -> np.ndarray:
        stem = t.name.removesuffix(".weight")
        return _dq(sides[f"{stem}.hi"]) if f"{stem}.hi" in sides else _dq(t) + _dq(sides[f"{stem}.wr"])

    write_with_experts(wq, out, critical)
