"""Which ggml type each tensor is stored in under a scheme: the file's own types, a RESplit preset (the
converter's own choice, resplit/typechoice.py), or a Q4_K_M-like all-Q4 model (the rules of llama.cpp's
llama-quant.cpp).

Pure functions of names and shapes; ggml_types.tensor_bytes turns types into bytes.
"""
from __future__ import annotations

import math
from collections.abc import Callable

from ..ggml_types import fit_type, fits_rows
from ..resplit.codecs import codec_of
from ..resplit.presets import Preset
from ..resplit.typechoice import KEEP_F32_RE, plan_expert, tensor_type
from .tensors import ModelShapes, TensorShape

TypeRule = Callable[[TensorShape], str]


def native_types(model: ModelShapes) -> TypeRule:
    """Each tensor as the source stores it."""
    del model
    return lambda t: t.type


# a llama-quantize mixture as the planner approximates it without the file: (most matrices, the output head)
_MIXTURE_TYPES = {"Q3_K_S": ("Q3_K", "Q6_K"), "Q3_K_M": ("Q3_K", "Q6_K"), "Q3_K_L": ("Q4_K", "Q6_K"),
                  "Q4_K_S": ("Q4_K", "Q6_K"), "Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_S": ("Q5_K", "Q6_K"),
                  "Q5_K_M": ("Q5_K", "Q6_K")}


def resplit_types(preset: Preset, model: ModelShapes | None = None) -> TypeRule:
    """The WQ file's types, as the converter chooses them (resplit/typechoice.py): routed experts in WQ (or
    llama-quantize's fallback where rows are not whole blocks of it); the token embedding / output head in the
    preset's type for them where rows fit; 1-D tensors, norms, router and biases F32; other matrices
    `preset.other`, or F16 when their rows are not whole blocks of it. A mixture preset (other = Q4_K_M, ...) is
    approximated: its main type for the matrices, Q6_K for the output head, llama-quantize's fallback where rows
    do not fit (conversion asks llama.cpp for the exact per-tensor types; a converted file is planned with its own).
    The token embedding / output head overrides depend on whether the model has its own output head (a tied
    embedding is the output matmul): from `model`'s tensor names, or without it, an untied head assumed."""
    mixture = _MIXTURE_TYPES.get(preset.other.upper())
    names = {t.name for t in model.tensors} if model is not None else {"output.weight"}
    overrides = preset.tensor_types(names)

    def approx_mixture(name: str, shape: tuple[int, ...], stored: str) -> str:
        del stored
        assert mixture is not None
        if len(shape) == 1 or KEEP_F32_RE.search(name):
            return "F32"
        return fit_type(mixture[1] if name == "output.weight" else mixture[0], shape[0])

    def rule(t: TensorShape) -> str:
        if t.role is not None:
            return plan_expert(t.name, t.shape, preset).wq
        return tensor_type(t.name, t.shape, t.type, preset, overrides, approx_mixture if mixture else None)
    return rule


def sidecar_type(t: TensorShape, preset: Preset) -> str:
    """Type of a routed-expert tensor's sidecar (.wr.gguf) counterpart: the residual, or down's copy (or
    llama-quantize's fallback where rows are not whole blocks of it, as the converter writes it); REFINE1 for the
    refine codec's bit plane (no ggml type: see sidecar_bytes)."""
    return plan_expert(t.name, t.shape, preset).hi


def sidecar_bytes(t: TensorShape, preset: Preset) -> int:
    """Bytes of a routed-expert tensor's sidecar counterpart, as its codec writes it (the refine codec's bit plane:
    one bit per weight; a residual or copy: the size of its ggml type)."""
    return math.prod(codec_of(preset).sidecar_tensor(t.shape, sidecar_type(t, preset))[1])


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _is_quantized(t: TensorShape) -> bool:
    # llama-quant.cpp tensor_allows_quantization: 2-D+ tensors named *weight, not norms, not the router
    return (len(t.shape) >= 2 and t.name.endswith("weight") and "_norm.weight" not in t.name
            and "ffn_gate_inp.weight" not in t.name)


def q4_k_m_types(model: ModelShapes) -> TypeRule:
    """llama-quantize's Q4_K_M mixture for the tensors of MoE models: Q4_K by default; Q6_K for the output head
    (and a tied token_embd), and for attn_v-like tensors (attn_v, attn_qkv, attn_kv_b) and every ffn_down (dense,
    shared and routed) in the 'use_more_bits' layers; Q8_0 attn_k/attn_v and Q5_K attn_output for 8-expert
    models; ggml's fallbacks for rows that are not whole blocks. Unquantized tensors keep their type."""
    attn_v = [t.name for t in model.tensors if _is_quantized(t) and _attn_v_like(t.name)]
    attn_v_index = {name: i for i, name in enumerate(attn_v)}
    eight = model.n_expert == 8
    has_output = any(t.name == "output.weight" for t in model.tensors)

    def base(t: TensorShape) -> str:
        name = t.name
        if name == "output.weight":
            return "Q6_K" if fits_rows("Q6_K", t.shape[0]) else "Q8_0"
        if name == "token_embd.weight":  # a tied head is quantized like the output
            return "Q4_K" if has_output else ("Q6_K" if fits_rows("Q6_K", t.shape[0]) else "Q8_0")
        if _attn_v_like(name):
            if eight:
                return "Q8_0"
            return "Q6_K" if _use_more_bits(attn_v_index[name], len(attn_v)) else "Q4_K"
        if "attn_k.weight" in name and eight:
            return "Q8_0"
        if "attn_output.weight" in name and eight:
            return "Q5_K"
        if "ffn_down" in name and t.layer is not None:
            return "Q6_K" if _use_more_bits(t.layer, model.n_layer) else "Q4_K"
        return "Q4_K"

    def rule(t: TensorShape) -> str:
        if not _is_quantized(t):
            return t.type
        return fit_type(base(t), t.shape[0])
    return rule


def _attn_v_like(name: str) -> bool:
    return any(s in name for s in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight"))
