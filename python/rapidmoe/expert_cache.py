"""Deprecated (one release): the expert cache moved: `ExpertCacheConfig` and the policy names to
rapidmoe.placement.cache.config, the model-file helpers to rapidmoe.placement.cache.moepic, the run-time checks,
counters and refresh to rapidmoe.cache.runtime. This module re-exports the names it had."""
from __future__ import annotations

import warnings

from .cache.runtime import (
    CacheRefresher,
    ExpertCacheLayer,
    ExpertCacheStats,
    RefreshStats,
    check_device,
    check_expert_cache,
)
from .placement.cache.config import CachePolicy
from .placement.cache.moepic import MoEpicLayer, moe_layers_of, moepic_for_cache, moepic_layers, wq_expert_bytes

CACHE_POLICIES = tuple(p.value for p in CachePolicy)

warnings.warn("rapidmoe.expert_cache is deprecated: import from rapidmoe.cache (ExpertCacheConfig, CachePolicy, "
              "moe_layers_of, ...) or rapidmoe.cache.runtime (ExpertCacheStats, ...)", DeprecationWarning, stacklevel=2)

__all__ = ["CACHE_POLICIES", "CacheRefresher", "ExpertCacheLayer", "ExpertCacheStats", "MoEpicLayer", "RefreshStats",
           "check_device", "check_expert_cache", "moe_layers_of", "moepic_for_cache", "moepic_layers",
           "wq_expert_bytes"]
