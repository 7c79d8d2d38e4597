"""The codec protocol: what RESplit asks a codec about the sidecar it writes for every routed expert.

A codec decides, for a routed-expert tensor W, the WQ base the .wq.gguf holds (a ggml type that stock llama.cpp
runs) and what the sidecar (.wr.gguf) adds for the critical slots: its tensors' names, types and bytes, the
encoder that writes them, and the check a load makes of a pair. The preset names the codec (presets.Preset.codec);
the converter, the planner, the report and the sidecar check ask it instead of testing for one codec by name.

Pure data and arithmetic at import (no extension import): the compiled core is loaded where an encoder runs.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
from gguf import GGMLQuantizationType

from ...ggml_types import ggml_type

if TYPE_CHECKING:
    from ..presets import MixEntry, Preset
    from ..report import TensorReport

# the compiled encoder's modes (src/rapidmoe_ggml/pymodule/encode.cpp: rapidmoe._core.encode_experts)
ENCODE_RESIDUAL, ENCODE_COPY, ENCODE_REFINE = 0, 1, 2

Shape = tuple[int, ...]  # a stacked routed-expert tensor's shape in ggml order: [n_in, n_out, n_expert]
# a file's tensors as the sidecar check sees them: name -> (ggml type name, shape in ggml order)
TensorTable = Mapping[str, tuple[str, Sequence[int]]]


@dataclass(frozen=True)
class Encoded:
    """One expert [n_out, n_in] encoded: the WQ rows and the sidecar rows as stored, and the weights a
    non-critical slot (deq WQ) and a critical slot compute with, float32 [n_out, n_in] (for the error report)."""

    wq: np.ndarray  # uint8 [n_out, WQ row bytes]
    sidecar: np.ndarray  # uint8 [n_out, sidecar row bytes]
    base: np.ndarray
    critical: np.ndarray


@dataclass(frozen=True)
class Compiled:
    """The compiled encoder's arguments for one routed-expert tensor (rapidmoe._core.encode_experts)."""

    mode: int  # ENCODE_*
    wq_type: int  # ggml type ids (what the mode reads of them is the encoder's)
    hi_type: int
    wq_row: int  # bytes of one output row of WQ, and of the sidecar
    hi_row: int


class Codec(Protocol):
    """A sidecar codec. `register` (codecs/__init__.py) makes one known by its name."""

    name: str  # the registry's name, which a preset's `codec` gives
    title: str  # how messages name it ("the refine codec")
    # rapidmoe.residual.codec in the sidecar; None: the key is absent (the classic residual/copy sidecar, which the
    # C++ loader reads as its residual codec: a codec whose sidecar that op runs may leave it out)
    sidecar_id: str | None
    wq_types: tuple[str, ...]  # the WQ base types it takes
    wr_types: tuple[str, ...]  # the sidecar type names a preset's `wr` may give for it
    down_modes: tuple[str, ...]  # the down modes a preset may give for it
    no_mix: str | None  # why it takes no mix (per-layer types), or None: it takes one
    cpu_experts: bool  # its critical slots run on the CPU from the WQ experts: every routed expert stays in DRAM
    sidecar_repacks: bool  # its sidecar tensors take the CPU's repacked layout where the experts do

    def check_preset(self, preset: Preset) -> None:
        """ValueError where the preset's WQ, WR or down mode is not this codec's (the mix: check_mix)."""

    def check_mix(self, preset: Preset, entries: Sequence[MixEntry]) -> None:
        """ValueError for a mix entry this codec does not take (asked only where no_mix is None)."""

    def sidecar_bits(self, ty: str) -> float:
        """Bits per weight of a sidecar part of type `ty` (one of its wr types, or a down copy's)."""

    def fit_sidecar(self, ty: str, n_in: int) -> str:
        """The type the sidecar part takes for rows of n_in values (a fallback where `ty`'s blocks do not fit)."""

    def is_copy(self, role: str, preset: Preset) -> bool:
        """Whether the sidecar holds the tensor itself (down's copy), not something added to WQ."""

    def sidecar_name(self, base_name: str, role: str, preset: Preset) -> str:
        """The sidecar tensor of a routed-expert tensor (`blk.N.ffn_<role>_exps.weight`)."""

    def sidecar_tensor(self, shape: Shape, ty: str) -> tuple[GGMLQuantizationType, Shape]:
        """The sidecar tensor's ggml type and byte shape (numpy order: [n_expert, n_out, row bytes]) for a
        routed-expert tensor of `shape` whose sidecar part is of type `ty`."""

    def obstacle(self, experts: Sequence[tuple[str, str, Shape]], scaled: Sequence[str], preset: str) -> str | None:
        """Why this codec cannot take a model (the refusal's message), or None: experts as (name, role, shape);
        scaled: the names of its per-expert scale tensors."""

    def reference_types(self, n_in: int) -> list[str]:
        """The ggml types the error report compares the codec with (on rows of n_in values)."""

    def encode(self, w: np.ndarray, wq: str, hi: str, copy: bool, importance: np.ndarray | None) -> Encoded:
        """One expert's W float32 [n_out, n_in] in WQ type `wq` and sidecar type `hi` (copy: is_copy's answer);
        importance: per-column weights of the error, or None. The reference encoder (convert's numpy path)."""

    def compiled(self, wq: str, hi: str, copy: bool, n_in: int) -> Compiled | None:
        """The compiled encoder's arguments, whose bytes are encode's; None: no compiled encoder (the parallel
        writer then runs encode on its threads)."""

    def report_label(self, ty: str, copy: bool) -> str:
        """The error table's sidecar column for a tensor."""

    def footprint_label(self, role: str, preset: Preset) -> str:
        """The planner's row label for the sidecar bytes of a routed-expert tensor of `role`."""

    def validate(self, base: TensorTable, sidecar: TensorTable) -> str | None:
        """What is wrong with a sidecar's tensors for this codec and its base (a message to follow the sidecar's
        path), or None. Shapes and types against the loaded model are checked again at attach (C++)."""


def encode_measured(codec: Codec, w: np.ndarray, wq: str, hi: str, copy: bool, importance: np.ndarray | None,
                    ref_types: Sequence[str], report: TensorReport) -> Encoded:
    """One expert through the codec's reference encoder, its errors added to `report`: against W, deq(WQ) and the
    critical slot's weights, and each of `ref_types` (the sampled experts': empty for the others) quantized alone."""
    from ..._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use)

    enc = codec.encode(w, wq, hi, copy, importance)
    refs = {}
    for name in ref_types:
        rt = int(ggml_type(name))
        refs[name] = _core.dequantize(_core.quantize(w, rt, importance), rt, w.shape[1])
    report.add(w, enc.base, enc.critical, refs)
    return enc


# -- the registry (codecs/__init__.py registers the built-in codecs; a codec's own module may register itself) ----
REGISTRY: dict[str, Codec] = {}
DEFAULT = "residual"  # the codec of a preset that names none and whose WR type and down mode name no other


C = TypeVar("C", bound=Codec)


def register(codec: C) -> C:
    """Make `codec` known by its name (ValueError: the name, or the sidecar id, is taken)."""
    if codec.name in REGISTRY:
        raise ValueError(f"a codec named {codec.name!r} is registered already")
    if codec.sidecar_id is not None and any(c.sidecar_id == codec.sidecar_id for c in REGISTRY.values()):
        raise ValueError(f"a codec with sidecar id {codec.sidecar_id!r} is registered already")
    REGISTRY[codec.name] = codec
    return codec


def get_codec(name: str) -> Codec:
    """The registered codec of this name (ValueError naming the known ones otherwise)."""
    codec = REGISTRY.get(name)
    if codec is None:
        raise ValueError(f"unknown codec {name!r}; the registered ones: {', '.join(REGISTRY)}")
    return codec


def wq_types() -> tuple[str, ...]:
    """Every registered codec's WQ types, in registration order, each once."""
    return tuple(dict.fromkeys(ty for c in REGISTRY.values() for ty in c.wq_types))


def wr_types() -> tuple[str, ...]:
    """Every registered codec's WR type names, in registration order."""
    return tuple(ty for c in REGISTRY.values() for ty in c.wr_types)


def down_modes() -> tuple[str, ...]:
    """Every registered codec's down modes, in registration order, each once."""
    return tuple(dict.fromkeys(m for c in REGISTRY.values() for m in c.down_modes))
