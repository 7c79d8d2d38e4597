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


CACHE_POLICIES = ("static", "rapidmoe", "lru", "moepic")  # what the runtime realizes


@dataclass
class RefreshStats:
    """The rapidmoe policy's copies since the cache was set."""

    swaps: int = 0
    bytes_moved: int = 0  # host -> device: each swap copies one expert's WQ gate/up/down slices
    steps: int = 0


class CacheRefresher:
    """The rapidmoe policy at run time: after each decode step, the per-expert routing counts the cache's route op
    kept (since the last step) feed decayed scores, and `placement.cache_policies.refresh_swaps` (the simulator's
    own decision) names the swaps; each is one `expert_cache_replace` (the incoming expert's WQ copied into the
    outgoing one's slot). Steps must not overlap a decode (the caller runs them between llama_decode calls)."""

    def __init__(self, model: Any, cache: dict[int, list[int]], n_expert: int, expert_bytes: dict[int, int],
                 settings: Any) -> None:
        import numpy as np  # noqa: PLC0415

        self._model = model
        self.layers = sorted(cache)
        self.cached = [set(cache[il]) for il in self.layers]
        self.n_expert = n_expert
        self.expert_bytes = expert_bytes
        self.settings = settings
        self.score = np.zeros((len(self.layers), n_expert))
        self.stats = RefreshStats()

    def step(self, n_tokens: int) -> int:
        """Fold in the counts since the last step and make the swaps; returns how many."""
        import numpy as np  # noqa: PLC0415

        from ._runtime import _core  # noqa: PLC0415
        from .placement.cache_policies import refresh_swaps  # noqa: PLC0415

        if n_tokens <= 0:
            return 0
        counts = np.stack([np.asarray(_core.expert_cache_expert_counts(self._model, il, True), dtype=np.float64)
                           for il in self.layers])
        self.score = self.score * self.settings.decay_per_token ** n_tokens + counts
        swaps = refresh_swaps(self.score, self.cached, self.settings)
        for m, inn, out in swaps:
            il = self.layers[m]
            try:
                _core.expert_cache_replace(self._model, il, out, inn)
            except ValueError as e:
                raise RapidMoEError(f"expert cache refresh: {e}") from e
            self.cached[m].discard(out)
            self.cached[m].add(inn)
            self.stats.swaps += 1
            self.stats.bytes_moved += self.expert_bytes[il]
        self.stats.steps += 1
        return len(swaps)

    def cache(self) -> dict[int, list[int]]:
        return {il: sorted(c) for il, c in zip(self.layers, self.cached, strict=True)}


def wq_expert_bytes(model_path: str | os.PathLike[str], layers: Sequence[int]) -> dict[int, int]:
    """Bytes of one expert's gate + up + down slices per layer, as stored in the file (what a swap copies)."""
    tensors = {t.name: t for t in GGUFFile(model_path).tensors}
    out = {}
    for il in layers:
        ts = [tensors[f"blk.{il}.ffn_{r}_exps.weight"] for r in ("gate", "up", "down")]
        out[il] = sum(int(t.n_bytes) // int(t.shape[2]) for t in ts)
    return out


@dataclass(frozen=True)
class MoEpicLayer:
    """One MoE layer under the moepic policy at run time."""

    layer: int
    n_ff: int  # the intermediate dimension
    n_top: int  # its leading rows in the top segment
    capacity: int  # top segments resident
    work_slots: int  # experts the device computes per ubatch (the work area)
    expert_bytes: int  # one expert's gate + up + down
    top_bytes: int  # its top segment

    @property
    def split(self) -> float:
        """The top's share of the intermediate dimension (= of the expert's bytes)."""
        return self.n_top / self.n_ff if self.n_ff else 0.0


def moepic_for_cache(model_path: str | os.PathLike[str], cache: Mapping[int, Sequence[int]], *,
                     frequency_path: str | os.PathLike[str] | None = None, machine: str = "24gb",
                     accuracy: float = 0.8) -> Any:
    """MoEpicSettings for the device memory a per-expert cache plan would use (the experts it lists, in the file's
    types): per-layer split and tops from MoEpic's fixed point (placement.cache_policies.plan_moepic) over hit-rate
    curves of the frequency table (--freq's formats; uniform without) and the `machine` profile's link and windows,
    with the next-layer predictor's accuracy assumed (0.8, as plan --machine assumes)."""
    import numpy as np  # noqa: PLC0415

    from .placement.cache_policies import MoEpicSettings, plan_moepic  # noqa: PLC0415
    from .placement.cost import CostModel, ModelCosts  # noqa: PLC0415
    from .placement.frequency import load_frequency  # noqa: PLC0415
    from .placement.machine import MACHINES  # noqa: PLC0415
    from .placement.tensors import read_gguf_shapes  # noqa: PLC0415

    layers = moe_layers_of(model_path)
    eb = wq_expert_bytes(model_path, layers)
    gf = GGUFFile(model_path)
    n_expert = int(gf.tensor(f"blk.{layers[0]}.ffn_up_exps.weight").shape[2])
    n_layer = int(gf.get(f"{gf.get('general.architecture')}.block_count"))
    share = load_frequency(frequency_path, layers, n_layer, n_expert).share
    freq = np.stack([share[il] for il in layers])
    budget = float(sum(len(cache.get(il, ())) * eb[il] for il in layers))
    shapes = read_gguf_shapes(model_path)
    cost = CostModel(MACHINES[machine], ModelCosts.of(shapes))
    cfg = plan_moepic(freq, budget, expert_bytes=float(eb[layers[0]]), k=shapes.n_expert_used, cost=cost,
                      accuracy=[accuracy] * len(layers))
    return MoEpicSettings.from_config(cfg)


def moepic_layers(model_path: str | os.PathLike[str], layers: Sequence[int], splits: Sequence[float],
                  capacities: Sequence[int], work_slots: int) -> list[MoEpicLayer]:
    """Each layer's split rounded to whole rows of the intermediate dimension and to the down projection's
    quantization block (down's top is the leading columns of its rows), with the bytes that decides."""
    from gguf import GGML_QUANT_SIZES  # noqa: PLC0415

    from .placement.cache_policies import top_rows  # noqa: PLC0415

    tensors = {t.name: t for t in GGUFFile(model_path).tensors}
    out = []
    for il, split, cap in zip(layers, splits, capacities, strict=True):
        up, gate, down = (tensors[f"blk.{il}.ffn_{r}_exps.weight"] for r in ("up", "gate", "down"))
        n_embd, n_ff = int(up.shape[0]), int(up.shape[1])
        block, tsize = GGML_QUANT_SIZES[down.tensor_type]
        n_top = top_rows(split, n_ff, block)
        per_expert = [int(t.n_bytes) // int(t.shape[2]) for t in (up, gate, down)]
        row_up, row_gate = per_expert[0] // n_ff, per_expert[1] // n_ff
        top = n_top * (row_up + row_gate) + n_top // block * tsize * n_embd
        out.append(MoEpicLayer(il, n_ff, n_top, int(cap), work_slots, sum(per_expert), top))
    return out
