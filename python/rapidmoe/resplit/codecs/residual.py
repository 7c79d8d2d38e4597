"""The residual codec (the paper's): WR = q(W - deq(WQ)) in a ggml type for gate and up, and for down either the
same residual (down mode 'residual') or a higher-precision copy of down (mode 'copy'). A critical slot computes
deq(WQ) + deq(WR) (or the copy); every (de)quantization is ggml's own, through rapidmoe._core.

The sidecar is the classic one: `blk.N.ffn_<role>_exps.wr` (residuals) and `blk.N.ffn_down_exps.hi` (down's copy),
each with the base tensor's shape, and no rapidmoe.residual.codec key.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType

from ...ggml_types import bits_per_weight, fit_type, fits_rows, ggml_type, tensor_bytes
from ...moe_tensors import COPY, RESIDUAL
from .base import ENCODE_COPY, ENCODE_RESIDUAL, Compiled, Encoded, Shape, TensorTable, wr_types

if TYPE_CHECKING:
    from ..presets import MixEntry, Preset

# types the converter accepts for each role (the minimum set, plus what costs nothing to allow)
WQ_TYPES = ("IQ1_M", "IQ2_XXS", "IQ2_XS", "Q2_K", "IQ3_XXS", "Q3_K")
# a mix (per layer and role) may also give a tensor's WQ a Q4_K: the sensitive ones (calibration/mix.py)
MIX_WQ_TYPES = (*WQ_TYPES, "Q4_K")
WR_TYPES = ("Q2_K", "Q3_K", "Q4_K")
DOWN_COPY_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")


class ResidualCodec:
    """WQ + a quantized residual (or down's copy) in ggml types; row sizes fall back as llama-quantize's do."""

    name: str = "residual"
    title: str = "the residual codec"
    sidecar_id: str | None = None
    wq_types: tuple[str, ...] = WQ_TYPES
    wr_types: tuple[str, ...] = WR_TYPES
    down_modes: tuple[str, ...] = ("copy", "residual")
    no_mix: str | None = None
    cpu_experts: bool = False
    sidecar_repacks: bool = True

    def check_preset(self, preset: Preset) -> None:
        if preset.wr.upper() not in self.wr_types:
            raise ValueError(f"WR type {preset.wr} not supported; choose one of {', '.join(wr_types())}")
        if preset.down_mode == "copy" and preset.down_type.upper() not in DOWN_COPY_TYPES:
            raise ValueError(f"down copy type {preset.down_type} not supported; "
                             f"choose one of {', '.join(DOWN_COPY_TYPES)}")

    def check_mix(self, preset: Preset, entries: Sequence[MixEntry]) -> None:
        """Every mix entry in the types its role takes; a down copy better than its base."""
        for e in entries:
            if e.wq not in MIX_WQ_TYPES:
                raise ValueError(f"mix entry {e}: WQ type {e.wq} not supported; choose one of "
                                 f"{', '.join(MIX_WQ_TYPES)}")
            wq, hi = preset.expert_types(e.layer, e.role)
            if e.role == "down" and preset.down_mode == "copy":
                if hi not in DOWN_COPY_TYPES:
                    raise ValueError(f"mix entry {e}: down copy type {hi} not supported; choose one of "
                                     f"{', '.join(DOWN_COPY_TYPES)}")
                if bits_per_weight(hi) <= bits_per_weight(wq):
                    raise ValueError(f"mix entry {e}: down's copy ({hi}) would be no better than its base ({wq}); "
                                     f"give it a larger type (`{e.key()}={wq}/HI`)")
            elif hi not in self.wr_types:
                raise ValueError(f"mix entry {e}: WR type {hi} not supported; choose one of {', '.join(WR_TYPES)}")

    def sidecar_bits(self, ty: str) -> float:
        return bits_per_weight(ty)

    def fit_sidecar(self, ty: str, n_in: int) -> str:
        return fit_type(ty, n_in)

    def is_copy(self, role: str, preset: Preset) -> bool:
        return role == "down" and preset.down_mode == "copy"

    def sidecar_name(self, base_name: str, role: str, preset: Preset) -> str:
        stem = base_name.removesuffix(".weight")
        return f"{stem}.{COPY}" if self.is_copy(role, preset) else f"{stem}.{RESIDUAL}"

    def sidecar_tensor(self, shape: Shape, ty: str) -> tuple[GGMLQuantizationType, Shape]:
        n_in, n_out, n_expert = shape
        return ggml_type(ty), (n_expert, n_out, tensor_bytes(ty, (n_in,)))

    def obstacle(self, experts: Sequence[tuple[str, str, Shape]], scaled: Sequence[str], preset: str) -> str | None:
        del experts, scaled, preset  # every routed expert RESplit splits: types fall back as llama-quantize's do
        return None

    def reference_types(self, n_in: int) -> list[str]:
        return [name for name in ("Q4_K", "Q8_0") if fits_rows(name, n_in)]  # others: not comparable

    def encode(self, w: np.ndarray, wq: str, hi: str, copy: bool, importance: np.ndarray | None) -> Encoded:
        from ..._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use)

        n_in = w.shape[1]
        wq_t, hi_t = int(ggml_type(wq)), int(ggml_type(hi))
        q = _core.quantize(w, wq_t, importance)
        dq = _core.dequantize(q, wq_t, n_in)
        if copy:
            side = _core.quantize(w, hi_t, importance)
            crit = _core.dequantize(side, hi_t, n_in)
        else:
            side = _core.quantize(w - dq, hi_t, importance)
            crit = dq + _core.dequantize(side, hi_t, n_in)
        return Encoded(q, side, dq, crit)

    def compiled(self, wq: str, hi: str, copy: bool, n_in: int) -> Compiled | None:
        wq_t, hi_t = int(ggml_type(wq)), int(ggml_type(hi))
        return Compiled(ENCODE_COPY if copy else ENCODE_RESIDUAL, wq_t, hi_t, tensor_bytes(wq, (n_in,)),
                        tensor_bytes(hi, (n_in,)))

    def report_label(self, ty: str, copy: bool) -> str:
        return f"{ty} {'copy' if copy else 'res'}"

    def footprint_label(self, role: str, preset: Preset) -> str:
        if role == "down":
            if preset.down_mode == "copy":
                return f"down copy ({preset.down_hi})"
            return f"WR down residual ({preset.wr})"
        return f"WR gate/up residual ({preset.wr})"

    def validate(self, base: TensorTable, sidecar: TensorTable) -> str | None:
        for name in sidecar:
            stem, _, form = name.rpartition(".")
            if form not in (RESIDUAL, COPY) or f"{stem}.weight" not in base:
                return (f"holds tensor {name}, which is neither the residual (.wr) nor the copy (.hi) of a routed "
                        f"expert of the base, as {self.title}'s sidecar holds (it names no other codec)")
        return None
