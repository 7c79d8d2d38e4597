"""Placement under memory budgets: how many bytes each part of an MoE model takes in a type mixture, and which
device holds it (GPU: attention, norms, router, head, KV cache, as many WQ experts as fit, hottest first; CPU:
the RESplit sidecar, cache misses, token embeddings), for GGUF files and for named shape sets of models too
large to load here; and the expert cache's planning (placement.cache: its settings, the policies' replay, MoEpic's
solver). Pure planning: no extension import, no device access.

The names below load their module on first use, so `rapidmoe.placement.cache.config` and `.units` (the CLI's option
types) import without numpy and the planner.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .frequency import ExpertFrequency, FrequencyError, load_frequency
    from .planner import CPU, GPU, SCHEMES, Plan, PlanError, Realization, Row, plan, plan_all
    from .shapes import SHAPE_SETS, ShapeSet, get_shape_set
    from .tensors import ModelShapes, TensorShape, read_gguf_shapes
    from .units import SizeError, format_size, parse_size

_LAZY = {
    **dict.fromkeys(("ExpertFrequency", "FrequencyError", "load_frequency"), ".frequency"),
    **dict.fromkeys(("CPU", "GPU", "SCHEMES", "Plan", "PlanError", "Realization", "Row", "plan", "plan_all"),
                    ".planner"),
    **dict.fromkeys(("SHAPE_SETS", "ShapeSet", "get_shape_set"), ".shapes"),
    **dict.fromkeys(("ModelShapes", "TensorShape", "read_gguf_shapes"), ".tensors"),
    **dict.fromkeys(("SizeError", "format_size", "parse_size"), ".units"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'rapidmoe.placement' has no attribute {name!r}")


__all__ = ["CPU", "GPU", "SCHEMES", "SHAPE_SETS", "ExpertFrequency", "FrequencyError", "ModelShapes", "Plan",
           "PlanError", "Realization", "Row", "ShapeSet", "SizeError", "TensorShape", "format_size",
           "get_shape_set", "load_frequency", "parse_size", "plan", "plan_all", "read_gguf_shapes"]
