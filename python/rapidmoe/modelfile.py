"""Checks on model files at the boundary: exists, is a complete GGUF, and (where required) is an MoE model.

Reads only the GGUF header and tensor table (memory-mapped); never loads weights into RAM.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelFileError
from .ggufio import GGUFFile, GGUFFormatError

GGUF_MAGIC = b"GGUF"
TENSOR_ALIGNMENT = 32  # ggml's TENSOR_ALIGNMENT: llama.cpp maps a model's tensor data only at multiples of it


@dataclass(frozen=True)
class ModelInfo:
    """What a GGUF says about itself."""

    path: Path
    architecture: str
    n_layer: int
    n_expert: int  # 0 for a dense model
    n_expert_used: int
    n_tensors: int
    file_size: int

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 1 and self.n_expert_used >= 1


def read_model_info(path: str | os.PathLike[str]) -> ModelInfo:
    """Open a GGUF's metadata; raise ModelFileError with a one-line reason if it is not a usable GGUF."""
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"model file not found: {p}")
    if not p.is_file():
        raise ModelFileError(f"not a file: {p}")
    size = p.stat().st_size
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(f"cannot read {p}: {e.strerror}") from e
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"{p} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFFile(p)
    except GGUFFormatError as e:
        raise ModelFileError(f"{p} is a corrupt or truncated GGUF ({e})") from e
    missing = reader.missing_data()
    if missing is not None:
        t, have = missing
        raise ModelFileError(f"{p} is truncated: tensor {t.name} ends at byte {int(t.data_offset) + int(t.n_bytes)}, "
                             f"the file has {have}")
    misplaced = next((t for t in reader.tensors if t.data_offset % TENSOR_ALIGNMENT), None)
    if misplaced is not None:  # llama.cpp's CPU buffer asserts on such a pointer (ggml-backend.cpp): an abort
        raise ModelFileError(f"{p} is damaged: the data of tensor {misplaced.name} starts at byte "
                             f"{misplaced.data_offset}, not a multiple of {TENSOR_ALIGNMENT} (general.alignment "
                             f"{reader.get('general.alignment', 32)}); llama.cpp cannot map it")
    arch = reader.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{p} has no general.architecture: not a llama.cpp model")
    bad_vocab = vocab_problem(reader)
    if bad_vocab is not None:  # llama.cpp's vocab loader asserts on it (llama-vocab.cpp): the process would abort
        raise ModelFileError(f"{p} is damaged: {bad_vocab}; llama.cpp cannot load such a vocabulary")

    bad = hparams_problem(reader, arch)
    if bad is not None:
        raise ModelFileError(f"{p} is damaged: {bad}; llama.cpp cannot load it")

    def hparam(name: str) -> int:
        v = reader.get(f"{arch}.{name}")
        return int(v) if isinstance(v, (int, float)) else 0

    return ModelInfo(path=p, architecture=arch, n_layer=hparam("block_count"), n_expert=hparam("expert_count"),
                     n_expert_used=hparam("expert_used_count"), n_tensors=len(reader.tensors),
                     file_size=reader.size if len(reader.shards) > 1 else size)


# llama.cpp's limits (src/llama-hparams.h) and the rope scaling types it knows (llama_rope_scaling_type_from_string)
LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024
LLAMA_FTYPE_LIMIT = 2048  # enum llama_ftype's values fit in 11 bits (its largest, LLAMA_FTYPE_GUESSED, is 1024)
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
# Architectures whose graph asserts that the heads rotate whole: n_embd_head_v == n_embd_head_k == n_rot (llama.cpp
# src/models/*.cpp, GGML_ASSERT when the first graph is built, after the load); the fuzzing test recomputes the
# list from the pinned sources (tests/fuzzing/test_upstream_asserts.py)
ROPE_WHOLE_HEAD_ARCHS = frozenset({
    "apertus", "arcee", "arctic", "baichuan", "chameleon", "codeshell", "cogvlm", "cohere2moe", "dbrx", "deci",
    "deepseek", "dots1", "dream", "ernie4_5", "ernie4_5-moe", "exaone", "exaone-moe", "exaone4", "falcon", "granite",
    "granite_swa", "graniteswitch", "grok", "grovemoe", "hunyuan-moe", "hunyuan_vl", "hy_v3", "internlm2", "jais2",
    "llada", "llada-moe", "llama", "llama4", "maincoder", "mellum", "mistral3", "olmo", "olmo2", "olmoe", "orion",
    "paddleocr", "pangu-embedded", "plamo", "pockettts", "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen3moe",
    "qwen3vl", "qwen3vlmoe", "rnd1", "seed_oss", "smallthinker", "smollm3", "starcoder2", "talkie", "xverse",
})


def hparams_problem(reader: GGUFFile, arch: str) -> str | None:
    """What in the hyperparameters llama.cpp's loader asserts on (llama_model::load_hparams: GGML_ASSERT ends the
    process), or None. Only values of the types llama.cpp reads are judged; a wrong type it refuses itself."""
    def num(key: str) -> int | None:
        v = reader.get(f"{arch}.{key}")
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else None

    n_layer = num("block_count")
    if n_layer is not None and not 0 < n_layer <= LLAMA_MAX_LAYERS:
        return f"{arch}.block_count is {n_layer} (llama.cpp loads 1 to {LLAMA_MAX_LAYERS} layers)"
    nextn = num("nextn_predict_layers")
    if nextn is not None and n_layer is not None and nextn > n_layer:
        return f"{arch}.nextn_predict_layers {nextn} exceeds block_count {n_layer}"
    n_expert = num("expert_count") or 0
    used = reader.get(f"{arch}.expert_used_count", 0)
    used_values = used if isinstance(used, list) else [used]
    if not all(isinstance(u, int) and not isinstance(u, bool) for u in used_values):
        return None
    used_max = max([0, *used_values])
    groups, group_used = num("expert_group_count") or 0, num("expert_group_used_count") or 0
    if not 0 <= n_expert <= LLAMA_MAX_EXPERTS:
        return f"{arch}.expert_count is {n_expert} (llama.cpp allows up to {LLAMA_MAX_EXPERTS})"
    if used_max > n_expert or (n_expert > 0 and used_max == 0):
        return f"{arch}.expert_used_count {used_max} does not fit expert_count {n_expert}"
    if (n_expert > 0 and groups >= n_expert) or (n_expert == 0 and groups != 0):
        return f"{arch}.expert_group_count {groups} does not fit expert_count {n_expert}"
    if n_expert > 0 and groups > 1 and (n_expert % groups or not 0 < group_used < groups):
        return f"{arch}.expert_group_count {groups} (used {group_used}) does not divide expert_count {n_expert}"
    for key in (f"{arch}.attention.layer_norm_rms_epsilon", f"{arch}.attention.layer_norm_epsilon"):
        eps = reader.get(key)
        if isinstance(eps, float) and not (math.isfinite(eps) and eps >= 0):  # ggml's norms assert eps >= 0
            return f"{key} is {eps} (a norm's epsilon must be a finite number >= 0)"
    n_ctx_train = num("context_length")
    if n_ctx_train is not None and not 0 <= n_ctx_train < 1 << 31:  # llama_model_n_ctx_train answers an int32
        return f"{arch}.context_length is {n_ctx_train} (at most 2^31-1)"
    ftype = reader.get("general.file_type")
    if isinstance(ftype, int) and not isinstance(ftype, bool) and not 0 <= ftype < LLAMA_FTYPE_LIMIT:
        # llama.cpp stores it in its enum llama_ftype: a value past the enum's range is undefined behaviour
        return f"general.file_type is {ftype} (llama.cpp's file types are 0 to {LLAMA_FTYPE_LIMIT - 1})"
    scaling = reader.get(f"{arch}.rope.scaling.type")
    if isinstance(scaling, str) and scaling not in ROPE_SCALING_TYPES:
        return f"{arch}.rope.scaling.type is {scaling!r} (llama.cpp knows {', '.join(ROPE_SCALING_TYPES)})"
    return _head_problem(reader, arch, num)


def _head_problem(reader: GGUFFile, arch: str, num: Callable[[str], int | None]) -> str | None:
    """For ROPE_WHOLE_HEAD_ARCHS: the rope dimension count, key and value head sizes as llama_model::load_hparams
    derives them (each defaults to n_embd / n_head) must agree. Files with per-layer (SWA) head sizes are left to
    llama.cpp: layer 0's values then depend on the architecture's SWA pattern."""
    if arch not in ROPE_WHOLE_HEAD_ARCHS or any(
            reader.get(f"{arch}.{k}") is not None
            for k in ("rope.dimension_count_swa", "attention.key_length_swa", "attention.value_length_swa")):
        return None
    heads = reader.get(f"{arch}.attention.head_count")
    n_head = heads[0] if isinstance(heads, list) and heads else heads
    n_embd = num("embedding_length")
    if not isinstance(n_head, int) or isinstance(n_head, bool) or n_head <= 0 or n_embd is None:
        return None
    default = n_embd // n_head
    key, value, rot = num("attention.key_length"), num("attention.value_length"), num("rope.dimension_count")
    key = default if key is None else key
    value = default if value is None else value
    rot = key if rot is None else rot
    if key == value == rot:
        return None
    return (f"{arch}: rope.dimension_count {rot}, attention.key_length {key} and attention.value_length {value} "
            f"differ (absent ones are n_embd / n_head = {default}); llama.cpp's {arch} graph needs them equal")


# llama_token_type's LLAMA_TOKEN_TYPE_BYTE (include/llama.h)
TOKEN_TYPE_BYTE = 6


def token_as_read(token: str, token_id: int) -> str:
    """A token's text as llama.cpp's vocab loader keys it (llama_vocab::impl::load): up to its first NUL byte, as
    gguf_get_arr_str returns a C string, and an empty one named `[EMPTY_<id>]`."""
    text = token.split("\0", 1)[0]
    return text or f"[EMPTY_{token_id}]"


def duplicate_token(tokens: list[str]) -> tuple[int, int] | None:
    """The first two ids of tokens llama.cpp reads as the same text (token_as_read), or None."""
    distinct = set(tokens)
    if len(distinct) == len(tokens) and "" not in distinct and "\0" not in "".join(tokens):
        return None  # each read as stored, none twice (the common case, without a loop in Python)
    seen: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        key = token_as_read(tok, i)
        if key in seen:
            return seen[key], i
        seen[key] = i
    return None


def vocab_problem(reader: GGUFFile) -> str | None:
    """What in the tokenizer's token list llama.cpp's vocab loader asserts on, or None (also for a file without one,
    or one llama.cpp does not read: tokenizer.ggml.model "no_vocab"/"none"): two tokens it reads as one (its
    id_to_token.size() == token_to_id.size() assert), a byte token in a WordPiece ("bert") vocabulary (llama.cpp
    builds its piece cache at load, and token_to_byte aborts for that type)."""
    tokens = reader.get("tokenizer.ggml.tokens")
    model = reader.get("tokenizer.ggml.model")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens) or model in ("no_vocab", "none"):
        return None
    twice = duplicate_token(tokens)
    if twice is not None:
        first, second = twice
        read = [(tokens[i], token_as_read(tokens[i], i)) for i in twice]
        notes = [f"{raw!r} as {as_read!r}" for raw, as_read in read if raw != as_read]
        why = (f"; llama.cpp reads {' and '.join(notes)}: a token ends at its first NUL byte, an empty one is named "
               "[EMPTY_<id>]") if notes else ""
        return f"its tokenizer lists the token {read[0][1]!r} twice (ids {first} and {second}{why})"
    types = reader.get("tokenizer.ggml.token_type")
    if model == "bert" and isinstance(types, list):
        byte = next((i for i, ty in enumerate(types[:len(tokens)]) if ty == TOKEN_TYPE_BYTE), None)
        if byte is not None:
            return (f"token {byte} ({tokens[byte]!r}) of its WordPiece (bert) tokenizer has the byte type, which "
                    "llama.cpp has no byte value for")
    return None


def generation_problem(path: str | os.PathLike[str] | GGUFFile, *, embedding: bool = False) -> str | None:
    """Why llama.cpp cannot generate text from this GGUF, as its header tells (None when nothing says so): a
    vocab-only file has no weights; a model with non-causal attention (embedding models such as BERT/nomic-bert-moe,
    and diffusion models) does not predict the next token. With embedding=True a non-causal model is fine."""
    r = path if isinstance(path, GGUFFile) else GGUFFile(path)
    arch = r.get("general.architecture")
    if not r.tensors:
        return (f"{r.path} is a vocab-only GGUF ({arch}: tokenizer and hyperparameters, no weights): nothing to run "
                "(it can only tokenize: vocab_only=True)")
    if r.get(f"{arch}.attention.causal") is False and not embedding:
        return (f"{r.path} is a {arch} model with non-causal attention (an embedding or diffusion model): it does not "
                "generate text token by token, which is what RapidMoE runs")
    return None


def require_moe(path: str | os.PathLike[str]) -> ModelInfo:
    """read_model_info, and refuse a dense (non-MoE) model."""
    info = read_model_info(path)
    if not info.is_moe:
        raise ModelFileError(
            f"{info.path} is a dense {info.architecture} model (no routed experts); RapidMoE needs an MoE model")
    return info
