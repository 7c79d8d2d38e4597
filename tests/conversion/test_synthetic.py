"""rapidmoe.synthetic: spec validation, deterministic files, llama.cpp tensor/metadata layout, router skew, sizes.

Pure numpy + gguf: no llama.cpp build needed.
"""
# ruff: noqa: RUF001, RUF003 - DeepSeek's special tokens really are written with U+FF5C (fullwidth vertical bar)
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf
import numpy as np
import pytest
from reference.numpy_forward import route
from testkit import PIN, ROOT

from rapidmoe.ggufio import GGUFFile


def _load_synthetic() -> ModuleType:
    try:
        return importlib.import_module("rapidmoe.synthetic")
    except Exception:  # noqa: BLE001
        # rapidmoe/__init__ loads the compiled runtime; the generator itself needs only numpy + gguf
        pkg = ROOT / "python" / "rapidmoe" / "synthetic"
        spec = importlib.util.spec_from_file_location("_rapidmoe_synthetic", pkg / "__init__.py",
                                                      submodule_search_locations=[str(pkg)])
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod


syn = _load_synthetic()
ARCHS = ("qwen3moe", "deepseek2")


@pytest.fixture(scope="module")
def vocab_dir() -> Path:
    candidates = [Path(os.environ["RAPIDMOE_VOCAB_DIR"])] if os.environ.get("RAPIDMOE_VOCAB_DIR") else []
    candidates += [ROOT / "vendor" / "llama.cpp" / "models",
                   Path(f"/tmp/dl/llama_cpp_python-{PIN['version']}/vendor/llama.cpp/models")]
    for c in candidates:
        if (c / "ggml-vocab-deepseek-coder.gguf").is_file():
            return c
    pytest.skip("no llama.cpp vocab GGUFs found (set RAPIDMOE_VOCAB_DIR to llama.cpp's models/ folder)")


@pytest.fixture(scope="module")
def tiny_files(vocab_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("synthetic")
    return {arch: syn.write_model(syn.spec_for(arch, "tiny"), out / f"{arch}.gguf", vocab_dir) for arch in ARCHS}


@functools.cache
def _gguf_py(path: Path) -> tuple[gguf.GGUFReader, dict[str, Any]]:
    """gguf-py's reader of a file and its fields' contents, read once: the tests below read the same two files, and
    gguf-py takes seconds on their tokenizers."""
    r = gguf.GGUFReader(path)
    return r, {k: f.contents() for k, f in r.fields.items()}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- spec validation ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("arch", "changes", "message"), [
    ("qwen3moe", {"n_expert": 0}, "zero experts"),
    ("deepseek2", {"n_expert": 0}, "zero experts"),
    ("qwen3moe", {"n_expert_used": 9}, "n_expert_used"),
    ("qwen3moe", {"n_expert_used": 0}, "n_expert_used"),
    ("qwen3moe", {"n_embd": 250}, "multiples of 32"),
    ("qwen3moe", {"n_ff_exp": 100}, "multiples of 32"),
    ("qwen3moe", {"n_layer": 0}, "n_layer must be a positive integer"),
    ("qwen3moe", {"n_head_kv": 3}, "multiple of n_head_kv"),
    ("qwen3moe", {"head_dim": 63}, "even"),
    ("qwen3moe", {"dtype": "q4_0"}, "dtype"),
    ("qwen3moe", {"n_expert_shared": 1}, "deepseek2 parameter"),
    ("deepseek2", {"n_group": 3}, "must divide n_expert"),
    ("deepseek2", {"n_group_used": 4}, "n_group_used"),
    ("deepseek2", {"n_expert_used": 8}, "cannot hold"),
    ("deepseek2", {"n_layer_dense_lead": 3}, "n_layer_dense_lead"),
    ("deepseek2", {"kv_lora_rank": 0}, "kv_lora_rank"),
    ("deepseek2", {"qk_rope_head_dim": 31}, "even"),
    ("deepseek2", {"n_layer": 27}, "lite"),
])
def test_spec_validation(arch: str, changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        syn.spec_for(arch, "tiny", **changes)


def test_unknown_arch_size_and_field() -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        syn.spec_for("llama", "tiny")
    with pytest.raises(ValueError, match="unknown arch"):
        syn.SyntheticSpec(arch="mixtral", n_embd=256, n_layer=2, n_head=4, n_expert=8, n_expert_used=2, n_ff_exp=256)
    with pytest.raises(ValueError, match="unknown size"):
        syn.spec_for("qwen3moe", "huge")
    with pytest.raises(ValueError, match="unknown SyntheticSpec field"):
        syn.spec_for("qwen3moe", "tiny", n_experts=4)


def test_named_sizes_are_k_quant_friendly() -> None:
    for arch in ARCHS:
        for size in syn.SIZE_NAMES:
            s = syn.spec_for(arch, size)
            assert s.n_embd % 256 == 0 and s.n_ff_exp % 256 == 0 and s.n_ff % 256 == 0
            assert s.q_lora_rank % 256 == 0 and s.kv_lora_rank % 256 == 0
            assert s == syn.SIZES[arch][size]


def test_bench_routed_experts_dominate_bytes_per_token() -> None:
    for arch in ARCHS:
        d = syn.describe(syn.spec_for(arch, "bench"))
        assert d["routed_share"] > 0.55, d
        assert 2e9 < d["tensor_bytes"] < 20e9  # several GB at F16
        assert d["active_params_per_token"] < d["total_params"] / 3
    tiny = syn.describe(syn.spec_for("qwen3moe", "tiny"))
    assert tiny["tensor_bytes"] < 60e6


# --- files ------------------------------------------------------------------------------------------------------

def test_write_is_deterministic_and_atomic(tiny_files: dict[str, Path], vocab_dir: Path, tmp_path: Path) -> None:
    for arch, first in tiny_files.items():
        again = syn.write_model(syn.spec_for(arch, "tiny"), tmp_path / f"again-{arch}.gguf", vocab_dir)
        assert _sha256(again) == _sha256(first)
        assert not again.with_suffix(".gguf.tmp").exists()
    other = syn.write_model(syn.spec_for("qwen3moe", "tiny", seed=1), tmp_path / "seed1.gguf", vocab_dir)
    assert _sha256(other) != _sha256(tiny_files["qwen3moe"])


def test_tensor_bytes_do_not_depend_on_order() -> None:
    spec = syn.spec_for("deepseek2", "tiny")
    plan = syn.tensor_plan(spec, 1024)
    a = [syn.generate(spec, t).tobytes() for t in plan if t.layer == 1]
    b = [syn.generate(spec, t).tobytes() for t in reversed(plan) if t.layer == 1][::-1]
    assert a == b


def test_failed_write_leaves_nothing(vocab_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = importlib.import_module(syn.__name__ + ".writer")
    calls = {"n": 0}
    real = writer.generate_pieces

    def failing(spec, t):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("disk full")
        return real(spec, t)

    monkeypatch.setattr(writer, "generate_pieces", failing)
    target = tmp_path / "broken.gguf"
    with pytest.raises(RuntimeError, match="disk full"):
        syn.write_model(syn.spec_for("qwen3moe", "tiny"), target, vocab_dir)
    assert list(tmp_path.iterdir()) == []


def test_missing_vocab_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_dir is required"):
        syn.write_model(syn.spec_for("qwen3moe", "tiny"), tmp_path / "x.gguf", None)
    with pytest.raises(FileNotFoundError, match=r"ggml-vocab-deepseek-coder\.gguf"):
        syn.write_model(syn.spec_for("qwen3moe", "tiny"), tmp_path / "x.gguf", tmp_path)


@pytest.mark.parametrize("arch", ARCHS)
def test_metadata_and_tensors_match_llama_cpp_layout(arch: str, tiny_files: dict[str, Path], vocab_dir: Path) -> None:
    spec = syn.spec_for(arch, "tiny")
    r, kv = _gguf_py(tiny_files[arch])

    def hp(key: str) -> object:
        return kv[f"{arch}.{key}"]

    assert kv["general.architecture"] == arch
    assert kv["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_F16)
    assert hp("embedding_length") == spec.n_embd and hp("block_count") == spec.n_layer
    assert hp("expert_count") == spec.n_expert and hp("expert_used_count") == spec.n_expert_used
    assert hp("expert_feed_forward_length") == spec.n_ff_exp

    # the tokenizer is copied whole, with its GGUF types, but for the chat template (see below)
    src_tok = {kv.key: ([kv.vtype] + ([kv.sub_type] if kv.sub_type is not None else []), kv.value)
               for kv in syn.read_tokenizer(vocab_dir / f"ggml-vocab-{spec.vocab}.gguf")}
    assert len(src_tok) >= 5
    assert src_tok == {k: (f.types, kv[k]) for k, f in r.fields.items()
                       if k.startswith("tokenizer.") and k != "tokenizer.chat_template"}
    n_vocab = len(src_tok["tokenizer.ggml.tokens"][1])
    assert hp("vocab_size") == n_vocab

    if arch == "qwen3moe":
        assert hp("attention.head_count_kv") == spec.n_head_kv and hp("attention.key_length") == spec.head_dim
    else:
        assert hp("leading_dense_block_count") == spec.n_layer_dense_lead
        assert hp("attention.kv_lora_rank") == spec.kv_lora_rank and hp("attention.q_lora_rank") == spec.q_lora_rank
        assert hp("attention.key_length") == spec.kv_lora_rank + spec.qk_rope_head_dim
        assert hp("attention.key_length_mla") == spec.qk_nope_head_dim + spec.qk_rope_head_dim
        assert hp("attention.value_length_mla") == spec.v_head_dim
        assert hp("expert_gating_func") == int(gguf.ExpertGatingFuncType.SIGMOID)
        assert hp("expert_group_count") == spec.n_group and hp("expert_group_used_count") == spec.n_group_used
        assert bool(hp("expert_weights_norm"))
        assert hp("expert_weights_scale") == pytest.approx(spec.expert_weights_scale)
        assert hp("rope.scaling.type") == "yarn"

    # every tensor name the llama.cpp loader asks for, with its GGML shape (ne) and type
    tensors = {t.name: t for t in r.tensors}
    expected = {t.name: t for t in syn.tensor_plan(spec, n_vocab)}
    assert set(tensors) == set(expected)
    for name, t in tensors.items():
        assert tuple(int(x) for x in t.shape) == expected[name].shape[::-1], name
        f32 = expected[name].f32
        assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if f32 else gguf.GGMLQuantizationType.F16), name
    names = set(tensors)
    assert {"token_embd.weight", "output_norm.weight", "output.weight"} <= names
    d, e, f = spec.n_embd, spec.n_expert, spec.n_ff_exp
    last = spec.n_layer - 1
    assert tuple(tensors[f"blk.{last}.ffn_gate_exps.weight"].shape) == (d, f, e)
    assert tuple(tensors[f"blk.{last}.ffn_down_exps.weight"].shape) == (f, d, e)
    assert tuple(tensors[f"blk.{last}.ffn_gate_inp.weight"].shape) == (d, e)
    if arch == "qwen3moe":
        assert {"blk.0.attn_q_norm.weight", "blk.0.attn_k_norm.weight", "blk.0.attn_q.weight"} <= names
    else:
        nope, kv_lora, n_head = spec.qk_nope_head_dim, spec.kv_lora_rank, spec.n_head
        assert {"blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "blk.0.ffn_up.weight"} <= names
        assert "blk.0.ffn_gate_inp.weight" not in names
        assert tuple(tensors["blk.1.attn_k_b.weight"].shape) == (nope, kv_lora, n_head)
        assert tuple(tensors["blk.1.attn_v_b.weight"].shape) == (kv_lora, spec.v_head_dim, n_head)
        assert {"blk.1.exp_probs_b.bias", "blk.1.ffn_gate_shexp.weight", "blk.1.attn_q_a.weight"} <= names
    assert syn.SyntheticSpec(**json.loads(kv["rapidmoe.synthetic.spec"])) == spec
    assert kv["rapidmoe.synthetic.generator_version"] == syn.GENERATOR_VERSION


# The template each vocab's model must carry, read from llama.cpp's own folder (independent of the shipped copy);
# the server parses tool calls and reasoning from exactly these two (python/rapidmoe/server/toolcalls.py).
EXPECTED_TEMPLATE = {"qwen2": "Qwen-Qwen3-0.6B.jinja", "deepseek-coder": "llama-cpp-deepseek-r1.jinja",
                     "deepseek-llm": "llama-cpp-deepseek-r1.jinja"}


@pytest.mark.parametrize("arch", ARCHS)
def test_models_carry_a_chat_template_that_fits_their_tokenizer(arch: str, tiny_files: dict[str, Path],
                                                                 vocab_dir: Path) -> None:
    _, kv = _gguf_py(tiny_files[arch])
    vocab = syn.spec_for(arch, "tiny").vocab
    expected = (vocab_dir / "templates" / EXPECTED_TEMPLATE[vocab]).read_text(encoding="utf-8")
    assert kv["tokenizer.chat_template"] == expected
    # R1's template opens with the tokenizer's BOS, DeepSeek's own <｜begin▁of▁sentence｜>
    assert "bos_token" in expected
    assert kv["tokenizer.ggml.tokens"][kv["tokenizer.ggml.bos_token_id"]] == "<｜begin▁of▁sentence｜>"


def test_chat_template_choice(vocab_dir: Path, tmp_path: Path) -> None:
    small = {"n_layer": 1, "n_embd": 64, "n_head": 2, "n_expert": 4, "n_expert_used": 2, "n_ff_exp": 32}
    spec = syn.spec_for("qwen3moe", "tiny", **small)

    # read with our header reader (tests/conversion/test_ggufio.py: the same fields as gguf-py's), which takes a
    # second where gguf-py's takes ten on these tokenizers (Qwen2's: 151k tokens)
    def template_of(**changes: object) -> object:
        path = syn.write_model(spec.replace(**changes), tmp_path / "m.gguf", vocab_dir)
        return GGUFFile(path).get("tokenizer.chat_template")

    qwen3 = (vocab_dir / "templates" / EXPECTED_TEMPLATE["qwen2"]).read_text(encoding="utf-8")
    r1 = (vocab_dir / "templates" / EXPECTED_TEMPLATE["deepseek-llm"]).read_text(encoding="utf-8")
    assert template_of(vocab="qwen2") == qwen3  # "auto" follows the tokenizer, not the architecture
    qwen2_tokens = GGUFFile(vocab_dir / "ggml-vocab-qwen2.gguf").get("tokenizer.ggml.tokens")
    assert "<|im_start|>" in qwen3 and "<|im_start|>" in qwen2_tokens
    assert template_of(vocab="deepseek-llm") == r1
    assert template_of(vocab="gpt-2") is None  # no template fits it: the server falls back to ChatML
    assert template_of(chat_template="none") is None
    assert template_of(vocab="qwen2", chat_template="none") is None  # not even the vocab file's own (Qwen2.5's)
    assert template_of(vocab="gpt-2", chat_template="llama-cpp-deepseek-r1") == r1
    with pytest.raises(FileNotFoundError, match=r"no-such-template\.jinja not found"):
        syn.write_model(spec.replace(chat_template="no-such-template"), tmp_path / "x.gguf", vocab_dir)
    assert not (tmp_path / "x.gguf").exists()
    for bad in ("", "../Qwen-Qwen3-0.6B", "Qwen-Qwen3-0.6B.jinja"):
        with pytest.raises(ValueError, match="chat_template must be"):
            spec.replace(chat_template=bad)


def test_weight_statistics_look_trained() -> None:
    spec = syn.spec_for("qwen3moe", "small")
    plan = {t.name: t for t in syn.tensor_plan(spec, 1024)}
    w = syn.generate(spec, plan["blk.0.ffn_up_exps.weight"]).astype(np.float64)[0]  # (n_ff_exp, n_embd)
    std = w.std()
    assert std == pytest.approx(1 / np.sqrt(spec.n_embd), rel=0.1)
    z = (w / std).ravel()
    assert np.mean(z**4) > 4.0  # heavy tails (Gaussian: 3)
    col = w.std(0)
    assert col.max() / col.min() > 2.0  # per-input-channel scales
    down = syn.generate(spec, plan["blk.0.ffn_down_exps.weight"]).astype(np.float64)
    assert down.std() < 0.5 / np.sqrt(spec.n_ff_exp)  # residual branch damped by 1/sqrt(2 n_layer)
    norm = syn.generate(spec, plan["blk.0.ffn_norm.weight"])
    assert norm.dtype == np.float32 and 0.6 < norm.min() and norm.max() < 1.6
    assert syn.generate(spec, plan["blk.0.ffn_gate_inp.weight"]).dtype == np.float32


# --- router -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [4, 5, 6, 7, 8])
def test_router_is_skewed(arch: str, k: int) -> None:
    # the bench router (64 experts; deepseek2: sigmoid, 4 of 8 groups, exp_probs_b), on 3 layers for speed
    spec = syn.spec_for(arch, "bench", n_expert_used=k, n_layer=3)
    st = syn.router_skew_stats(spec, n_tokens=2048)
    assert len(st["mean_rank_weight"]) == k
    assert st["rank1"] > 0.4 and st["rank12"] > 0.6, st
    for weights in st["per_layer"].values():
        assert weights == sorted(weights, reverse=True) and abs(sum(weights) - 1) < 1e-9


def test_router_skew_is_controllable() -> None:
    spec = syn.spec_for("qwen3moe", "tiny")
    flat = syn.router_skew_stats(spec.replace(router_logit_std=0.5), n_tokens=1024)["rank1"]
    sharp = syn.router_skew_stats(spec.replace(router_logit_std=4.0), n_tokens=1024)["rank1"]
    assert flat < 0.4 < sharp


def test_reference_routing_agrees_with_generator() -> None:
    spec = syn.spec_for("deepseek2", "tiny")
    plan = {t.name: t for t in syn.tensor_plan(spec, 1024)}
    gate = syn.generate(spec, plan["blk.1.ffn_gate_inp.weight"]).astype(np.float64)
    bias = syn.generate(spec, plan["blk.1.exp_probs_b.bias"]).astype(np.float64)
    h = np.random.default_rng(0).standard_normal((64, spec.n_embd))
    experts, w = route(h, gate, spec.n_expert_used, "sigmoid", bias, spec.n_group, spec.n_group_used, True,
                       spec.expert_weights_scale)
    assert np.allclose(w.sum(-1), spec.expert_weights_scale)
    groups = experts // (spec.n_expert // spec.n_group)
    assert all(len(set(g)) <= spec.n_group_used for g in groups)
