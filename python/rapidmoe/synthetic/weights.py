"""Deterministic weights that look trained where it matters, and the router skew they produce.

Every tensor has its own generator seeded from sha256(generator version, spec.seed, tensor name), so a
tensor's bytes do not depend on the order in which tensors are written. A tensor is drawn in pieces (an expert, a
block of rows, a head) in file order, so that a writer holds one piece at a time whatever the tensor's size.
"""
from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from .spec import (
    ATTN_OUT,
    DENSE_DOWN,
    EMBD,
    NORM,
    OUTPUT,
    PROBS_B,
    ROUTED,
    ROUTED_DOWN,
    ROUTER,
    SHARED_DOWN,
    SyntheticSpec,
    TensorPlan,
)

log = logging.getLogger(__name__)

# Bump whenever the bytes written for some spec change (cached models are keyed by it).
GENERATOR_VERSION = 1

T_DF = 5.0  # matrix entries: Student-t, 5 degrees of freedom (kurtosis 9), scaled to unit variance
ROW_SIGMA = 0.25  # log-normal per-output-channel scales
COL_SIGMA = 0.30  # log-normal per-input-channel scales (max ~2.5-3x the RMS over 1k channels)
EXPERT_COL_SIGMA = 0.10  # experts of a layer share input-channel scales up to this extra variation
NORM_SIGMA = 0.10  # norm weights: log-normal around 1
N_MASSIVE = 2  # "massive activation" channels: a constant offset in every token embedding ...
MASSIVE_ENERGY = 0.5  # ... carrying this much energy relative to the other channels together (a^2 = 0.5 n_embd)
RESIDUAL_VAR = 1.5  # assumed per-channel variance of the non-massive part of a layer input (router calibration)
LOGIT_STD = 3.0  # target std of output logits
EMBD_ROWS_PER_CHUNK = 16384
# matrices with more weights than this are drawn in blocks of rows as the embeddings are (row scales per block, one
# set of column scales), and embeddings in blocks of fewer rows than EMBD_ROWS_PER_CHUNK where those would exceed it;
# the named sizes have none so large, so their bytes are what they were before pieces
MATRIX_CHUNK_WEIGHTS = 16 << 20


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"rapidmoe-synthetic/{GENERATOR_VERSION}/{seed}/{name}".encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))


def _heavy(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Student-t(T_DF) samples with unit variance, float32 (normal / sqrt(chi2/df))."""
    z = rng.standard_normal(shape, dtype=np.float32)
    g = rng.standard_gamma(T_DF / 2, shape, dtype=np.float32)
    z *= np.float32(math.sqrt(T_DF / 2 * (T_DF - 2) / T_DF)) / np.sqrt(g)
    return z


def _scales(rng: np.random.Generator, n: int, sigma: float) -> np.ndarray:
    """Log-normal scales with mean square 1."""
    s = np.exp(sigma * rng.standard_normal(n))
    scales: np.ndarray = (s / np.sqrt(np.mean(s * s))).astype(np.float32)  # numpy types a mean's quotient Any
    return scales


def massive_channels(spec: SyntheticSpec) -> tuple[np.ndarray, np.ndarray]:
    """Indices and signs of the massive-activation channels."""
    rng = tensor_rng(spec.seed, "massive_channels")
    idx = np.sort(rng.choice(spec.n_embd, N_MASSIVE, replace=False))
    signs = rng.choice(np.array([-1.0, 1.0]), N_MASSIVE)
    return idx, signs


def massive_vector(spec: SyntheticSpec) -> np.ndarray:
    """The constant part a*u of every token embedding (|a*u|^2 = MASSIVE_ENERGY * n_embd)."""
    idx, signs = massive_channels(spec)
    v = np.zeros(spec.n_embd)
    v[idx] = signs * math.sqrt(MASSIVE_ENERGY * spec.n_embd / N_MASSIVE)
    return v


def _gain(spec: SyntheticSpec, role: str) -> float:
    # residual-branch outputs are damped so that 2*n_layer branches add up to about one unit of variance
    return 1.0 / math.sqrt(2 * spec.n_layer) if role in (ATTN_OUT, ROUTED_DOWN, SHARED_DOWN, DENSE_DOWN) else 1.0


def _matrix(rng: np.random.Generator, n_out: int, n_in: int, gain: float,
            col: np.ndarray | None = None) -> np.ndarray:
    row = _scales(rng, n_out, ROW_SIGMA)
    if col is None:
        col = _scales(rng, n_in, COL_SIGMA)
    w = _heavy(rng, (n_out, n_in))
    w *= row[:, None] * np.float32(gain / math.sqrt(n_in))
    w *= col[None, :]
    return w


def _norm(spec: SyntheticSpec, name: str, n: int) -> np.ndarray:
    w = np.exp(NORM_SIGMA * tensor_rng(spec.seed, name).standard_normal(n))
    if name == "output_norm.weight" and spec.tied_embeddings:
        w *= LOGIT_STD / math.sqrt(spec.n_embd)  # the tied head has unit-scale rows: shrink its input instead
    return w.astype(np.float32)


def _router(spec: SyntheticSpec, layer: int) -> np.ndarray:
    """ffn_gate_inp: logits = -offset - popularity_e + logit_std * N(0, 1) on layer-input-like hidden states.

    Layer inputs are x = r*g + a*u (g ~ N(0, I), r^2 = RESIDUAL_VAR, a*u = massive_vector). After RMSNorm and
    ffn_norm, h carries a constant component along u, which the router's massive-channel columns turn into
    the negative offset. Softmax gating ignores it; sigmoid gating needs it so that sigmoid(logit) ~ exp(logit)
    near the top-k and the renormalised top-k weights are skewed like a softmax.
    """
    d, e = spec.n_embd, spec.n_expert
    rng = tensor_rng(spec.seed, f"blk.{layer}.ffn_gate_inp.weight")
    w_norm = _norm(spec, f"blk.{layer}.ffn_norm.weight", d).astype(np.float64)
    idx, signs = massive_channels(spec)
    rms = math.sqrt(RESIDUAL_VAR + MASSIVE_ENERGY)
    rest = np.ones(d, dtype=bool)
    rest[idx] = False
    k_rand = RESIDUAL_VAR / rms**2 * float(np.sum(w_norm[rest] ** 2))  # E|h_random|^2
    w = rng.standard_normal((e, d)) * (spec.router_logit_std / math.sqrt(k_rand))
    w[:, idx] = 0.0
    popularity = spec.router_popularity_std * rng.standard_normal(e)
    a_k = math.sqrt(MASSIVE_ENERGY * d / N_MASSIVE)  # |x| in each massive channel
    # h[idx_k] = signs_k * a_k / rms * w_norm[idx_k]; spread the offset evenly over the massive channels
    w[:, idx] = -(spec.router_logit_offset + popularity)[:, None] * signs[None, :] / (
        N_MASSIVE * a_k / rms * w_norm[idx][None, :])
    return w.astype(np.float32)


def _probs_b(spec: SyntheticSpec, layer: int) -> np.ndarray:
    """exp_probs_b: small selection bias relative to a typical top-k sigmoid probability."""
    rng = tensor_rng(spec.seed, f"blk.{layer}.exp_probs_b.bias")
    p_typ = 1.0 / (1.0 + math.exp(spec.router_logit_offset - 1.5 * spec.router_logit_std))
    return (spec.exp_probs_b_std * p_typ * rng.standard_normal(spec.n_expert)).astype(np.float32)


def _row_blocks(rng: np.random.Generator, n_rows: int, n_in: int, gain: float, rows_per_block: int,
                offset: np.ndarray | None = None) -> Iterator[np.ndarray]:
    """A matrix drawn in blocks of rows: one set of column scales, then per block its row scales and weights."""
    col = _scales(rng, n_in, COL_SIGMA)
    for start in range(0, n_rows, rows_per_block):
        chunk = _matrix(rng, min(rows_per_block, n_rows - start), n_in, gain, col)
        if offset is not None:
            chunk += offset
        yield chunk


def _embedding(spec: SyntheticSpec, t: TensorPlan) -> Iterator[np.ndarray]:
    rng = tensor_rng(spec.seed, t.name)
    _, d = t.shape
    massive = massive_vector(spec).astype(np.float32) if t.role == EMBD else None
    # embedding rows have unit RMS (gain * sqrt(d) / sqrt(d)); the untied head scales to LOGIT_STD
    gain = math.sqrt(d) if t.role == EMBD else LOGIT_STD
    rows = EMBD_ROWS_PER_CHUNK if EMBD_ROWS_PER_CHUNK * d <= MATRIX_CHUNK_WEIGHTS else _block_rows(d)
    yield from _row_blocks(rng, t.shape[0], d, gain, rows, massive)


def _block_rows(n_in: int) -> int:
    """Rows per block of a large matrix (about 4 M weights: 16 MB of float32)."""
    return max(1, MATRIX_CHUNK_WEIGHTS // 4 // n_in)


def generate_pieces(spec: SyntheticSpec, t: TensorPlan) -> Iterator[np.ndarray]:
    """The data of one planned tensor as float32 pieces that follow each other in the file (numpy order, split along
    the first axis: an expert, a block of rows, a head, or the whole tensor)."""
    if t.role == NORM:
        yield _norm(spec, t.name, t.shape[0])
        return
    if t.role == ROUTER:
        yield _router(spec, t.layer)
        return
    if t.role == PROBS_B:
        yield _probs_b(spec, t.layer)
        return
    if t.role in (EMBD, OUTPUT):
        yield from _embedding(spec, t)
        return
    rng = tensor_rng(spec.seed, t.name)
    gain = _gain(spec, t.role)
    if len(t.shape) == 2:
        n_out, n_in = t.shape
        if n_out * n_in <= MATRIX_CHUNK_WEIGHTS:
            yield _matrix(rng, n_out, n_in, gain)
        else:
            yield from _row_blocks(rng, n_out, n_in, gain, _block_rows(n_in))
    elif t.role in (ROUTED, ROUTED_DOWN):
        n_exp, n_out, n_in = t.shape
        col = _scales(rng, n_in, COL_SIGMA)
        for _ in range(n_exp):
            yield _matrix(rng, n_out, n_in, gain, col * _scales(rng, n_in, EXPERT_COL_SIGMA))
    elif t.name.endswith("attn_k_b.weight"):
        # per head, k_nope = K_h @ latent with K_h of shape (nope, kv_lora); stored transposed
        n_head, kv_lora, nope = t.shape
        for _ in range(n_head):
            yield np.ascontiguousarray(_matrix(rng, nope, kv_lora, gain).T)
    else:  # attn_v_b: per head (v_head_dim, kv_lora)
        for _ in range(t.shape[0]):
            yield _matrix(rng, t.shape[1], t.shape[2], gain)


def generate(spec: SyntheticSpec, t: TensorPlan) -> np.ndarray:
    """The data of one planned tensor, whole, as float32 (norms, router, biases) or spec.dtype when that is f16 or
    f32 (the pieces of generate_pieces in one array; the writer converts bf16 and q8_0 piece by piece)."""
    dtype = np.float32 if t.f32 or spec.dtype != "f16" else np.float16
    out = np.empty(t.shape, dtype=dtype)
    flat = out.reshape(-1)
    at = 0
    for piece in generate_pieces(spec, t):
        flat[at: at + piece.size] = piece.reshape(-1)
        at += piece.size
    assert at == flat.size, t.name
    return out


# --- router skew -----------------------------------------------------------------------------------------------

def _route(spec: SyntheticSpec, logits: np.ndarray, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's build_moe_ffn selection: (selected experts, renormalised weights before the scale)."""
    k = spec.n_expert_used
    if spec.gating == "softmax":
        z = logits - logits.max(-1, keepdims=True)
        probs = np.exp(z)
        probs /= probs.sum(-1, keepdims=True)
    else:
        probs = 1.0 / (1.0 + np.exp(-logits))
    sel = probs + bias if bias is not None else probs.copy()
    if spec.n_group > 1:
        n_tok = sel.shape[0]
        groups = sel.reshape(n_tok, spec.n_group, -1)
        top2 = -np.sort(-groups, axis=-1)[..., :2].sum(-1)
        keep = np.argsort(-top2, axis=-1, kind="stable")[:, : spec.n_group_used]
        mask = np.full(groups.shape, -np.inf)
        np.put_along_axis(mask, keep[..., None], 0.0, axis=1)
        sel = (groups + mask).reshape(n_tok, -1)
    experts = np.argsort(-sel, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, experts, axis=-1)
    return experts, w / w.sum(-1, keepdims=True)


def router_skew_stats(spec: SyntheticSpec, n_tokens: int = 4096, residual_var: float = RESIDUAL_VAR,
                      seed: int = 1234) -> dict[str, Any]:
    """Mean renormalised top-k weight by rank (largest first), per MoE layer, on layer-input-like states.

    Hidden states: x = sqrt(residual_var) * N(0, I) + massive_vector, RMS-normalised, times ffn_norm; routed
    exactly like llama.cpp (softmax, or sigmoid + exp_probs_b + group selection), weights renormalised over
    the selected experts (the deepseek2 expert_weights_scale multiplies them all and is left out here).
    """
    rng = np.random.default_rng(seed)
    base = massive_vector(spec)
    per_layer: dict[int, list[float]] = {}
    load_ratio = []
    for il in spec.moe_layers:
        x = math.sqrt(residual_var) * rng.standard_normal((n_tokens, spec.n_embd)) + base
        w_norm = _norm(spec, f"blk.{il}.ffn_norm.weight", spec.n_embd)
        h = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + spec.rms_norm_eps) * w_norm
        logits = h @ _router(spec, il).astype(np.float64).T
        bias = _probs_b(spec, il).astype(np.float64) if spec.arch == "deepseek2" else None
        experts, w = _route(spec, logits, bias)
        per_layer[il] = np.sort(w, axis=-1)[:, ::-1].mean(0).tolist()
        counts = np.bincount(experts.ravel(), minlength=spec.n_expert)
        load_ratio.append(float(counts.max() / counts.mean()))
    mean = np.mean(np.array(list(per_layer.values())), axis=0)
    return {
        "gating": spec.gating,
        "n_expert": spec.n_expert,
        "n_expert_used": spec.n_expert_used,
        "n_tokens": n_tokens,
        "per_layer": per_layer,
        "mean_rank_weight": mean.tolist(),
        "rank1": float(mean[0]),
        "rank12": float(mean[:2].sum()),
        "max_expert_load_over_mean": float(np.mean(load_ratio)),
    }
