"""Placement under memory budgets: how many bytes each part of an MoE model takes in a type mixture, and which
device holds it (GPU: attention, norms, router, head, KV cache, as many WQ experts as fit, hottest first; CPU:
the RESplit sidecar, cache misses, token embeddings), for GGUF files and for named shape sets of models too
large to load here. Pure planning: no extension import, no device access.
"""
from __future__ import annotations

from .frequency import ExpertFrequency, FrequencyError, load_frequency
from .planner import CPU, GPU, SCHEMES, Plan, PlanError, Realization, Row, plan, plan_all
from .shapes import SHAPE_SETS, ShapeSet, get_shape_set
from .tensors import ModelShapes, TensorShape, read_gguf_shapes
from .units import SizeError, format_size, parse_size

__all__ = ["CPU", "GPU", "SCHEMES", "SHAPE_SETS", "ExpertFrequency", "FrequencyError", "ModelShapes", "Plan",
           "PlanError", "Realization", "Row", "ShapeSet", "SizeError", "TensorShape", "format_size",
           "get_shape_set", "load_frequency", "parse_size", "plan", "plan_all", "read_gguf_shapes"]
