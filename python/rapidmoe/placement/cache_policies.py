"""Deprecated (one release): the cache simulator and MoEpic's solver moved to the package rapidmoe.cache
(simulator, moepic, routing, config); the simulator's base class `Policy` is now `ReplayPolicy` (the name `Policy`
is UMIA's). This module re-exports the names it had."""
from __future__ import annotations

import warnings

from .cache.config import CachePolicy, CachePolicyError, MoEpicConfig, MoEpicSettings, RefreshSettings
from .cache.moepic import (
    HitCurve,
    SplitSolution,
    hit_curve,
    layer_stall_s,
    moepic_config,
    plan_moepic,
    split_fixed_point,
    top_rows,
)
from .cache.routing import RoutingStats, chance_reuse, routing_stats, scale_routing
from .cache.simulator import (
    Access,
    LRUCache,
    MoEpicCache,
    RapidMoECache,
    ReplayResult,
    StaticCache,
    refresh_swaps,
    replay,
)
from .cache.simulator import ReplayPolicy as Policy

# the old tuple, in its old order, spelled by the one enum
POLICIES = tuple(p.value for p in (CachePolicy.static, CachePolicy.lru, CachePolicy.moepic, CachePolicy.rapidmoe))

warnings.warn("rapidmoe.placement.cache_policies is deprecated: import from rapidmoe.cache (the simulator's Policy "
              "is rapidmoe.cache.ReplayPolicy)", DeprecationWarning, stacklevel=2)

__all__ = ["POLICIES", "Access", "CachePolicyError", "HitCurve", "LRUCache", "MoEpicCache", "MoEpicConfig",
           "MoEpicSettings", "Policy", "RapidMoECache", "RefreshSettings", "ReplayResult", "RoutingStats",
           "SplitSolution", "StaticCache", "chance_reuse", "hit_curve", "layer_stall_s", "moepic_config",
           "plan_moepic", "refresh_swaps", "replay", "routing_stats", "scale_routing", "split_fixed_point", "top_rows"]
