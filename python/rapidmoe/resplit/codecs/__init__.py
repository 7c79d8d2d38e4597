"""RESplit's sidecar codecs and their registry. A codec (base.Codec) says what the sidecar holds for a routed expert:
its tensors' names, types and bytes, its encoder, what it refuses and how a load checks it. A preset names its codec
(Preset.codec, by registry name; none: the one its WR type and down mode name); the converter, the planner, the
report and the sidecar check ask `codec_of(preset)`.

A new codec is a module with a class following base.Codec, one `register(...)` line below, and, where its sidecar
needs its own kernel, its C++ op and codec id (docs/resplit.md, Codecs).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .base import (
    DEFAULT,
    REGISTRY,
    Codec,
    Compiled,
    Encoded,
    down_modes,
    encode_measured,
    get_codec,
    register,
    wq_types,
    wr_types,
)
from .refine import RefineCodec
from .residual import ResidualCodec

if TYPE_CHECKING:
    from ..presets import Preset

register(ResidualCodec())
register(RefineCodec())


def codec_of(preset: Preset) -> Codec:
    """The preset's codec: the one it names, else the one its WR type and down mode name (named_by: the refine
    codec for WR REFINE1 or down 'refine'), else the default (residual)."""
    if preset.codec is not None:
        return get_codec(preset.codec)
    return named_by(preset.wr, preset.down_mode)


def named_by(wr: str, down_mode: str) -> Codec:
    """The codec a WR type and down mode name: one other than the default that claims the WR type, or a down mode
    the default does not take; else the default."""
    default = REGISTRY[DEFAULT]
    for codec in REGISTRY.values():
        if codec is not default and (wr.upper() in codec.wr_types
                                     or (down_mode in codec.down_modes and down_mode not in default.down_modes)):
            return codec
    return default


def by_sidecar_id(sidecar_id: str | None) -> Codec | None:
    """The codec whose sidecars carry this rapidmoe.residual.codec value (None: no key, the default's), or None."""
    if sidecar_id is None:
        return REGISTRY[DEFAULT]
    return next((c for c in REGISTRY.values() if c.sidecar_id == sidecar_id), None)


def sidecar_ids() -> tuple[str, ...]:
    """The rapidmoe.residual.codec values this RapidMoE reads (besides none: the classic residual sidecar)."""
    return tuple(c.sidecar_id for c in REGISTRY.values() if c.sidecar_id is not None)


__all__ = ["DEFAULT", "REGISTRY", "Codec", "Compiled", "Encoded", "RefineCodec", "ResidualCodec", "by_sidecar_id",
           "codec_of", "down_modes", "encode_measured", "get_codec", "named_by", "register", "sidecar_ids", "wq_types",
           "wr_types"]
