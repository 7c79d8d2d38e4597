"""Named shape sets: the real hyperparameters of MoE models too large to load here, turned into the tensor list
llama.cpp's GGUF of that model has (names and shapes as convert_hf_to_gguf writes them), so the planner treats
them exactly like a GGUF file.

Values are the models' published config.json fields (sources next to each set). Types are not part of a shape
set: every tensor is listed as BF16 (the published precision class); the planner assigns its own types.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import RapidMoEError
from .tensors import ModelShapes, TensorShape


@dataclass(frozen=True)
class ShapeSet:
    name: str
    arch: str  # "deepseek2" (MLA, shared experts, leading dense layers) or "qwen3moe" (GQA)
    n_layer: int  # num_hidden_layers (DeepSeek's MTP layer is not part of the main model and not converted)
    n_embd: int  # hidden_size
    n_vocab: int  # vocab_size
    n_head: int  # num_attention_heads
    n_expert: int  # n_routed_experts / num_experts
    n_expert_used: int  # num_experts_per_tok
    n_ff_exp: int  # moe_intermediate_size
    published_params: float  # total parameters the model card states
    published_active: float  # activated parameters per token the model card states
    source: str
    # qwen3moe
    n_head_kv: int = 0  # num_key_value_heads
    head_dim: int = 0
    # deepseek2
    n_layer_dense_lead: int = 0  # first_k_dense_replace
    n_ff: int = 0  # intermediate_size (the leading dense layers' FFN)
    n_expert_shared: int = 0  # n_shared_experts
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    tied_embeddings: bool = False  # tie_word_embeddings

    def replace(self, **changes: object) -> ShapeSet:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def tensor_list(self) -> list[TensorShape]:
        """Every tensor in GGUF order and naming (ggml shapes, row length first)."""
        d, out = self.n_embd, []

        def add(name: str, *shape: int) -> None:
            out.append(TensorShape(name, tuple(shape), "F32" if len(shape) == 1 else "BF16"))

        add("token_embd.weight", d, self.n_vocab)
        add("output_norm.weight", d)
        if not self.tied_embeddings:
            add("output.weight", d, self.n_vocab)
        for il in range(self.n_layer):
            b = f"blk.{il}."
            add(b + "attn_norm.weight", d)
            if self.arch == "qwen3moe":
                hd = self.head_dim
                add(b + "attn_q.weight", d, self.n_head * hd)
                add(b + "attn_k.weight", d, self.n_head_kv * hd)
                add(b + "attn_v.weight", d, self.n_head_kv * hd)
                add(b + "attn_output.weight", self.n_head * hd, d)
                add(b + "attn_q_norm.weight", hd)
                add(b + "attn_k_norm.weight", hd)
            else:  # deepseek2, absorbed MLA layout (kv_b split into k_b and v_b)
                qk = self.qk_nope_head_dim + self.qk_rope_head_dim
                if self.q_lora_rank:
                    add(b + "attn_q_a_norm.weight", self.q_lora_rank)
                    add(b + "attn_q_a.weight", d, self.q_lora_rank)
                    add(b + "attn_q_b.weight", self.q_lora_rank, self.n_head * qk)
                else:
                    add(b + "attn_q.weight", d, self.n_head * qk)
                add(b + "attn_kv_a_norm.weight", self.kv_lora_rank)
                add(b + "attn_kv_a_mqa.weight", d, self.kv_lora_rank + self.qk_rope_head_dim)
                add(b + "attn_k_b.weight", self.qk_nope_head_dim, self.kv_lora_rank, self.n_head)
                add(b + "attn_v_b.weight", self.kv_lora_rank, self.v_head_dim, self.n_head)
                add(b + "attn_output.weight", self.n_head * self.v_head_dim, d)
            add(b + "ffn_norm.weight", d)
            if il < self.n_layer_dense_lead:
                add(b + "ffn_gate.weight", d, self.n_ff)
                add(b + "ffn_up.weight", d, self.n_ff)
                add(b + "ffn_down.weight", self.n_ff, d)
                continue
            e, f = self.n_expert, self.n_ff_exp
            out.append(TensorShape(b + "ffn_gate_inp.weight", (d, e), "F32"))
            if self.arch == "deepseek2":
                add(b + "exp_probs_b.bias", e)
            add(b + "ffn_gate_exps.weight", d, f, e)
            add(b + "ffn_up_exps.weight", d, f, e)
            add(b + "ffn_down_exps.weight", f, d, e)
            if self.n_expert_shared:
                fs = f * self.n_expert_shared
                add(b + "ffn_gate_shexp.weight", d, fs)
                add(b + "ffn_up_shexp.weight", d, fs)
                add(b + "ffn_down_shexp.weight", fs, d)
        return out

    def kv_elements_per_token(self) -> int:
        if self.arch == "deepseek2":  # MLA: llama.cpp caches the latent (kv_lora_rank) + the rope part, K only
            return self.n_layer * (self.kv_lora_rank + self.qk_rope_head_dim)
        return self.n_layer * 2 * self.n_head_kv * self.head_dim

    def model_shapes(self) -> ModelShapes:
        return ModelShapes(name=self.name, arch=self.arch, n_layer=self.n_layer, n_expert=self.n_expert,
                           n_expert_used=self.n_expert_used, kv_elements_per_token=self.kv_elements_per_token(),
                           tensors=tuple(self.tensor_list()))


# https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (DeepSeek-R1 has the same config.json
# architecture fields: https://huggingface.co/deepseek-ai/DeepSeek-R1/blob/main/config.json). Model card: 671B
# total, 37B activated (the weights README: 36.6B activated including the 0.9B output head).
_DEEPSEEK_V3 = ShapeSet(
    name="deepseek-v3", arch="deepseek2", n_layer=61, n_embd=7168, n_vocab=129280, n_head=128, n_expert=256,
    n_expert_used=8, n_ff_exp=2048, n_layer_dense_lead=3, n_ff=18432, n_expert_shared=1, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    published_params=671e9, published_active=37e9,
    source="https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json")

# https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json; model card: 235B total, 22B activated
_QWEN3_235B = ShapeSet(
    name="qwen3-235b-a22b", arch="qwen3moe", n_layer=94, n_embd=4096, n_vocab=151936, n_head=64, n_head_kv=4,
    head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=1536, published_params=235e9, published_active=22e9,
    source="https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json")

# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json; model card: 30.5B total, 3.3B activated
_QWEN3_30B = ShapeSet(
    name="qwen3-30b-a3b", arch="qwen3moe", n_layer=48, n_embd=2048, n_vocab=151936, n_head=32, n_head_kv=4,
    head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768, published_params=30.5e9, published_active=3.3e9,
    source="https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json")

SHAPE_SETS: dict[str, ShapeSet] = {
    "deepseek-v3": _DEEPSEEK_V3,
    "deepseek-r1": _DEEPSEEK_V3.replace(name="deepseek-r1",
                                        source="https://huggingface.co/deepseek-ai/DeepSeek-R1/blob/main/config.json"),
    "qwen3-235b-a22b": _QWEN3_235B,
    "qwen3-30b-a3b": _QWEN3_30B,
}


def get_shape_set(name: str) -> ShapeSet:
    key = name.lower()
    if key not in SHAPE_SETS:
        raise RapidMoEError(f"unknown shape set {name!r}; choose one of {', '.join(SHAPE_SETS)}")
    return SHAPE_SETS[key]
