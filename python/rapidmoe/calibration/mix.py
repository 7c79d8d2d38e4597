"""Per-layer and per-role routed-expert types, chosen by measured KL on calibration text (issue 22).

Which experts deserve more bits differs by role (down is usually the most sensitive) and by layer, and a uniform
type spends bits where they buy least. `measure_sensitivity` quantizes one routed-expert tensor (one layer's gate,
up or down, every expert) at a time to each candidate type, everything else left as the source stores it, and
measures KL(source || variant) over calibration chunks with our build: one evaluation of the model per tensor and
type. `allocate` then spends a bit budget (mean WQ bits per routed-expert weight, the bytes an r = 0 token reads)
greedily, each step on the upgrade with the most KL saved per bit, taking the KLs of the tensors as additive.
`choose_mix` ties both to a preset: its result is the preset with a `mix` (presets.parse_mix), which the converter
applies and records in the sidecar; UMIA still picks r per token on top.

Cost: layers x roles x types evaluations of the full-precision model over `chunks` x `n_ctx` tokens, each after
writing a copy of the source with one tensor quantized (in a temporary folder): made for models that run on the
machine doing the conversion.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from tqdm import tqdm

from ..errors import RapidMoEError
from ..ggml_types import bits_per_weight, fit_type, ggml_type
from ..ggufio import GGUFFile, Tensor, copy_metadata, tensor_rows
from ..moe_tensors import GATE, GATE_UP, is_expert, parse_expert
from ..resplit.codecs import codec_of
from ..resplit.presets import DOWN_COPY_TYPES, MIX_WQ_TYPES, NEEDS_IMATRIX, MixEntry, Preset, format_mix

log = logging.getLogger(__name__)

DEFAULT_TYPES = ("Q2_K", "Q3_K", "Q4_K")


@dataclass(frozen=True)
class Sensitivity:
    """KL(source || source with only this tensor's experts quantized to `type`) over the calibration chunks."""

    layer: int
    role: str  # gate, up, down (a merged gate_up tensor: gate)
    type: str  # the type asked (the tensor holds fit_type's fallback where its rows need one)
    kl: float
    elements: int  # weights in the tensor (all experts)
    bits: float  # bits per weight of the type the tensor holds (the fallback's where the rows need one)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    out: np.ndarray = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return out


def _write_variant(reader: GGUFFile, target: Tensor, ty: str, out: Path) -> None:
    """The source with `target` (a routed-expert tensor) quantized to `ty` expert by expert, every other tensor's
    bytes as stored."""
    from .._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use)

    qt = ggml_type(fit_type(ty, int(target.shape[0])))
    w = GGUFWriter(out, arch=str(reader.get("general.architecture")))
    copy_metadata(reader, w)
    for t in reader.tensors:
        tt = qt if t.name == target.name else GGMLQuantizationType(int(t.tensor_type))
        dims = [int(x) for x in reversed(t.shape)]
        byte_shape = (*dims[:-1], _core.row_size(int(tt), dims[-1]))
        w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape, dtype=np.int64)), tt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in reader.tensors:
        if t.name != target.name:
            w.write_tensor_data(np.asarray(t.data).reshape(-1).view(np.uint8))
            continue
        n_in, n_out, n_expert = (int(x) for x in t.shape)
        data = np.empty((n_expert, n_out, _core.row_size(int(qt), n_in)), dtype=np.uint8)
        for e in range(n_expert):
            data[e] = _core.quantize(tensor_rows(t, e * n_out, n_out), int(qt))
        w.write_tensor_data(data)
    w.close()


class _Scorer:
    """Logits of a model over fixed chunks, and their KL to the reference's."""

    def __init__(self, chunks: list[list[int]], n_ctx: int, threads: int | None) -> None:
        self.chunks, self.n_ctx, self.threads = chunks, n_ctx, threads
        self.ref: list[np.ndarray] = []

    def log_probs(self, path: Path) -> list[np.ndarray]:
        from ..llama import Llama  # noqa: PLC0415  (rapidmoe.llama loads the compiled part on import)

        llm = Llama(path, n_ctx=self.n_ctx, n_batch=self.n_ctx, n_ubatch=self.n_ctx, n_threads=self.threads,
                    n_threads_batch=self.threads, logits_all=True, verbose=False)
        try:
            out = []
            for ch in self.chunks:
                llm.reset()
                llm._ctx.kv_cache_clear()
                llm.eval(ch)
                out.append(_log_softmax(np.asarray(llm.scores[:len(ch)], dtype=np.float32)).astype(np.float32))
            return out
        finally:
            llm.close()

    def kl(self, path: Path) -> float:
        total, n = 0.0, 0
        for ref, lp in zip(self.ref, self.log_probs(path), strict=True):
            total += float((np.exp(ref) * (ref - lp)).sum())
            n += ref.shape[0]
        return total / n


def measure_sensitivity(src: str | os.PathLike[str], text: str, types: Sequence[str] = DEFAULT_TYPES, *,
                        n_ctx: int = 256, chunks: int = 4, threads: int | None = None,
                        work_dir: str | os.PathLike[str] | None = None,
                        progress: bool = True) -> list[Sensitivity]:
    """KL of the source with one routed-expert tensor at a time in each of `types` (see the module's doc)."""
    from ..llama import Llama  # noqa: PLC0415  (rapidmoe.llama loads the compiled part on import)

    src_p = Path(src)
    types = [t.upper() for t in types]
    for ty in types:
        if ty not in MIX_WQ_TYPES:
            raise RapidMoEError(f"mix type {ty} not supported; choose among {', '.join(MIX_WQ_TYPES)}")
        if ty in NEEDS_IMATRIX:
            raise RapidMoEError(f"mix type {ty} needs an importance matrix, which the measurement does not take; "
                                f"choose among {', '.join(t for t in MIX_WQ_TYPES if t not in NEEDS_IMATRIX)}")
    reader = GGUFFile(src_p)
    experts = [t for t in reader.tensors if is_expert(t.name)]
    if not experts:
        raise RapidMoEError(f"{src_p} has no routed-expert tensors: nothing to choose types for")
    tok = Llama(src_p, n_ctx=n_ctx, vocab_only=True, verbose=False)
    try:
        tokens = tok.tokenize(text.encode(), add_bos=False, special=False)
    finally:
        tok.close()
    n_chunks = min(chunks, len(tokens) // n_ctx)
    if n_chunks < 1:
        raise RapidMoEError(f"calibration text has {len(tokens)} tokens; the mix needs at least n_ctx={n_ctx}")
    scorer = _Scorer([tokens[i * n_ctx:(i + 1) * n_ctx] for i in range(n_chunks)], n_ctx, threads)
    scorer.ref = scorer.log_probs(src_p)
    out: list[Sensitivity] = []
    with tempfile.TemporaryDirectory(prefix="rapidmoe-mix-", dir=work_dir) as tmp:
        variant = Path(tmp) / "variant.gguf"
        for t in tqdm(experts, desc="mix", unit="tensor", disable=not progress):
            e = parse_expert(t.name)
            assert e is not None
            role = GATE if e.role == GATE_UP else e.role
            for ty in types:
                _write_variant(reader, t, ty, variant)
                used = fit_type(ty, int(t.shape[0]))
                out.append(Sensitivity(e.layer, role, ty, scorer.kl(variant), int(t.n_elements),
                                       bits_per_weight(used)))
                variant.unlink()
    log.info("mix: %d tensors x %d types measured over %d chunks of %d tokens", len(experts), len(types),
             n_chunks, n_ctx)
    return out


def allocate(sens: Sequence[Sensitivity], budget_bits: float) -> dict[tuple[int, str], str]:
    """Each (layer, role)'s type: all start at their cheapest measured type; then, while the mean bits per weight
    stays within `budget_bits`, the upgrade saving the most KL per bit added is taken (measured KLs taken as
    additive; an upgrade that saves nothing is never taken). RapidMoEError if even the cheapest types exceed it."""
    table: dict[tuple[int, str], dict[str, float]] = {}
    size: dict[tuple[int, str], int] = {}
    bits: dict[tuple[tuple[int, str], str], float] = {}  # what each type costs the tensor (after a row-size fallback)
    for s in sens:
        table.setdefault((s.layer, s.role), {})[s.type] = s.kl
        size[(s.layer, s.role)] = s.elements
        bits[((s.layer, s.role), s.type)] = s.bits
    total = sum(size.values())
    # each tensor's cheapest type, the lower KL between equally cheap ones (two types falling back alike)
    choice = {k: min(v, key=lambda ty: (bits[(k, ty)], v[ty])) for k, v in table.items()}
    used = sum(bits[(k, choice[k])] * size[k] for k in table)
    if used > budget_bits * total + 1e-9:
        raise RapidMoEError(f"mix budget {budget_bits:.3f} bits per weight is below the cheapest types' "
                            f"{used / total:.3f}")
    while True:
        best: tuple[float, tuple[int, str], str] | None = None
        for k, kls in table.items():
            cur = choice[k]
            for ty, kl in kls.items():
                extra = (bits[(k, ty)] - bits[(k, cur)]) * size[k]
                saved = kls[cur] - kl
                if extra <= 0 or saved <= 0 or used + extra > budget_bits * total + 1e-9:
                    continue
                if best is None or saved / extra > best[0]:
                    best = (saved / extra, k, ty)
        if best is None:
            return choice
        _, k, ty = best
        used += (bits[(k, ty)] - bits[(k, choice[k])]) * size[k]
        choice[k] = ty


def mix_preset(preset: Preset, choice: dict[tuple[int, str], str]) -> Preset:
    """The preset with every (layer, role) of `choice` as a mix entry; in copy mode a down whose WQ is not below
    the preset's copy type gets the next larger copy type."""
    entries = []
    for (layer, role), wq in sorted(choice.items()):
        hi = None
        if role == "down" and preset.down_mode == "copy" and bits_per_weight(preset.down_type) <= bits_per_weight(wq):
            hi = next((c for c in DOWN_COPY_TYPES if bits_per_weight(c) > bits_per_weight(wq)), None)
        entries.append(MixEntry(layer, role, wq, hi))
    return dataclasses.replace(preset, mix=format_mix(entries), name=f"{preset.name}+mix")


def choose_mix(src: str | os.PathLike[str], text: str, preset: Preset, budget_bits: float,
               types: Sequence[str] = DEFAULT_TYPES, *, n_ctx: int = 256, chunks: int = 4,
               threads: int | None = None, progress: bool = True) -> tuple[Preset, list[Sensitivity]]:
    """`preset` with per-layer/per-role WQ types measured on `text` to fit `budget_bits` (mean WQ bits per routed
    weight), and the measurements."""
    codec = codec_of(preset)
    if codec.no_mix is not None:
        raise RapidMoEError(f"preset {preset.name} is {codec.title}, which {codec.no_mix}: it takes no mix")
    sens = measure_sensitivity(src, text, types, n_ctx=n_ctx, chunks=chunks, threads=threads, progress=progress)
    choice = allocate(sens, budget_bits)
    return mix_preset(preset, choice), sens
