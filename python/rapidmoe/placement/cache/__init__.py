"""The expert cache's planning: what a cache is asked to be, its policies replayed and priced, MoEpic's solver.

- config: `CachePolicy` (static, rapidmoe, lru, moepic), `RefreshSettings`, `MoEpicSettings` and
  `ExpertCacheConfig`, the argument that asks `rapidmoe.Llama(..., expert_cache=...)` for a cache (also importable
  as `rapidmoe.cache.ExpertCacheConfig`).
- simulator: the policies replayed over routing traces and priced with the planner's cost model (`replay`).
- moepic: MoEpic's split-ratio fixed point and its plan for a model file; the model file's MoE layers and expert
  bytes.
- routing: routing statistics of a trace and synthetic routing for shapes we cannot run.

The cache of a loaded model (`ExpertCache`, what `Llama.expert_cache` returns) is the engine's: rapidmoe.cache.

The names below load their module on first use, so `rapidmoe.placement.cache.config` (the CLI's option types)
imports without numpy and the planner.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import (
        CachePolicy,
        CachePolicyError,
        ExpertCacheConfig,
        MoEpicConfig,
        MoEpicSettings,
        RefreshSettings,
    )
    from .moepic import (
        MoEpicLayer,
        hit_curve,
        moe_layers_of,
        moepic_config,
        moepic_for_cache,
        moepic_layers,
        plan_moepic,
        top_rows,
        wq_expert_bytes,
    )
    from .routing import RoutingStats, routing_stats, scale_routing
    from .simulator import (
        LRUCache,
        MoEpicCache,
        RapidMoECache,
        ReplayPolicy,
        ReplayResult,
        StaticCache,
        refresh_swaps,
        replay,
    )

_LAZY = {
    **dict.fromkeys(("CachePolicy", "CachePolicyError", "ExpertCacheConfig", "MoEpicConfig", "MoEpicSettings",
                     "RefreshSettings"), ".config"),
    **dict.fromkeys(("MoEpicLayer", "hit_curve", "moe_layers_of", "moepic_config", "moepic_for_cache",
                     "moepic_layers", "plan_moepic", "top_rows", "wq_expert_bytes"), ".moepic"),
    **dict.fromkeys(("RoutingStats", "routing_stats", "scale_routing"), ".routing"),
    **dict.fromkeys(("LRUCache", "MoEpicCache", "RapidMoECache", "ReplayPolicy", "ReplayResult", "StaticCache",
                     "refresh_swaps", "replay"), ".simulator"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'rapidmoe.placement.cache' has no attribute {name!r}")


__all__ = ["CachePolicy", "CachePolicyError", "ExpertCacheConfig", "LRUCache", "MoEpicCache", "MoEpicConfig",
           "MoEpicLayer", "MoEpicSettings", "RapidMoECache", "RefreshSettings", "ReplayPolicy", "ReplayResult",
           "RoutingStats", "StaticCache", "hit_curve", "moe_layers_of", "moepic_config", "moepic_for_cache",
           "moepic_layers", "plan_moepic", "refresh_swaps", "replay", "routing_stats", "scale_routing", "top_rows",
           "wq_expert_bytes"]
