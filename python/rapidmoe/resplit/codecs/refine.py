"""The refine codec ("q3k-refine1", resplit/refine.py's encoder): WQ is a stock Q3_K fitted for a 16-level grid and
the sidecar holds one refinement bit per weight of every role (gate, up and down), no scales of its own. Its
critical slots run the refine op (src/rapidmoe_ggml/ops/refine) on the CPU, reading the WQ experts themselves.

Sidecar: `blk.N.ffn_{gate,up,down}_exps.rf`, I8 with ne = [n_in/8, n_out, n_expert] (bit i & 7 of byte i >> 3 of a
row is column i's), and rapidmoe.residual.codec = "q3k-refine1".
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGMLQuantizationType

from ...moe_tensors import GATE_UP, REFINE
from ..refine import BLOCK_BYTES, QK_K, decode_refine, encode_refine
from .base import ENCODE_REFINE, Compiled, Encoded, Shape, TensorTable

if TYPE_CHECKING:
    from ..presets import MixEntry, Preset

BASE = "Q3_K"  # the one WQ type it refines, whose scales it fits itself
BITS = "REFINE1"  # its sidecar's type name (a preset's wr): one bit per weight, no ggml type


class RefineCodec:
    """A Q3_K base and one refinement bit per weight: 4.4375 bits per weight on the critical path."""

    name: str = "q3k-refine1"
    title: str = "the refine codec"
    sidecar_id: str | None = "q3k-refine1"
    wq_types: tuple[str, ...] = (BASE,)
    wr_types: tuple[str, ...] = (BITS,)
    down_modes: tuple[str, ...] = ("refine",)
    no_mix: str | None = f"fits its own {BASE} base for every tensor"
    cpu_experts: bool = True
    sidecar_repacks: bool = False  # the bit planes have no repacked layout: the refine op reads them in place

    def check_preset(self, preset: Preset) -> None:
        """The refine codec comes whole: WR REFINE1, down_mode 'refine' (every role refined) and WQ Q3_K."""
        if preset.wr.upper() != BITS:
            raise ValueError(f"down_mode 'refine' is the refine codec's: it needs WR {BITS}, not {preset.wr} "
                             "(WR types are residuals with down 'copy' or 'residual')")
        if preset.down_mode != "refine":
            raise ValueError(f"WR {BITS} (the refine codec) refines gate, up and down alike: down_mode must be "
                             f"'refine', not {preset.down_mode!r}")
        if preset.wq.upper() != BASE:
            raise ValueError(f"WR {BITS} refines a {BASE} base whose scales it fits itself; WQ {preset.wq} "
                             f"cannot be refined (use WQ {BASE}, or a residual WR type)")

    def check_mix(self, preset: Preset, entries: Sequence[MixEntry]) -> None:
        del preset, entries  # not asked: no_mix refuses every mix first (Preset)

    def sidecar_bits(self, ty: str) -> float:
        del ty
        return 1.0

    def fit_sidecar(self, ty: str, n_in: int) -> str:
        del n_in  # no ggml type, no fallback: obstacle refuses rows that are not whole Q3_K super-blocks
        return ty

    def is_copy(self, role: str, preset: Preset) -> bool:
        del role, preset
        return False

    def sidecar_name(self, base_name: str, role: str, preset: Preset) -> str:
        del role, preset
        return f"{base_name.removesuffix('.weight')}.{REFINE}"

    def sidecar_tensor(self, shape: Shape, ty: str) -> tuple[GGMLQuantizationType, Shape]:
        del ty  # one bit per weight: I8 bytes, ne = [n_in/8, n_out, n_expert]
        n_in, n_out, n_expert = shape
        return GGMLQuantizationType.I8, (n_expert, n_out, n_in // 8)

    def obstacle(self, experts: Sequence[tuple[str, str, Shape]], scaled: Sequence[str], preset: str) -> str | None:
        """Merged gate_up experts, per-expert scales, rows that are not whole Q3_K super-blocks (no fallback)."""
        for name, role, shape in experts:
            if role == GATE_UP:
                return (f"tensor {name}: preset {preset} (the refine codec) does not take merged gate_up experts "
                        "(its kernels refine gate, up and down as separate tensors); use a residual preset (cpu, "
                        "dense, ...) for this model")
            n_in = int(shape[0])
            if n_in % QK_K:
                return (f"tensor {name} has rows of {n_in} values; preset {preset} (the refine codec) needs rows "
                        f"that are whole {BASE} super-blocks of {QK_K} and has no fallback type: use a residual "
                        "preset, whose types fall back as llama-quantize's do")
        if scaled:
            return (f"tensor {scaled[0]}: preset {preset} (the refine codec) does not take routed experts with "
                    "per-expert scales (its kernels do not apply them to the refinement); use a residual preset "
                    "(cpu, dense, ...) for this model")
        return None

    def reference_types(self, n_in: int) -> list[str]:
        del n_in
        return [BASE, "Q4_K", "Q8_0"]  # the base's stock counterpart first

    def encode(self, w: np.ndarray, wq: str, hi: str, copy: bool, importance: np.ndarray | None) -> Encoded:
        """The base's error is "wq_only" in the report, the refined weights' "critical"."""
        del wq, hi, copy
        q, bits = encode_refine(w, importance)
        base, refined = decode_refine(q, bits, w.shape[1])
        return Encoded(q, bits, base, refined)

    def compiled(self, wq: str, hi: str, copy: bool, n_in: int) -> Compiled | None:
        del wq, hi, copy
        return Compiled(ENCODE_REFINE, 0, 0, n_in // QK_K * BLOCK_BYTES, n_in // 8)

    def report_label(self, ty: str, copy: bool) -> str:
        del copy
        return f"{ty} bits"

    def footprint_label(self, role: str, preset: Preset) -> str:
        del role, preset
        return f"refinement bits ({BITS}, gate/up/down)"

    def validate(self, base: TensorTable, sidecar: TensorTable) -> str | None:
        for name, (ty, shape) in sidecar.items():
            stem, _, form = name.rpartition(".")
            b = base.get(f"{stem}.weight")
            if form != REFINE or ty != "I8" or b is None:
                return (f"holds tensor {name} ({ty}), which is not the I8 bit plane (.rf) of a routed expert of the "
                        f"base, as {self.title}'s sidecar (codec {self.sidecar_id}) holds")
            b_ty, b_shape = b
            if b_ty != BASE:
                return (f"refines {BASE} experts, but the base's {stem}.weight is {b_ty} (the sidecar belongs to "
                        "another .wq.gguf)")
            if [int(shape[0]) * 8, *map(int, shape[1:])] != [int(x) for x in b_shape]:
                return (f"tensor {name} has shape {list(map(int, shape))}; the base's {stem}.weight "
                        f"{list(map(int, b_shape))} needs its bit plane [n_in/8, n_out, n_expert]")
        return None
