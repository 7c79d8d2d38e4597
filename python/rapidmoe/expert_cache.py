"""Deprecated (one release): the expert cache moved to the package rapidmoe.cache: `ExpertCacheConfig` and the
policy names in rapidmoe.cache.config, the model-file helpers in rapidmoe.cache.moepic, the run-time checks,
counters and refresh in rapidmoe.cache.runtime. This module re-exports the names it had."""
from __future__ import annotations

import warnings

from .cache.config import CachePolicy
from .cache.moepic import MoEpicLayer, moe_layers_of, moepic_for_cache, moepic_layers, wq_expert_bytes
from .cache.runtime import (
    CacheRefresher,
    ExpertCacheLayer,
    ExpertCacheStats,
    RefreshStats,
    check_device,
    check_expert_cache,
)

CACHE_POLICIES = tuple(p.value for p in CachePolicy)

warnings.warn("rapidmoe.expert_cache is deprecated: import from rapidmoe.cache (ExpertCacheConfig, CachePolicy, "
              "moe_layers_of, ...) or rapidmoe.cache.runtime (ExpertCacheStats, ...)", DeprecationWarning, stacklevel=2)

__all__ = ["CACHE_POLICIES", "CacheRefresher", "ExpertCacheLayer", "ExpertCacheStats", "MoEpicLayer", "RefreshStats",
           "check_device", "check_expert_cache", "moe_layers_of", "moepic_for_cache", "moepic_layers",
           "wq_expert_bytes"]
