"""A model as the planner sees it: tensor names, shapes and types, what part of the model each tensor is, and the
KV cache per token. Read from any GGUF's header (no weights are read), or made from a named shape set (shapes.py).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelFileError
from ..ggufio import GGUFFile
from ..modelfile import require_moe
from ..moe_tensors import is_expert, parse_expert

# parts of a model, in the order the report lists them
ATTENTION = "attention"
DENSE_FFN = "dense FFN"
SHARED = "shared experts"
ROUTER = "router"
NORMS = "norms"
OUTPUT = "output head"
EMBEDDINGS = "token embeddings"
ROUTED = "routed experts"
OTHER = "other"
PARTS = (ATTENTION, DENSE_FFN, SHARED, ROUTER, NORMS, OUTPUT, EMBEDDINGS, ROUTED, OTHER)

_LAYER_RE = re.compile(r"^blk\.(\d+)\.")
KV_CACHE_BYTES_PER_ELEMENT = 2  # llama.cpp's default F16 K/V cache


def classify(name: str) -> str:
    """The part of the model a tensor belongs to, from its llama.cpp GGUF name."""
    if is_expert(name):
        return ROUTED
    if name == "token_embd.weight":
        return EMBEDDINGS
    if name in ("output.weight", "output_norm.weight"):
        return OUTPUT
    if "_norm." in name:
        return NORMS
    if ".ffn_gate_inp." in name or ".exp_probs_b." in name:
        return ROUTER
    if "_shexp." in name:
        return SHARED
    if ".attn_" in name:
        return ATTENTION
    if re.search(r"\.ffn_(gate|up|down)\.", name):
        return DENSE_FFN
    return OTHER


@dataclass(frozen=True)
class TensorShape:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] (row length) first
    type: str  # ggml type name as stored in the source ("F16", "Q8_0", ...); "BF16" for shape sets

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def part(self) -> str:
        return classify(self.name)

    @property
    def layer(self) -> int | None:
        m = _LAYER_RE.match(self.name)
        return int(m.group(1)) if m else None

    @property
    def role(self) -> str | None:
        """'gate', 'up', 'down' or 'gate_up' for a routed-expert tensor, else None."""
        e = parse_expert(self.name)
        return e.role if e is not None else None


@dataclass(frozen=True)
class ModelShapes:
    """Every tensor of a model plus the hyperparameters placement needs."""

    name: str  # file path or shape-set name
    arch: str  # llama.cpp architecture
    n_layer: int
    n_expert: int
    n_expert_used: int
    kv_elements_per_token: int  # K (+ V unless MLA) cache elements per token, summed over layers
    tensors: tuple[TensorShape, ...]

    @property
    def moe_layers(self) -> list[int]:
        return sorted({t.layer for t in self.tensors if t.part == ROUTED and t.layer is not None})

    def params(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    def active_params(self) -> float:
        """Parameters one token uses: everything except the unused routed experts (n_expert_used of n_expert).
        The embedding table counts whole, as Qwen's and DeepSeek's published active counts do."""
        frac = self.n_expert_used / self.n_expert if self.n_expert else 1.0
        return sum(t.n_elements * (frac if t.part == ROUTED else 1.0) for t in self.tensors)

    @property
    def n_vocab(self) -> int:
        """Rows of the token embedding table (0 without one)."""
        t = next((t for t in self.tensors if t.part == EMBEDDINGS), None)
        return int(t.shape[1]) if t is not None and len(t.shape) > 1 else 0

    def kv_cache_bytes(self, n_ctx: int) -> int:
        return self.kv_elements_per_token * n_ctx * KV_CACHE_BYTES_PER_ELEMENT


def _per_layer(value: object, n_layer: int) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value] + [0] * (n_layer - len(value))
    return [int(value)] * n_layer if isinstance(value, (int, float)) else [0] * n_layer


def read_gguf_shapes(path: str | os.PathLike[str]) -> ModelShapes:
    """ModelShapes of a GGUF from its header (refuses dense models with a one-line ModelFileError)."""
    info = require_moe(path)
    r = GGUFFile(path)
    arch = info.architecture

    def hp(key: str, default: object = 0) -> Any:
        return r.get(f"{arch}.{key}", default)

    n_layer = info.n_layer
    n_embd, n_head = int(hp("embedding_length")), hp("attention.head_count")
    head_kv = _per_layer(hp("attention.head_count_kv", n_head), n_layer)
    heads = _per_layer(n_head, n_layer)
    # llama.cpp: key/value length default to n_embd / n_head; MLA models (both *_mla keys set) cache K only
    key_len = int(hp("attention.key_length", 0)) or (n_embd // max(1, heads[0]))
    val_len = int(hp("attention.value_length", 0)) or (n_embd // max(1, heads[0]))
    mla = bool(hp("attention.key_length_mla", 0)) and bool(hp("attention.value_length_mla", 0))
    kv = sum(h * (key_len + (0 if mla else val_len)) for h in head_kv)
    tensors = tuple(TensorShape(t.name, tuple(int(x) for x in t.shape), t.tensor_type.name) for t in r.tensors)
    if not any(t.part == ROUTED for t in tensors):
        raise ModelFileError(f"{path} has no routed-expert tensors (ffn_*_exps); nothing to place")
    return ModelShapes(name=str(Path(path)), arch=arch, n_layer=n_layer, n_expert=info.n_expert,
                       n_expert_used=info.n_expert_used, kv_elements_per_token=kv, tensors=tensors)
