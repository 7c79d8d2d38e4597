"""Write a SyntheticSpec as a GGUF file that stock llama.cpp loads: metadata, a copied tokenizer, streamed tensors.

The header is written first, so every tensor's place in PATH.tmp is known; tensors are then drawn piece by piece
(weights.generate_pieces: an expert, a block of rows) on a few threads, each piece converted to the file's type (F16,
F32, BF16 or Q8_0) and written at its offset. Memory stays about one piece per thread whatever the model's size, and
the bytes do not depend on the thread count. PATH.tmp replaces PATH only when complete.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tqdm import tqdm

from ..ggufio import GGUFFile, pad_to_alignment, plan_files, write_at
from ..paths import templates_dir as shipped_templates_dir
from .spec import SyntheticSpec, TensorPlan, tensor_plan
from .weights import GENERATOR_VERSION, generate_pieces

log = logging.getLogger(__name__)

KEY_SPEC = "rapidmoe.synthetic.spec"
KEY_GENERATOR = "rapidmoe.synthetic.generator_version"


@dataclasses.dataclass(frozen=True)
class _KV:
    key: str
    value: Any
    vtype: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None = None


def vocab_file(vocab_dir: Path | None, vocab: str) -> Path:
    """models/ggml-vocab-NAME.gguf inside vocab_dir, with clear errors."""
    if vocab_dir is None:
        raise ValueError("vocab_dir is required: the folder holding llama.cpp's models/ggml-vocab-*.gguf files")
    path = Path(vocab_dir) / f"ggml-vocab-{vocab}.gguf"
    if not path.is_file():
        raise FileNotFoundError(f"vocab file {path} not found (vocab {vocab!r}; vocab_dir={vocab_dir})")
    return path


def read_tokenizer(path: Path) -> tuple[_KV, ...]:
    """All tokenizer.* key/value pairs of a GGUF file with their exact GGUF types (cached per file version)."""
    st = Path(path).stat()
    return _read_tokenizer(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_tokenizer(path: str, size: int, mtime_ns: int) -> tuple[_KV, ...]:
    del size, mtime_ns  # cache key only
    reader = GGUFFile(path)
    kvs = [_KV(key, f.value, f.vtype, f.sub_type) for key, f in reader.fields.items() if key.startswith("tokenizer.")]
    if not any(kv.key == gguf.Keys.Tokenizer.LIST for kv in kvs):
        raise ValueError(f"{path} has no {gguf.Keys.Tokenizer.LIST} array")
    return tuple(kvs)


def read_chat_template(spec: SyntheticSpec, templates_dir: Path | None) -> str | None:
    """The text of the chat template the spec asks for (None: the model carries none), with clear errors."""
    name = spec.template_name
    if name is None:
        return None
    if templates_dir is None:
        templates_dir = shipped_templates_dir()
    path = Path(templates_dir) / f"{name}.jinja"
    if not path.is_file():
        raise FileNotFoundError(f"chat template {path} not found (chat_template {spec.chat_template!r}, "
                                f"vocab {spec.vocab!r}); pass chat_template='none' for a model without one")
    return path.read_text(encoding="utf-8")


def _spec_json(spec: SyntheticSpec) -> str:
    return json.dumps(dataclasses.asdict(spec), sort_keys=True)


def _add_hparams(w: gguf.GGUFWriter, spec: SyntheticSpec, n_vocab: int) -> None:
    w.add_type("model")
    w.add_name(spec.model_name)
    w.add_file_type(LLAMA_FTYPES[spec.dtype])
    w.add_vocab_size(n_vocab)
    w.add_context_length(spec.context_length)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    assert spec.rope_freq_base is not None
    w.add_rope_freq_base(spec.rope_freq_base)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    w.add_expert_feed_forward_length(spec.n_ff_exp)
    if spec.arch == "qwen3moe":
        w.add_feed_forward_length(spec.n_ff_exp * spec.n_expert_used)  # unused by llama.cpp for qwen3moe
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
        w.add_rope_dimension_count(spec.head_dim)
        return
    # deepseek2 (keys as convert_hf_to_gguf writes them for DeepSeek-V3)
    w.add_feed_forward_length(spec.n_ff if spec.n_ff else spec.n_ff_exp)
    w.add_leading_dense_block_count(spec.n_layer_dense_lead)
    if spec.q_lora_rank > 0:
        w.add_q_lora_rank(spec.q_lora_rank)
    w.add_kv_lora_rank(spec.kv_lora_rank)
    w.add_key_length(spec.kv_lora_rank + spec.qk_rope_head_dim)
    w.add_value_length(spec.kv_lora_rank)
    w.add_key_length_mla(spec.qk_nope_head_dim + spec.qk_rope_head_dim)
    w.add_value_length_mla(spec.v_head_dim)
    w.add_expert_shared_count(spec.n_expert_shared)
    w.add_expert_weights_scale(spec.expert_weights_scale)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if spec.n_group > 1:
        w.add_expert_group_count(spec.n_group)
        w.add_expert_group_used_count(spec.n_group_used)
    w.add_rope_dimension_count(spec.qk_rope_head_dim)
    if spec.rope_scaling_factor > 1:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(spec.rope_scaling_factor)
        w.add_rope_scaling_orig_ctx_len(int(spec.context_length // spec.rope_scaling_factor))
        w.add_rope_scaling_yarn_log_mul(0.1)  # DeepSeek-V3: mscale_all_dim = 1 (the converter writes 0.1 * it)


FILE_TYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
              "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}
LLAMA_FTYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}


def _encode(piece: np.ndarray, file_type: str) -> np.ndarray:
    """A float32 piece in the file's type: float32/float16 values, or ggml's BF16 / Q8_0 bytes (through the compiled
    ggml when it is built, else gguf-py's numpy quantizers, which give the same bytes)."""
    if file_type == "f32":
        return np.ascontiguousarray(piece, dtype=np.float32)
    if file_type == "f16":
        return piece.astype(np.float16)
    qt = FILE_TYPES[file_type]
    rows = np.ascontiguousarray(piece, dtype=np.float32).reshape(-1, piece.shape[-1])
    try:
        from .._runtime import _core  # noqa: PLC0415  (the compiled part where built: a few times faster)
    except ImportError:
        return np.asarray(gguf.quants.quantize(rows, qt))
    out: np.ndarray = _core.quantize(rows, int(qt), None, 1)
    return out


def _threads(threads: int | None) -> int:
    if threads is not None:
        return max(1, threads)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def write_model(spec: SyntheticSpec, path: Path, vocab_dir: Path | None, *, progress: bool = False,
                templates_dir: Path | None = None, threads: int | None = None) -> Path:
    """Write the model to `path` (atomically, via path + '.tmp'); returns `path`.

    Same spec (and GENERATOR_VERSION) -> byte-identical file, whatever `threads` (default: every core this process
    may use). Memory stays around one piece of a tensor per thread (an expert, or a block of rows of about 16 MB of
    float32). The chat template comes from `templates_dir` (default: the shipped copy of llama.cpp's
    models/templates, paths.templates_dir()).
    """
    path = Path(path)
    tokenizer = read_tokenizer(vocab_file(vocab_dir, str(spec.vocab)))
    template = read_chat_template(spec, templates_dir)
    n_vocab = len(next(kv.value for kv in tokenizer if kv.key == gguf.Keys.Tokenizer.LIST))
    plan = tensor_plan(spec, n_vocab)
    odd = [t.name for t in plan if t.file_type(spec.dtype) == "q8_0" and t.shape[-1] % 32]
    if odd:
        raise ValueError(f"dtype q8_0 needs rows that are whole blocks of 32; {odd[0]} has rows of "
                         f"{plan[[t.name for t in plan].index(odd[0])].shape[-1]}")
    total = sum(t.nbytes(spec.dtype) for t in plan)
    tmp = path.with_suffix(path.suffix + ".tmp")
    log.info("writing %s: %s, %d tensors, %.1f MB", path, spec.arch, len(plan), total / 1e6)

    writer = gguf.GGUFWriter(None, spec.arch)
    _add_hparams(writer, spec, n_vocab)
    for kv in tokenizer:
        if kv.key != gguf.Keys.Tokenizer.CHAT_TEMPLATE:  # the spec's choice replaces a vocab file's own
            writer.add_key_value(kv.key, kv.value, kv.vtype, kv.sub_type)
    if template is not None:
        writer.add_chat_template(template)
    writer.add_uint32(KEY_GENERATOR, GENERATOR_VERSION)
    writer.add_string(KEY_SPEC, _spec_json(spec))
    for t in plan:
        ft = t.file_type(spec.dtype)
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32 if ft == "f32" else np.float16),
                               t.nbytes(spec.dtype), raw_dtype=FILE_TYPES[ft])
    (layout,) = plan_files(writer, path)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=path.name) if progress else None
    lock, stop = threading.Lock(), threading.Event()

    def one(t: TensorPlan) -> None:
        at, end = layout.offsets[t.name][0], sum(layout.offsets[t.name])
        ft = t.file_type(spec.dtype)
        for piece in generate_pieces(spec, t):
            if stop.is_set():  # another tensor failed, or the write was interrupted
                return
            data = _encode(piece, ft)
            write_at(fd, data, at)
            at += data.nbytes
            if bar is not None:
                with lock:
                    bar.update(data.nbytes)
        if at != end:
            raise AssertionError(f"{t.name}: wrote {at - layout.offsets[t.name][0]} bytes, planned {end - at}")

    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            os.ftruncate(fd, layout.size)
            write_at(fd, np.frombuffer(layout.header, dtype=np.uint8), 0)
            write_at(fd, np.zeros(pad_to_alignment(len(layout.header)) - len(layout.header), np.uint8),
                     len(layout.header))
            with ThreadPoolExecutor(_threads(threads), thread_name_prefix="make-model") as pool:
                try:
                    for fut in [pool.submit(one, t) for t in sorted(plan, key=lambda t: -t.nbytes(spec.dtype))]:
                        fut.result()
                except BaseException:
                    stop.set()
                    pool.shutdown(wait=True, cancel_futures=True)
                    raise
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    log.info("wrote %s (%.1f MB)", path, path.stat().st_size / 1e6)
    return path


def read_spec(path: Path) -> SyntheticSpec | None:
    """The SyntheticSpec stored in a file this module wrote (None for other GGUF files)."""
    value = GGUFFile(path).get(KEY_SPEC)
    return None if value is None else SyntheticSpec(**json.loads(value))
