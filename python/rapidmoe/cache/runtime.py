"""A per-expert WQ cache on a device at run time: the chosen experts of each MoE layer computed on a device, the
rest on the CPU.

llama.cpp places a layer's routed experts all together (one stacked tensor per role), so `-ot`/`--n-cpu-moe` move
whole layers. With the stacked tensors in CPU memory (`override_tensor="exps=CPU"`),
`Llama(expert_cache=ExpertCacheConfig(experts={layer: [expert ids]}, device="RPC0[...]"))` copies the chosen
experts' WQ slices to the device; per token and slot the graph takes the device's result for a cached expert and
the CPU's for the others (docs/execution.md, "Per-expert WQ cache"). This module checks the request against the
model, sets the cache up as the model loads, runs the rapidmoe policy's refresh, and reads the counters:
`ExpertCache`, the handle `Llama.expert_cache` returns.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import RapidMoEError
from ..placement.cache.config import CachePolicy, ExpertCacheConfig, RefreshSettings
from ..placement.cache.moepic import MoEpicLayer, moe_layers_of, moepic_layers, wq_expert_bytes
from ..placement.cache.simulator import refresh_swaps


def _native() -> Any:
    """rapidmoe._core, loaded on first use: the checks and dataclasses here import without the compiled part."""
    from .._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use: see the docstring)

    return _core


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
        raise RapidMoEError("the expert cache needs ExpertCacheConfig.device (a device or buffer type name, e.g. the "
                            "RPC device's 'RPC0[127.0.0.1:50052]')")
    if name not in known:
        raise RapidMoEError(f"ExpertCacheConfig.device {name!r} is not a known device or buffer type "
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


@dataclass
class RefreshStats:
    """The rapidmoe policy's copies since the cache was set."""

    swaps: int = 0
    bytes_moved: int = 0  # host -> device: each swap copies one expert's WQ gate/up/down slices
    steps: int = 0


class CacheRefresher:
    """The rapidmoe policy at run time: after each decode step, the per-expert routing counts the cache's route op
    kept (since the last step) feed decayed scores, and `placement.cache.simulator.refresh_swaps` (the simulator's
    own decision) names the swaps; each is one `expert_cache_replace` (the incoming expert's WQ copied into the
    outgoing one's slot). Steps must not overlap a decode (the caller runs them between llama_decode calls)."""

    def __init__(self, model: Any, cache: dict[int, list[int]], n_expert: int, expert_bytes: dict[int, int],
                 settings: RefreshSettings) -> None:
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
        _core = _native()
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


class ExpertCache:
    """The expert cache of a loaded model: what `rapidmoe.Llama(..., expert_cache=ExpertCacheConfig(...))` set up,
    as `llm.expert_cache` returns it (None without a cache). Built from the config before the model loads (the
    checks against the model file and the process's devices), attached as llama.cpp loads the model (before its
    context: the reserved graphs include the cache), cleared by `Llama.close`. Counters run since their last
    reset (`reset=True` reads and zeroes them)."""

    def __init__(self, config: ExpertCacheConfig, model_path: str | os.PathLike[str], *, n_layer: int,
                 n_expert: int, n_expert_used: int, known_devices: Sequence[str]) -> None:
        self.config = config
        self.policy = CachePolicy(config.policy)
        self._model_path = model_path
        self._n_expert = n_expert
        self._moepic: list[MoEpicLayer] | None = None
        experts = config.experts
        moe = moe_layers_of(model_path)
        if self.policy is CachePolicy.moepic:
            assert config.moepic is not None  # ExpertCacheConfig refuses moepic without its settings
            splits, caps = config.moepic.per_layer(len(moe))
            work = min(config.moepic.work_slots or n_expert_used, n_expert)
            self._moepic = moepic_layers(model_path, moe, splits, caps, work)
            experts = {il: list(range(work)) for il in moe}
        assert experts is not None  # ExpertCacheConfig refuses the other policies without experts
        self._initial = check_expert_cache(experts, moe, n_layer, n_expert)
        self.device = check_device(config.device, known_devices)
        self._model: Any = None  # llama_cpp's model wrapper once attached (its .model: the llama_model pointer)
        self._refresher: CacheRefresher | None = None

    def attach(self, model: Any) -> None:
        """Set the cache up on the model llama.cpp just loaded (llama_cpp's model wrapper), before its context."""
        _core = _native()
        self._model = model
        ptr = model.model
        for layer, ids in self._initial.items():
            try:
                _core.expert_cache_set(ptr, layer, ids, self.device)
            except ValueError as e:
                _core.expert_cache_clear(ptr)  # nothing half set stays keyed by this model's tensors
                raise RapidMoEError(f"expert_cache: {e}") from e
        if self.policy is CachePolicy.lru:
            for il, ids in self._initial.items():
                if ids:
                    _core.expert_cache_set_lru(ptr, il, True)
        if self.policy is CachePolicy.rapidmoe:
            self._refresher = CacheRefresher(ptr, self._initial, self._n_expert,
                                             wq_expert_bytes(self._model_path, sorted(self._initial)),
                                             self.config.refresh or RefreshSettings())
        for ml in self._moepic or []:
            try:
                _core.expert_cache_set_moepic(ptr, ml.layer, ml.n_top, ml.capacity)
            except ValueError as e:
                _core.expert_cache_clear(ptr)
                raise RapidMoEError(f"moepic: {e}") from e
        _core.expert_cache_set_async(ptr, bool(self.config.async_copies))

    def after_decode(self, n_tokens: int) -> int:
        """The rapidmoe policy's refresh after a decode step of n_tokens (Llama.after_decode calls it); returns the
        swaps made (0 for the other policies)."""
        return self._refresher.step(n_tokens) if self._refresher is not None else 0

    def close(self) -> None:
        """Free the cache's device copies (Llama.close calls it, before llama.cpp frees the model)."""
        _core = _native()
        model = self._model
        if model is not None and model.model is not None:
            _core.expert_cache_clear(model.model)

    @property
    def layers(self) -> list[int]:
        """The MoE layers the cache covers (every MoE layer; some may cache no expert)."""
        return sorted(self._initial)

    def stats(self, reset: bool = False) -> ExpertCacheStats:
        """Per MoE layer since the last reset: cached experts, expert slots served from the cache, all slots."""
        _core = _native()
        return ExpertCacheStats.from_raw(_core.expert_cache_stats(self._model.model, reset))

    def bytes(self, reset: bool = False) -> dict[int, tuple[int, int]]:
        """Per MoE layer: (bytes copied host -> device before the layer could compute, bytes copied ahead by
        moepic's prefetch) since the last reset (lru and moepic; 0 for the others)."""
        _core = _native()
        raw = _core.expert_cache_bytes(self._model.model, reset)
        return {il: (int(raw[il][0]), int(raw[il][1])) for il in self.layers}

    def wait_us(self, reset: bool = False) -> dict[int, int]:
        """Per MoE layer: microseconds the computing thread waited for the layer's copies (the transfer queue's
        cost that compute did not hide) since the last reset; a reset here also resets `bytes`."""
        _core = _native()
        raw = _core.expert_cache_bytes(self._model.model, reset)
        return {il: int(raw[il][2]) for il in self.layers}

    def copies(self, reset: bool = False) -> dict[int, int]:
        """Per MoE layer: experts the lru policy copied host -> device since the last reset (0 for other policies)."""
        _core = _native()
        raw = _core.expert_cache_copies(self._model.model, reset)
        return {il: int(raw[il]) for il in self.layers}

    def refresh_stats(self) -> RefreshStats:
        """With the rapidmoe policy: swaps, bytes copied and steps since the cache was set."""
        if self._refresher is None:
            raise RapidMoEError('no refreshing expert cache (ask for it with ExpertCacheConfig(policy="rapidmoe"))')
        return self._refresher.stats

    @property
    def moepic(self) -> list[MoEpicLayer]:
        """The moepic policy's layers (rows in the top segment, resident tops, work area, bytes)."""
        if self._moepic is None:
            raise RapidMoEError('no moepic cache (ask for it with ExpertCacheConfig(policy="moepic", moepic=...))')
        return list(self._moepic)

    @property
    def experts(self) -> dict[int, list[int]]:
        """The experts now in the cache per layer (they change under the rapidmoe policy; under lru the set changes
        inside the graph and this gives the initial one)."""
        return self._refresher.cache() if self._refresher is not None else dict(self._initial)
