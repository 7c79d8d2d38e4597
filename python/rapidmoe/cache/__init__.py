"""The expert cache of a loaded model: which experts of each MoE layer a device holds, and how that set changes.

- runtime: the cache of a loaded model (`ExpertCache`, what `Llama.expert_cache` returns), its checks against the
  model, the rapidmoe policy's refresh and the counters.

What a cache is asked to be (`ExpertCacheConfig` and its settings) is planning, with the policies' replay and
MoEpic's solver: rapidmoe.placement.cache. The argument's names are importable from here too
(`rapidmoe.cache.ExpertCacheConfig`), loaded on first use, so this package imports without numpy and the planner.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..placement.cache.config import (
        CachePolicy,
        CachePolicyError,
        ExpertCacheConfig,
        MoEpicSettings,
        RefreshSettings,
    )

_CONFIG = ("CachePolicy", "CachePolicyError", "ExpertCacheConfig", "MoEpicSettings", "RefreshSettings")


def __getattr__(name: str) -> Any:
    if name in _CONFIG:
        return getattr(importlib.import_module("..placement.cache.config", __name__), name)
    raise AttributeError(f"module 'rapidmoe.cache' has no attribute {name!r}")


__all__ = ["CachePolicy", "CachePolicyError", "ExpertCacheConfig", "MoEpicSettings", "RefreshSettings"]
