"""Deterministic synthetic Mixture-of-Experts GGUF models (qwen3moe, deepseek2) that stock llama.cpp runs.

Trained-like weight statistics and a skewed router (weights.py), a real llama.cpp tokenizer and a chat template
that fits it, named sizes and per-token byte accounting (spec.py), streamed atomic writing (writer.py). Same spec
-> byte-identical file.
"""
from __future__ import annotations

from .spec import (
    ARCHS,
    CHAT_TEMPLATES,
    DEEPSEEK_V3_LAYERS,
    SHAPES,
    SIZE_NAMES,
    SIZES,
    VOCAB_SIZES,
    SyntheticSpec,
    TensorPlan,
    describe,
    spec_for,
    spec_for_shape,
    tensor_plan,
)
from .weights import GENERATOR_VERSION, generate, generate_pieces, router_skew_stats
from .writer import read_chat_template, read_spec, read_tokenizer, vocab_file, write_model

__all__ = [
    "ARCHS", "CHAT_TEMPLATES", "DEEPSEEK_V3_LAYERS", "GENERATOR_VERSION", "SHAPES", "SIZES", "SIZE_NAMES",
    "VOCAB_SIZES", "SyntheticSpec", "TensorPlan", "describe", "generate", "generate_pieces", "read_chat_template",
    "read_spec", "read_tokenizer", "router_skew_stats", "spec_for", "spec_for_shape", "tensor_plan", "vocab_file",
    "write_model",
]
