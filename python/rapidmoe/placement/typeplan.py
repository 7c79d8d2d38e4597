"""Which ggml type each tensor is stored in under a scheme: the file's own types, a RESplit preset (the rules
resplit/convert.py applies), or a Q4_K_M-like all-Q4 model (the rules of llama.cpp's llama-quant.cpp).

Pure functions of names and shapes; sizes.py turns types into bytes.
"""
from __future__ import annotations

from collections.abc import Callable

from ..resplit.convert import KEEP_F32_RE
from ..resplit.presets import Preset
from .sizes import fits_rows
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


def resplit_types(preset: Preset) -> TypeRule:
    """The WQ file's types (resplit/convert.py `_target_type`): routed experts in WQ; 1-D tensors, norms, router
    and biases F32; other matrices `preset.other`, or F16 when their rows are not whole blocks of it. A mixture
    preset (other = Q4_K_M, ...) is approximated: its main type for the matrices, Q6_K for the output head
    (conversion asks llama.cpp for the exact per-tensor types; a converted file is planned with its own)."""
    mixture = _MIXTURE_TYPES.get(preset.other.upper())
    fixed = {"token_embd.weight": preset.token_embd, "output.weight": preset.output}

    def rule(t: TensorShape) -> str:
        if t.role is not None:
            return preset.wq
        ty_fixed = fixed.get(t.name)
        if ty_fixed is not None and fits_rows(ty_fixed, t.shape[0]):
            return ty_fixed.upper()
        if len(t.shape) == 1 or KEEP_F32_RE.search(t.name):
            return "F32"
        if mixture is not None:
            ty = mixture[1] if t.name == "output.weight" else mixture[0]
            return ty if fits_rows(ty, t.shape[0]) else "F16"
        if not fits_rows(preset.other, t.shape[0]):
            return "F16" if preset.other.upper() != "F32" else "F32"
        return preset.other.upper()
    return rule


def sidecar_type(t: TensorShape, preset: Preset) -> str:
    """Type of a routed-expert tensor's sidecar (.wr.gguf) counterpart: the residual, or down's copy."""
    return preset.down_hi if t.role == "down" else preset.wr


# llama-quant.cpp's fallback when rows are not whole blocks of the chosen type
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q2_K": "Q4_0", "Q3_K": "Q4_0"}


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
        ty = base(t)
        if not fits_rows(ty, t.shape[0]):
            ty = _FALLBACK.get(ty, ty)
            if not fits_rows(ty, t.shape[0]):
                ty = "F16"
        return ty
    return rule


def _attn_v_like(name: str) -> bool:
    return any(s in name for s in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight"))
