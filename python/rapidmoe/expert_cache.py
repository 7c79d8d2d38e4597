"""A per-expert WQ cache on a device: the chosen experts of each MoE layer computed on a device, the rest on the CPU.

llama.cpp places a layer's routed experts all together (one stacked tensor per role), so `-ot`/`--n-cpu-moe` move
whole layers. With the stacked tensors in CPU memory (`override_tensor="exps=CPU"`), `Llama(expert_cache={layer:
[expert ids]}, expert_cache_device="RPC0[...]")` copies the chosen experts' WQ slices to the device; per token and
slot the graph takes the device's result for a cached expert and the CPU's for the others (docs/execution.md,
"Per-expert WQ cache"). This module validates the request and reads the hit counters.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import RapidMoEError
from .ggufio import GGUFFile


def moe_layers_of(model_path: str | os.PathLike[str]) -> list[int]:
    """Layers with routed experts (a stacked `ffn_up_exps` tensor) in the file."""
    names = (t.name for t in GGUFFile(model_path).tensors)
    return sorted(int(n.split(".")[1]) for n in names if n.startswith("blk.") and n.endswith(".ffn_up_exps.weight"))


def check_expert_cache(cache: Mapping[int, Sequence[int]], moe_layers: Sequence[int], n_layer: int,
                       n_expert: int) -> dict[int, list[int]]:
    """The cache for every MoE layer (unnamed layers cache nothing but are counted), or a RapidMoEError."""
    if not isinstance(cache, Mapping):
        raise RapidMoEError(f"expert_cache must map layer -> expert ids, got {type(cache).__name__}")
    out: dict[int, list[int]] = {il: [] for il in moe_layers}
    for layer, ids in cache.items():
        if not isinstance(layer, int) or not 0 <= layer < n_layer:
            raise RapidMoEError(f"expert_cache: layer {layer!r} is out of range (the model has {n_layer} layers)")
        if layer not in out:
            raise RapidMoEError(f"expert_cache: layer {layer} is not an MoE layer (MoE layers: {list(moe_layers)})")
        try:
            ids = [int(e) for e in ids]
        except (TypeError, ValueError):
            raise RapidMoEError(f"expert_cache: layer {layer}: expert ids must be integers, got {ids!r}") from None
        bad = [e for e in ids if not 0 <= e < n_expert]
        if bad:
            raise RapidMoEError(f"expert_cache: layer {layer}: expert id {bad[0]} is out of range (0..{n_expert - 1})")
        if len(set(ids)) != len(ids):
            dup = next(e for e in ids if ids.count(e) > 1)
            raise RapidMoEError(f"expert_cache: layer {layer}: expert id {dup} is listed twice")
        out[layer] = ids
    return out


def check_device(name: str | None, known: Sequence[str]) -> str:
    """The device (or buffer type) name the cache goes to, if this process knows it."""
    if not name:
        raise RapidMoEError("expert_cache needs expert_cache_device=... (a device or buffer type name, e.g. the "
                            "RPC device's 'RPC0[127.0.0.1:50052]')")
    if name not in known:
        raise RapidMoEError(f"expert_cache_device {name!r} is not a known device or buffer type "
                            f"(known: {', '.join(known) or 'none'})")
    return name


@dataclass(frozen=True)
class ExpertCacheLayer:
    """One MoE layer since the last reset."""

    layer: int
    cached: int  # experts in the cache
    hits: int  # expert slots (token x top-k) served from the cache
    slots: int  # all expert slots

    @property
    def hit_rate(self) -> float:
        return self.hits / self.slots if self.slots else 0.0


@dataclass(frozen=True)
class ExpertCacheStats:
    """Hit counters of the expert cache, per MoE layer and overall."""

    layers: list[ExpertCacheLayer]

    @property
    def hits(self) -> int:
        return sum(layer.hits for layer in self.layers)

    @property
    def slots(self) -> int:
        return sum(layer.slots for layer in self.layers)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.slots if self.slots else 0.0

    @classmethod
    def from_raw(cls, raw: Any) -> ExpertCacheStats:
        """From `_core.expert_cache_stats` ([n_layer, 3]: cached (-1: no cache), hits, slots)."""
        return cls([ExpertCacheLayer(i, int(c), int(h), int(s)) for i, (c, h, s) in enumerate(raw) if c >= 0])
