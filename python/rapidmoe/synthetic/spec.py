"""Synthetic MoE model specifications: the SyntheticSpec dataclass, the named sizes and the tensor plan.

`tensor_plan()` lists every tensor llama.cpp expects (names, numpy shapes, GGML types) for a spec;
`describe()` turns it into parameter counts and bytes read per decoded token.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, NoReturn

log = logging.getLogger(__name__)

ARCHS = ("qwen3moe", "deepseek2")
# the matrices' file type: f16, f32, bf16, or q8_0 (ggml's Q8_0 blocks of 32); norms, router and biases stay F32
DTYPES = ("f16", "f32", "bf16", "q8_0")
LLAMA_MAX_EXPERTS = 512  # llama.cpp's limit (src/llama-hparams.h)

# Token counts of llama.cpp's vocab-only GGUFs (models/ggml-vocab-NAME.gguf), for describe() without the files.
VOCAB_SIZES: dict[str, int] = {
    "qwen2": 151936,
    "deepseek-llm": 102400,
    "deepseek-coder": 32256,
    "gpt-2": 50257,
    "llama-bpe": 128256,
    "llama-spm": 32000,
}
DEFAULT_VOCAB = {"qwen3moe": "qwen2", "deepseek2": "deepseek-llm"}
# The chat template (llama.cpp's models/templates/NAME.jinja) that chat_template="auto" writes for a tokenizer: one
# that fits its special tokens and that the server parses tool calls and reasoning from. Other vocabs get none
# (the server then uses ChatML, as llama-server does).
CHAT_TEMPLATES = {"qwen2": "Qwen-Qwen3-0.6B", "deepseek-llm": "llama-cpp-deepseek-r1",
                  "deepseek-coder": "llama-cpp-deepseek-r1"}
DEFAULT_ROPE_BASE = {"qwen3moe": 1_000_000.0, "deepseek2": 10_000.0}

# Router defaults (see weights.py for the construction). Logits of a layer input are roughly
#   -router_logit_offset - popularity_e + router_logit_std * N(0, 1)    per expert e.
# Measured mean renormalised top-k weight by rank (router_skew_stats, 4096 tokens):
#   qwen3moe  bench (softmax, top-8 of 64):                   0.52 0.18 0.10 0.07 0.05 0.03 0.03 0.02
#   deepseek2 bench (sigmoid + bias, 4 of 8 groups, top-8/64): 0.50 0.20 0.12 0.07 0.05 0.03 0.02 0.01
#   top-4 (tiny/small): rank 1 gets 0.6-0.75. The same holds on the real layer inputs of the numpy reference
#   forward pass. A larger router_logit_std sharpens the skew, a smaller one flattens it.
DEFAULT_ROUTER_LOGIT_STD = 3.0
DEFAULT_ROUTER_LOGIT_OFFSET = 9.0
DEFAULT_ROUTER_POPULARITY_STD = 0.3
DEFAULT_EXP_PROBS_B_STD = 0.1

# K-quants (Q4_K, Q6_K, ...) need rows that are multiples of 256 elements, which RESplit conversion relies on.
# llama.cpp itself needs nothing of the kind for F16/F32, so SyntheticSpec only requires multiples of 32;
# every named size below uses multiples of 256 for n_embd, n_ff_exp, n_ff and the MLA ranks.
QK_K = 256


def _fail(msg: str) -> NoReturn:
    raise ValueError(f"invalid SyntheticSpec: {msg}")


@dataclass(frozen=True)
class SyntheticSpec:
    """Shape, tokenizer, seed and weight statistics of one synthetic MoE model.

    Fields marked (qwen3moe) or (deepseek2) apply to that architecture only and must keep their defaults
    for the other. `vocab=None` and `rope_freq_base=None` pick the architecture's default.
    """

    arch: str
    n_embd: int
    n_layer: int
    n_head: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    # qwen3moe attention: GQA with per-head q/k RMSNorm
    n_head_kv: int = 0  # (qwen3moe) 0 = n_head
    head_dim: int = 0  # (qwen3moe) 0 = n_embd // n_head
    # deepseek2: MLA attention, leading dense layers, shared expert, grouped sigmoid routing
    n_ff: int = 0  # (deepseek2) FFN width of the leading dense layers
    n_expert_shared: int = 0  # (deepseek2)
    n_layer_dense_lead: int = 0  # (deepseek2)
    q_lora_rank: int = 0  # (deepseek2) 0 = no q compression (plain attn_q, "lite" layout)
    kv_lora_rank: int = 0  # (deepseek2)
    qk_rope_head_dim: int = 0  # (deepseek2)
    qk_nope_head_dim: int = 0  # (deepseek2)
    v_head_dim: int = 0  # (deepseek2)
    n_group: int = 1  # (deepseek2) expert groups; 1 = no group selection
    n_group_used: int = 1  # (deepseek2)
    expert_weights_scale: float = 1.0  # (deepseek2) routed output scale (DeepSeek-V3: 2.5)
    rope_scaling_factor: float = 1.0  # (deepseek2) > 1: YaRN as in DeepSeek-V3 (mscale_all_dim = 1)
    # common
    vocab: str | None = None
    tied_embeddings: bool = False  # True: no output.weight (token_embd is the head; random models echo input)
    context_length: int = 4096
    rope_freq_base: float | None = None
    rms_norm_eps: float = 1e-6
    seed: int = 0
    dtype: str = "f16"  # matrices; norms, router, exp_probs_b and other 1-D tensors are always F32
    # router skew (see weights.py)
    router_logit_std: float = DEFAULT_ROUTER_LOGIT_STD
    router_logit_offset: float = DEFAULT_ROUTER_LOGIT_OFFSET
    router_popularity_std: float = DEFAULT_ROUTER_POPULARITY_STD
    exp_probs_b_std: float = DEFAULT_EXP_PROBS_B_STD  # (deepseek2) relative to a typical top-k probability
    name: str = ""  # general.name; "" = derived from the spec
    chat_template: str = "auto"  # "auto" (CHAT_TEMPLATES[vocab], if any), "none", or NAME: models/templates/NAME.jinja

    def __post_init__(self) -> None:
        fail = _fail
        if self.arch not in ARCHS:
            fail(f"unknown arch {self.arch!r} (supported: {', '.join(ARCHS)})")
        if self.dtype not in DTYPES:
            fail(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for field in ("n_embd", "n_layer", "n_head", "n_ff_exp", "context_length"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                fail(f"{field} must be a positive integer, got {value!r}")
        if self.n_expert < 1:
            fail(f"n_expert must be >= 1 (zero experts is not a MoE model), got {self.n_expert}")
        if self.n_expert > LLAMA_MAX_EXPERTS:
            fail(f"n_expert must be <= {LLAMA_MAX_EXPERTS} (llama.cpp limit), got {self.n_expert}")
        if not 1 <= self.n_expert_used <= self.n_expert:
            fail(f"n_expert_used must be in [1, n_expert={self.n_expert}], got {self.n_expert_used}")
        if self.n_embd % 32 or self.n_ff_exp % 32:
            fail(f"n_embd ({self.n_embd}) and n_ff_exp ({self.n_ff_exp}) must be multiples of 32 "
                 f"(use multiples of {QK_K} for K-quants)")
        if self.seed < 0:
            fail(f"seed must be >= 0, got {self.seed}")
        if self.rms_norm_eps <= 0:
            fail("rms_norm_eps must be > 0")
        if self.router_logit_std < 0 or self.router_popularity_std < 0 or self.exp_probs_b_std < 0:
            fail("router_logit_std, router_popularity_std and exp_probs_b_std must be >= 0")
        if self.vocab is None:
            object.__setattr__(self, "vocab", DEFAULT_VOCAB[self.arch])
        if not self.vocab or "/" in self.vocab:
            fail(f"vocab must be a name like 'qwen2' (models/ggml-vocab-NAME.gguf), got {self.vocab!r}")
        if self.rope_freq_base is None:
            object.__setattr__(self, "rope_freq_base", DEFAULT_ROPE_BASE[self.arch])
        if not self.chat_template or "/" in self.chat_template or self.chat_template.endswith(".jinja"):
            fail(f"chat_template must be 'auto', 'none' or a template name like 'Qwen-Qwen3-0.6B' "
                 f"(models/templates/NAME.jinja), got {self.chat_template!r}")
        if self.rope_freq_base is None or self.rope_freq_base <= 0:
            fail("rope_freq_base must be > 0")
        if self.arch == "qwen3moe":
            self._check_qwen3moe()
        else:
            self._check_deepseek2()

    def _check_qwen3moe(self) -> None:
        fail = _fail
        ds_only = ("n_ff", "n_expert_shared", "n_layer_dense_lead", "q_lora_rank", "kv_lora_rank",
                   "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        for field in ds_only:
            if getattr(self, field) != 0:
                fail(f"{field} is a deepseek2 parameter; qwen3moe has none (got {getattr(self, field)})")
        if self.n_group != 1 or self.n_group_used != 1:
            fail("expert groups (n_group, n_group_used) are deepseek2 only")
        if self.expert_weights_scale != 1.0 or self.rope_scaling_factor != 1.0:
            fail("expert_weights_scale and rope_scaling_factor are deepseek2 only")
        if self.n_head_kv == 0:
            object.__setattr__(self, "n_head_kv", self.n_head)
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        if self.n_head_kv < 1 or self.n_head % self.n_head_kv:
            fail(f"n_head ({self.n_head}) must be a multiple of n_head_kv ({self.n_head_kv})")
        if self.head_dim < 2 or self.head_dim % 2:
            fail(f"head_dim must be a positive even number (RoPE), got {self.head_dim}")

    def _check_deepseek2(self) -> None:
        fail = _fail
        if self.n_head_kv not in (0, 1) or self.head_dim != 0:
            fail("n_head_kv and head_dim are qwen3moe parameters; deepseek2 uses the MLA sizes")
        object.__setattr__(self, "n_head_kv", 1)  # MLA is stored as MQA with one latent KV head
        for field in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_expert_shared"):
            if getattr(self, field) < 1:
                fail(f"{field} must be >= 1 for deepseek2, got {getattr(self, field)}")
        if self.q_lora_rank < 0:
            fail(f"q_lora_rank must be >= 0 (0 = uncompressed q), got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            fail(f"qk_rope_head_dim must be even (RoPE), got {self.qk_rope_head_dim}")
        if not 0 <= self.n_layer_dense_lead < self.n_layer:
            fail(f"n_layer_dense_lead must be in [0, n_layer) so that some layer is MoE, "
                 f"got {self.n_layer_dense_lead} with n_layer={self.n_layer}")
        if self.n_layer_dense_lead > 0 and (self.n_ff <= 0 or self.n_ff % 32):
            fail(f"n_ff (dense FFN width) must be a positive multiple of 32 with leading dense layers, got {self.n_ff}")
        if self.n_layer in (26, 27) and self.q_lora_rank > 0:
            fail("llama.cpp treats deepseek2 with 26 or 27 layers as the 'lite' variant without q_lora_rank; "
                 "pick another n_layer or q_lora_rank=0")
        if self.n_group < 1 or self.n_expert % self.n_group:
            fail(f"n_group ({self.n_group}) must divide n_expert ({self.n_expert})")
        if self.n_group > 1:
            if self.n_group >= self.n_expert:
                fail(f"n_group ({self.n_group}) must be < n_expert ({self.n_expert}) (llama.cpp)")
            if not 1 <= self.n_group_used < self.n_group:
                fail(f"n_group_used must be in [1, n_group) (llama.cpp), got {self.n_group_used} of {self.n_group}")
            if self.n_group_used * (self.n_expert // self.n_group) < self.n_expert_used:
                fail(f"n_group_used={self.n_group_used} groups of {self.n_expert // self.n_group} experts "
                     f"cannot hold n_expert_used={self.n_expert_used}")
        elif self.n_group_used != 1:
            fail("n_group_used must be 1 without expert groups (n_group=1)")
        if self.expert_weights_scale <= 0:
            fail(f"expert_weights_scale must be > 0, got {self.expert_weights_scale}")
        if self.rope_scaling_factor < 1:
            fail(f"rope_scaling_factor must be >= 1 (1 = no YaRN), got {self.rope_scaling_factor}")
        if self.rope_scaling_factor > 1 and self.context_length % self.rope_scaling_factor:
            fail("context_length must be a multiple of rope_scaling_factor (original context = their ratio)")

    # --- derived values -------------------------------------------------------------------------------------

    @property
    def gating(self) -> str:
        """'softmax' (qwen3moe) or 'sigmoid' (deepseek2)."""
        return "softmax" if self.arch == "qwen3moe" else "sigmoid"

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.n_layer_dense_lead, self.n_layer))

    @property
    def template_name(self) -> str | None:
        """The chat template file's name (without .jinja) this model carries, or None."""
        if self.chat_template == "auto":
            return CHAT_TEMPLATES.get(str(self.vocab))
        return None if self.chat_template == "none" else self.chat_template

    @property
    def model_name(self) -> str:
        return self.name or f"rapidmoe-synthetic-{self.arch}-s{self.seed}"

    def replace(self, **changes: Any) -> SyntheticSpec:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _qwen(**kw: Any) -> dict[str, Any]:
    return dict(arch="qwen3moe", **kw)


def _ds(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"arch": "deepseek2", "n_expert_shared": 1, "n_layer_dense_lead": 1, "qk_rope_head_dim": 64,
                            "qk_nope_head_dim": 128, "v_head_dim": 128, "expert_weights_scale": 2.5}
    base.update(kw)
    return base


# Named sizes, all with an untied output head, F16 matrices (describe(); files add ~1-6 MB of tokenizer):
#   arch      size    params     active/token  tensors   read/token  routed share  vocab
#   qwen3moe  tiny      20.1 M    10.2 M          40 MB    20.5 MB   0.15          deepseek-coder (32256)
#   qwen3moe  small    139.1 M    34.5 M         278 MB    69.2 MB   0.36          deepseek-coder
#   qwen3moe  bench   4062.5 M   736.0 M        8128 MB  1475.3 MB   0.61          qwen2 (151936)
#   deepseek2 tiny      21.8 M    11.9 M          44 MB    23.9 MB   0.13          deepseek-coder
#   deepseek2 small    134.3 M    40.8 M         269 MB    81.8 MB   0.27          deepseek-coder
#   deepseek2 bench   3881.6 M   737.9 M        7766 MB  1479.0 MB   0.59          deepseek-llm (102400)
# "routed share" = routed experts' part of the weight bytes one decoded token reads; in the bench sizes it is
# the majority, as in Qwen3-30B-A3B / DeepSeek-V3 (tiny/small are dominated by the 32k-token head instead).
_SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "qwen3moe": {
        "tiny": _qwen(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_expert=8, n_expert_used=4,
                      n_ff_exp=256, vocab="deepseek-coder", context_length=2048),
        "small": _qwen(n_embd=512, n_layer=8, n_head=8, n_head_kv=2, head_dim=64, n_expert=32, n_expert_used=4,
                       n_ff_exp=256, vocab="deepseek-coder", context_length=4096),
        # Qwen3-30B-A3B proportions (head_dim 128, 4 KV heads, n_ff_exp / n_embd = 0.75, top-8 of 64)
        "bench": _qwen(n_embd=1024, n_layer=24, n_head=16, n_head_kv=4, head_dim=128, n_expert=64,
                       n_expert_used=8, n_ff_exp=768, vocab="qwen2", context_length=8192),
    },
    "deepseek2": {
        "tiny": _ds(n_embd=256, n_layer=3, n_head=4, n_expert=8, n_expert_used=4, n_ff_exp=256, n_ff=512,
                    q_lora_rank=256, kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                    n_group=4, n_group_used=3, vocab="deepseek-coder", context_length=2048, rope_scaling_factor=4.0),
        "small": _ds(n_embd=512, n_layer=8, n_head=8, n_expert=32, n_expert_used=4, n_ff_exp=256, n_ff=1536,
                     q_lora_rank=256, kv_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                     n_group=4, n_group_used=2, vocab="deepseek-coder", context_length=4096, rope_scaling_factor=4.0),
        # DeepSeek-V3 layout scaled down: 8 groups / 4 used, top-8, one shared expert, 1 dense layer, YaRN
        "bench": _ds(n_embd=1024, n_layer=24, n_head=16, n_expert=64, n_expert_used=8, n_ff_exp=768, n_ff=3072,
                     q_lora_rank=512, kv_lora_rank=256, n_group=8, n_group_used=4, vocab="deepseek-llm",
                     tied_embeddings=False, context_length=8192, rope_scaling_factor=4.0),
    },
}

SIZE_NAMES = ("tiny", "small", "bench")

# Models of a real model's exact layer shapes (make-model --shape). Qwen3-30B-A3B: 48 layers, 128 experts top-8 of
# 768, n_embd 2048, GQA 32/4 heads of 128, its 151936-token vocabulary (llama.cpp's qwen2 vocab). DeepSeek-V3: a slice
# of its layers with their real shapes (n_embd 7168, MLA with q_lora 1536 / kv_lora 512 / rope 64 / nope 128 / v 128,
# 128 heads, the 3 leading dense layers of 18432, then MoE layers of 256 routed experts of 2048, top-8 in 4 of 8
# groups, one shared expert, YaRN 40 over 4096); n_layer 5 by default (the 3 dense and 2 MoE layers), the rest of
# DeepSeek-V3's 61 layers repeats the MoE layer. Its tokenizer is llama.cpp's deepseek-llm vocabulary (102400 tokens;
# DeepSeek-V3's own has 129280 and no vocab-only GGUF in llama.cpp).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": _qwen(n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, head_dim=128, n_expert=128,
                           n_expert_used=8, n_ff_exp=768, vocab="qwen2", context_length=40960,
                           name="rapidmoe-synthetic-qwen3-30b-a3b"),
    "deepseek-v3": _ds(n_embd=7168, n_layer=5, n_head=128, n_expert=256, n_expert_used=8, n_ff_exp=2048, n_ff=18432,
                       n_layer_dense_lead=3, q_lora_rank=1536, kv_lora_rank=512, n_group=8, n_group_used=4,
                       vocab="deepseek-llm", context_length=163840, rope_scaling_factor=40.0,
                       name="rapidmoe-synthetic-deepseek-v3-slice"),
}
DEEPSEEK_V3_LAYERS = 61  # the real model's, for extrapolating from the slice


def spec_for_shape(shape: str, **overrides: Any) -> SyntheticSpec:
    """A real model's shape (SHAPES), with any SyntheticSpec field overridden (a smaller n_layer, the dtype, ...)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} (supported: {', '.join(SHAPES)})")
    fields = {f.name for f in dataclasses.fields(SyntheticSpec)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown SyntheticSpec field(s): {', '.join(unknown)}")
    if overrides.get("arch", SHAPES[shape]["arch"]) != SHAPES[shape]["arch"]:
        raise ValueError(f"shape {shape} is a {SHAPES[shape]['arch']} model; its arch cannot be overridden")
    return SyntheticSpec(**{**SHAPES[shape], **overrides})


def spec_for(arch: str, size: str, **overrides: Any) -> SyntheticSpec:
    """The named size ('tiny', 'small', 'bench') of an architecture, with any SyntheticSpec field overridden."""
    if arch not in _SIZES:
        raise ValueError(f"unknown arch {arch!r} (supported: {', '.join(ARCHS)})")
    if size not in _SIZES[arch]:
        raise ValueError(f"unknown size {size!r} (supported: {', '.join(SIZE_NAMES)})")
    fields = {f.name for f in dataclasses.fields(SyntheticSpec)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown SyntheticSpec field(s): {', '.join(unknown)}")
    if overrides.get("arch", arch) != arch:
        raise ValueError("arch cannot be overridden; pass it as the first argument")
    return SyntheticSpec(**{**_SIZES[arch][size], **overrides})


# All named sizes as specs (seed 0, F16 matrices).
SIZES: dict[str, dict[str, SyntheticSpec]] = {
    arch: {size: spec_for(arch, size) for size in sizes} for arch, sizes in _SIZES.items()}


# --- tensor plan ------------------------------------------------------------------------------------------------

# roles, used by describe() and by the weight generator
EMBD, OUTPUT, NORM, ATTN, ATTN_OUT, ROUTER, PROBS_B, ROUTED, ROUTED_DOWN, SHARED, SHARED_DOWN, DENSE, DENSE_DOWN = (
    "embd", "output", "norm", "attn", "attn_out", "router", "probs_b", "routed", "routed_down", "shared",
    "shared_down", "dense", "dense_down")


@dataclass(frozen=True)
class TensorPlan:
    """One GGUF tensor: name, numpy shape (reversed GGML ne), F32 or matrix dtype, role and input width."""

    name: str
    shape: tuple[int, ...]
    f32: bool  # always F32 (norms, router, bias); otherwise spec.dtype
    role: str
    layer: int = -1

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    def file_type(self, dtype: str) -> str:
        """The tensor's type in the file: f32 for norms, router and biases, else the model's dtype."""
        return "f32" if self.f32 else dtype

    def nbytes(self, dtype: str) -> int:
        ft = self.file_type(dtype)
        if ft == "q8_0":
            return self.n_elements // 32 * 34  # ggml's block_q8_0: an f16 scale and 32 int8
        return self.n_elements * (4 if ft == "f32" else 2)


def tensor_plan(spec: SyntheticSpec, n_vocab: int) -> list[TensorPlan]:
    """Every tensor of the model in file order, as llama.cpp's loader expects them."""
    d = spec.n_embd
    plan = [TensorPlan("token_embd.weight", (n_vocab, d), False, EMBD),
            TensorPlan("output_norm.weight", (d,), True, NORM)]
    if not spec.tied_embeddings:
        plan.append(TensorPlan("output.weight", (n_vocab, d), False, OUTPUT))
    for il in range(spec.n_layer):
        def t(name: str, shape: tuple[int, ...], role: str, f32: bool = False, il: int = il) -> None:
            plan.append(TensorPlan(f"blk.{il}.{name}", shape, f32, role, il))

        t("attn_norm.weight", (d,), NORM, True)
        if spec.arch == "qwen3moe":
            hd = spec.head_dim
            t("attn_q.weight", (spec.n_head * hd, d), ATTN)
            t("attn_k.weight", (spec.n_head_kv * hd, d), ATTN)
            t("attn_v.weight", (spec.n_head_kv * hd, d), ATTN)
            t("attn_output.weight", (d, spec.n_head * hd), ATTN_OUT)
            t("attn_q_norm.weight", (hd,), NORM, True)
            t("attn_k_norm.weight", (hd,), NORM, True)
        else:
            qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
            if spec.q_lora_rank > 0:
                t("attn_q_a_norm.weight", (spec.q_lora_rank,), NORM, True)
                t("attn_q_a.weight", (spec.q_lora_rank, d), ATTN)
                t("attn_q_b.weight", (spec.n_head * qk, spec.q_lora_rank), ATTN)
            else:
                t("attn_q.weight", (spec.n_head * qk, d), ATTN)
            t("attn_kv_a_norm.weight", (spec.kv_lora_rank,), NORM, True)
            t("attn_kv_a_mqa.weight", (spec.kv_lora_rank + spec.qk_rope_head_dim, d), ATTN)
            # absorbed MLA layout (convert_hf_to_gguf splits kv_b_proj and transposes its k part)
            t("attn_k_b.weight", (spec.n_head, spec.kv_lora_rank, spec.qk_nope_head_dim), ATTN)
            t("attn_v_b.weight", (spec.n_head, spec.v_head_dim, spec.kv_lora_rank), ATTN)
            t("attn_output.weight", (d, spec.n_head * spec.v_head_dim), ATTN_OUT)
        t("ffn_norm.weight", (d,), NORM, True)
        if il < spec.n_layer_dense_lead:
            t("ffn_gate.weight", (spec.n_ff, d), DENSE)
            t("ffn_up.weight", (spec.n_ff, d), DENSE)
            t("ffn_down.weight", (d, spec.n_ff), DENSE_DOWN)
            continue
        e, f = spec.n_expert, spec.n_ff_exp
        t("ffn_gate_inp.weight", (e, d), ROUTER, True)
        if spec.arch == "deepseek2":
            t("exp_probs_b.bias", (e,), PROBS_B, True)
        t("ffn_gate_exps.weight", (e, f, d), ROUTED)
        t("ffn_up_exps.weight", (e, f, d), ROUTED)
        t("ffn_down_exps.weight", (e, d, f), ROUTED_DOWN)
        if spec.n_expert_shared:
            fs = f * spec.n_expert_shared
            t("ffn_gate_shexp.weight", (fs, d), SHARED)
            t("ffn_up_shexp.weight", (fs, d), SHARED)
            t("ffn_down_shexp.weight", (d, fs), SHARED_DOWN)
    return plan


def vocab_size_of(spec: SyntheticSpec) -> int:
    if spec.vocab not in VOCAB_SIZES:
        raise ValueError(f"unknown vocab size for {spec.vocab!r}; pass n_vocab (known: {', '.join(VOCAB_SIZES)})")
    return VOCAB_SIZES[spec.vocab]


def describe(spec: SyntheticSpec, n_vocab: int | None = None) -> dict[str, Any]:
    """Parameter counts and the bytes one decoded token reads (weights only, no KV cache).

    Per token llama.cpp reads every tensor once except token_embd (one row, unless it is also the tied
    output head) and the routed experts (n_expert_used of n_expert). `routed_share` is the routed experts'
    part of those bytes with F16 matrices (F32 router/norms).
    """
    n_vocab = vocab_size_of(spec) if n_vocab is None else n_vocab
    plan = tensor_plan(spec, n_vocab)
    total = sum(t.n_elements for t in plan)
    routed_frac = spec.n_expert_used / spec.n_expert

    def active_elems(t: TensorPlan) -> float:
        if t.role in (ROUTED, ROUTED_DOWN):
            return t.n_elements * routed_frac
        if t.role == EMBD and not spec.tied_embeddings:
            return spec.n_embd
        return t.n_elements

    def active_bytes(t: TensorPlan, dtype: str) -> float:
        return active_elems(t) * t.nbytes(dtype) / t.n_elements

    per_token_f16 = sum(active_bytes(t, "f16") for t in plan)
    routed_f16 = sum(active_bytes(t, "f16") for t in plan if t.role in (ROUTED, ROUTED_DOWN))
    by_role: dict[str, float] = {}
    for t in plan:
        by_role[t.role] = by_role.get(t.role, 0.0) + active_bytes(t, "f16")
    return {
        "arch": spec.arch,
        "n_vocab": n_vocab,
        "n_tensors": len(plan),
        "total_params": total,
        "expert_params": sum(t.n_elements for t in plan if t.role in (ROUTED, ROUTED_DOWN)),
        "active_params_per_token": int(sum(active_elems(t) for t in plan)),
        "tensor_bytes": sum(t.nbytes(spec.dtype) for t in plan),
        "tensor_bytes_f16": sum(t.nbytes("f16") for t in plan),
        "bytes_per_token_f16": int(per_token_f16),
        "bytes_per_token": int(sum(active_bytes(t, spec.dtype) for t in plan)),
        "routed_share": routed_f16 / per_token_f16,
        "bytes_per_token_f16_by_role": {k: int(v) for k, v in sorted(by_role.items())},
    }
