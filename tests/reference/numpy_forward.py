"""Independent numpy (float64) forward pass for qwen3moe and deepseek2 GGUF files with F16/F32 tensors.

Mirrors llama.cpp's graphs (src/models/qwen3moe.cpp, src/models/deepseek2.cpp, build_moe_ffn in
src/llama-graph.cpp, YaRN RoPE in ggml-cpu/ops.cpp): `forward(path, tokens)` returns logits per position.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np


@dataclass
class Model:
    arch: str
    kv: dict[str, Any]
    tensors: dict[str, np.ndarray] = field(repr=False)

    def hp(self, key: str, default: Any = None) -> Any:
        return self.kv.get(f"{self.arch}.{key}", default)

    def w(self, name: str) -> np.ndarray:
        return np.asarray(self.tensors[name], dtype=np.float64)

    def has(self, name: str) -> bool:
        return name in self.tensors


def load(path: str | Path) -> Model:
    """The model's hyperparameters and (memory-mapped, read-only) tensors; read once per file and kept: gguf-py's
    reader takes seconds on a tokenizer of tens of thousands of tokens, and tests ask for the same file many times
    (the key has the file's size and mtime, so a file written again is read again)."""
    st = Path(path).stat()
    return _load(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _load(path: str, size: int, mtime_ns: int) -> Model:
    reader = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in reader.fields.items() if not k.startswith(("tokenizer.ggml.", "GGUF."))}
    tensors = {}
    for t in reader.tensors:
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            raise ValueError(f"{t.name}: only F16/F32 tensors are supported, got {t.tensor_type.name}")
        tensors[t.name] = t.data  # numpy shape = reversed GGML ne
    return Model(kv["general.architecture"], kv, tensors)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


@dataclass(frozen=True)
class Rope:
    n_dims: int
    neox: bool
    base: float
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    n_ctx_orig: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __call__(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x: (n_tokens, n_heads, n_dims), ggml_rope_ext semantics (NORM: adjacent pairs, NEOX: halves)."""
        half = self.n_dims // 2
        i = np.arange(half)
        theta_extrap = pos[:, None] * self.base ** (-2.0 * i / self.n_dims)[None, :]
        theta = self.freq_scale * theta_extrap
        mscale = self.attn_factor
        if self.ext_factor != 0.0:
            def corr_dim(n_rot: float) -> float:
                return self.n_dims * math.log(self.n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(self.base))
            low = max(0.0, math.floor(corr_dim(self.beta_fast)))
            high = min(self.n_dims - 1.0, math.ceil(corr_dim(self.beta_slow)))
            ramp = (1 - np.clip((i - low) / max(0.001, high - low), 0, 1)) * self.ext_factor
            theta = theta * (1 - ramp) + theta_extrap * ramp
            mscale *= 1.0 + 0.1 * math.log(1.0 / self.freq_scale)
        cos, sin = (np.cos(theta) * mscale)[:, None, :], (np.sin(theta) * mscale)[:, None, :]
        if self.neox:
            x0, x1 = x[..., :half], x[..., half:]
        else:
            x0, x1 = x[..., 0::2], x[..., 1::2]
        y0, y1 = x0 * cos - x1 * sin, x0 * sin + x1 * cos
        out = np.empty_like(x)
        if self.neox:
            out[..., :half], out[..., half:] = y0, y1
        else:
            out[..., 0::2], out[..., 1::2] = y0, y1
        return out


def rope_params(m: Model) -> tuple[Rope, float]:
    """RoPE settings and, for deepseek2, the kq_scale factor mscale^2, as llama_context + the graph derive them."""
    n_rot = m.hp("rope.dimension_count") or m.hp("attention.key_length")
    factor = m.hp("rope.scaling.factor", 0.0) or 1.0
    yarn = m.hp("rope.scaling.type", "linear") == "yarn"
    freq_scale = 1.0 / factor
    ext_factor = 1.0 if yarn else 0.0
    log_mul = m.hp("rope.scaling.yarn_log_multiplier", 0.0) / 0.1 if m.arch == "deepseek2" else 0.0
    attn_factor = 1.0
    if ext_factor != 0.0:
        def get_mscale(scale: float, ms: float) -> float:
            return 1.0 if scale <= 1.0 else 0.1 * ms * math.log(scale) + 1.0
        if log_mul != 0.0:
            ms = log_mul if (m.arch == "deepseek2" and log_mul != 1.0) else 1.0
            attn_factor = get_mscale(factor, ms) / get_mscale(factor, log_mul)
        else:
            attn_factor = get_mscale(factor, 1.0)
        attn_factor /= 1.0 + 0.1 * math.log(factor)
    attn_factor *= m.hp("rope.scaling.attn_factor", 1.0)
    rope = Rope(n_rot, m.arch == "qwen3moe", m.hp("rope.freq_base", 10000.0), freq_scale, ext_factor, attn_factor,
                m.hp("rope.scaling.original_context_length", m.hp("context_length")))
    attn_factor_org = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))
    mscale = attn_factor_org * (1.0 + 0.1 * log_mul * math.log(1.0 / freq_scale))
    return rope, mscale * mscale


def causal_attention(scores: np.ndarray) -> np.ndarray:
    """scores: (n_head, n_tokens, n_tokens) already scaled -> causal softmax probabilities."""
    n = scores.shape[-1]
    scores = np.where(np.tril(np.ones((n, n), dtype=bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def attn_qwen3moe(m: Model, il: int, h: np.ndarray, pos: np.ndarray, rope: Rope) -> np.ndarray:
    p, eps, T = f"blk.{il}.", m.hp("attention.layer_norm_rms_epsilon"), h.shape[0]
    hd, n_head, n_kv = m.hp("attention.key_length"), m.hp("attention.head_count"), m.hp("attention.head_count_kv")
    q = (h @ m.w(p + "attn_q.weight").T).reshape(T, n_head, hd)
    k = (h @ m.w(p + "attn_k.weight").T).reshape(T, n_kv, hd)
    v = (h @ m.w(p + "attn_v.weight").T).reshape(T, n_kv, hd)
    q = rope(rms_norm(q, m.w(p + "attn_q_norm.weight"), eps), pos)
    k = rope(rms_norm(k, m.w(p + "attn_k_norm.weight"), eps), pos)
    kv_of = np.arange(n_head) // (n_head // n_kv)  # GQA: query head -> KV head
    scores = np.einsum("thd,shd->hts", q, k[:, kv_of]) / math.sqrt(hd)
    out = np.einsum("hts,shd->thd", causal_attention(scores), v[:, kv_of]).reshape(T, n_head * hd)
    return out @ m.w(p + "attn_output.weight").T


def attn_mla(m: Model, il: int, h: np.ndarray, pos: np.ndarray, rope: Rope, kq_mscale2: float) -> np.ndarray:
    """DeepSeek MLA in llama.cpp's absorbed form: K = [kv_a_norm(c_kv), rope(k_pe)], V = c_kv, then W_vb per head."""
    p, eps, T = f"blk.{il}.", m.hp("attention.layer_norm_rms_epsilon"), h.shape[0]
    n_head, kv_lora, n_rope = m.hp("attention.head_count"), m.hp("attention.kv_lora_rank"), rope.n_dims
    head_k = m.hp("attention.key_length_mla")
    if m.has(p + "attn_q_a.weight"):
        q = rms_norm(h @ m.w(p + "attn_q_a.weight").T, m.w(p + "attn_q_a_norm.weight"), eps)
        q = q @ m.w(p + "attn_q_b.weight").T
    else:
        q = h @ m.w(p + "attn_q.weight").T
    q = q.reshape(T, n_head, head_k)
    q_nope, q_pe = q[..., : head_k - n_rope], rope(q[..., head_k - n_rope:], pos)
    kv = h @ m.w(p + "attn_kv_a_mqa.weight").T
    c_kv = rms_norm(kv[:, :kv_lora], m.w(p + "attn_kv_a_norm.weight"), eps)
    k_pe = rope(kv[:, None, kv_lora:], pos)[:, 0]
    q_abs = np.einsum("hrd,thd->thr", m.w(p + "attn_k_b.weight"), q_nope)  # k_b: (n_head, kv_lora, nope)
    scores = np.einsum("thr,sr->hts", q_abs, c_kv) + np.einsum("thd,sd->hts", q_pe, k_pe)
    probs = causal_attention(scores * kq_mscale2 / math.sqrt(head_k))
    lat = np.einsum("hts,sr->thr", probs, c_kv)
    out = np.einsum("hvr,thr->thv", m.w(p + "attn_v_b.weight"), lat).reshape(T, -1)  # v_b: (n_head, v_dim, kv_lora)
    return out @ m.w(p + "attn_output.weight").T


def ffn(h: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return (silu(h @ gate.T) * (h @ up.T)) @ down.T


def route(h: np.ndarray, gate_inp: np.ndarray, k: int, gating: str = "softmax",
          exp_probs_b: np.ndarray | None = None, n_group: int = 0, n_group_used: int = 0,
          norm_w: bool = True, scale: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """build_moe_ffn's routing: (selected experts (T, k), their weights (T, k))."""
    logits = h @ gate_inp.T
    if gating == "softmax":
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
    else:
        probs = 1.0 / (1.0 + np.exp(-logits))
    sel = probs + exp_probs_b if exp_probs_b is not None else probs.copy()
    if n_group > 1:
        groups = sel.reshape(sel.shape[0], n_group, -1)
        group_score = -np.sort(-groups, axis=-1)[..., :2].sum(-1)  # sum of each group's top-2
        keep = np.argsort(-group_score, axis=-1, kind="stable")[:, :n_group_used]
        masked = np.full_like(groups, -np.inf)
        np.put_along_axis(masked, keep[..., None], np.take_along_axis(groups, keep[..., None], 1), axis=1)
        sel = masked.reshape(sel.shape)
    experts = np.argsort(-sel, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, experts, axis=-1)
    if norm_w:
        w = w / np.maximum(w.sum(-1, keepdims=True), 6.103515625e-5)
    if scale not in (0.0, 1.0):
        w = w * scale
    return experts, w


def moe_layer(h: np.ndarray, gate_inp: np.ndarray, up_exps: np.ndarray, gate_exps: np.ndarray,
              down_exps: np.ndarray, k: int, gating: str = "softmax", exp_probs_b: np.ndarray | None = None,
              n_group: int = 0, n_group_used: int = 0, norm_w: bool = True, scale: float = 0.0,
              shared: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """One MoE FFN on RMS-normed hidden states h (T, n_embd); expert tensors in numpy (n_expert, out, in) order.

    shared = (gate_shexp, up_shexp, down_shexp) adds the shared expert. Returns (T, n_embd).
    """
    experts, w = route(h, gate_inp, k, gating, exp_probs_b, n_group, n_group_used, norm_w, scale)
    out = np.zeros_like(h)
    for e in np.unique(experts):
        tok, slot = np.nonzero(experts == e)
        y = ffn(h[tok], np.asarray(gate_exps[e], np.float64), np.asarray(up_exps[e], np.float64),
                np.asarray(down_exps[e], np.float64))
        out[tok] += w[tok, slot][:, None] * y
    if shared is not None:
        out += ffn(h, *shared)
    return out


def ffn_block(m: Model, il: int, h: np.ndarray) -> np.ndarray:
    p = f"blk.{il}."
    if m.has(p + "ffn_gate.weight"):  # deepseek2 leading dense layer
        return ffn(h, m.w(p + "ffn_gate.weight"), m.w(p + "ffn_up.weight"), m.w(p + "ffn_down.weight"))
    ds = m.arch == "deepseek2"
    shared = tuple(m.w(p + f"ffn_{n}_shexp.weight") for n in ("gate", "up", "down")) if ds else None
    gating = {1: "softmax", 2: "sigmoid"}[m.hp("expert_gating_func", 1)] if ds else "softmax"
    return moe_layer(h, m.w(p + "ffn_gate_inp.weight"), m.tensors[p + "ffn_up_exps.weight"],
                     m.tensors[p + "ffn_gate_exps.weight"], m.tensors[p + "ffn_down_exps.weight"],
                     m.hp("expert_used_count"), gating,
                     m.w(p + "exp_probs_b.bias") if m.has(p + "exp_probs_b.bias") else None,
                     m.hp("expert_group_count", 0), m.hp("expert_group_used_count", 0),
                     bool(m.hp("expert_weights_norm", True)) if ds else True,
                     m.hp("expert_weights_scale", 0.0), shared)  # type: ignore[arg-type]


def forward(model: str | Path | Model, tokens: list[int] | np.ndarray) -> np.ndarray:
    """Logits (n_tokens, n_vocab) for a token sequence starting at position 0, float64."""
    m = model if isinstance(model, Model) else load(model)
    head = m.tensors["output.weight"] if m.has("output.weight") else m.tensors["token_embd.weight"]
    return hidden(m, tokens) @ np.asarray(head, np.float64).T


def hidden(model: str | Path | Model, tokens: list[int] | np.ndarray) -> np.ndarray:
    """The last hidden states after the output norm (n_tokens, n_embd), float64: llama.cpp's per-token
    embeddings (`result_norm`, what pooling none returns and the other poolings pool)."""
    m = model if isinstance(model, Model) else load(model)
    if m.arch not in ("qwen3moe", "deepseek2"):
        raise ValueError(f"unsupported architecture {m.arch!r}")
    eps = m.hp("attention.layer_norm_rms_epsilon")
    tokens = np.asarray(tokens, dtype=np.int64)
    pos = np.arange(len(tokens), dtype=np.float64)
    rope, kq_mscale2 = rope_params(m)
    x = np.asarray(m.tensors["token_embd.weight"][tokens], np.float64)
    for il in range(m.hp("block_count")):
        h = rms_norm(x, m.w(f"blk.{il}.attn_norm.weight"), eps)
        if m.arch == "qwen3moe":
            x = x + attn_qwen3moe(m, il, h, pos, rope)
        else:
            x = x + attn_mla(m, il, h, pos, rope, kq_mscale2)
        x = x + ffn_block(m, il, rms_norm(x, m.w(f"blk.{il}.ffn_norm.weight"), eps))
    return rms_norm(x, m.w("output_norm.weight"), eps)
