"""Routing traces: every token's expert choices and router weights, per MoE layer, in a compact binary file.

Recorded by `Llama(trace=PATH)` (`rapidmoe-cli run --trace FILE`, `serve --trace FILE`) from the graph itself: an
eval callback (`_core.TensorCapture`, the mechanism UMIA calibration uses) copies `ffn_moe_topk-<il>` (the experts
llama.cpp selected, I32) and `ffn_moe_weights-<il>` (the router's probabilities of those experts, before any
renormalisation: what UMIA's arbitration reads) each time a batch is computed. Read with `read_trace`; replayed by
the cache simulator (`rapidmoe.placement.cache.simulator`, `bench/bench_cache.py`).

File layout (little-endian):

    header   8s  magic b"RMOETRC1"
             u32 version (1)
             u32 n_moe      MoE layers recorded
             u32 n_expert   experts per MoE layer
             u32 k          experts chosen per token (top-k)
             u32 id_bytes   1 (n_expert <= 256) or 2
             u32 meta_len   bytes of the JSON metadata that follows
             meta_len bytes of UTF-8 JSON: {"model", "arch", "n_layer", "moe_layers": [...], "weights",
                            "predicted" (bool), "created"}
    steps    one record per computed batch (llama.cpp ubatch), until the end of the file:
             u32 n_tokens                 tokens in the batch
             u32 rows[n_moe]              tokens routed in each MoE layer (llama.cpp computes only the output
                                          rows in the last layer, so rows <= n_tokens there)
             per MoE layer: ids     [rows, k] uint8/uint16 (id_bytes), in the order llama.cpp chose them
                            weights [rows, k] float16
                            with "predicted", for every MoE layer but the last: pred [rows, k] ids, the top-k of
                            the NEXT MoE layer's router applied to this layer's router input (the FFN input,
                            `ffn_norm-<il>` in most graphs): what MoEpic's predictor would prefetch for the next
                            layer

A token costs n_moe * k * (id_bytes + 2) bytes, plus (n_moe - 1) * k * id_bytes with predictions (DeepSeek-V3:
58 * 8 * 3 = 1392). The file is written under a temporary name and renamed when the recorder closes, so a trace is
either complete or absent.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from .errors import ModelFileError, RapidMoEError
from .ggufio import GGUFFile, tensor_f32

log = logging.getLogger(__name__)

MAGIC = b"RMOETRC1"
VERSION = 1
_HEAD = struct.Struct("<8sIIIIII")
TOPK_NAME = "ffn_moe_topk"
MAX_MOE_LAYERS = 4096  # a corrupt count beyond this is refused before anything is sized by it
# token_matrix() holds n_tokens * n_moe * k ids: at most the file's size plus this many (a trace with two or more
# MoE layers stores every token's ids in each layer but the last, so only a damaged file comes near)
MAX_SLACK_ELEMENTS = 1 << 24
WEIGHTS_NAME = "ffn_moe_weights"


class TraceError(RapidMoEError, ValueError):
    """A trace file that cannot be read, or a recording that cannot be made."""


@dataclass(frozen=True)
class TraceHeader:
    n_expert: int
    k: int
    moe_layers: tuple[int, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_moe(self) -> int:
        return len(self.moe_layers)

    @property
    def id_bytes(self) -> int:
        return 1 if self.n_expert <= 256 else 2

    @property
    def id_dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.id_bytes == 1 else "<u2")


@dataclass(frozen=True)
class Step:
    """One computed batch: per MoE layer (in header order), ids [rows, k] and weights [rows, k]."""

    n_tokens: int
    ids: tuple[np.ndarray, ...]
    weights: tuple[np.ndarray, ...]
    pred: tuple[np.ndarray, ...] = ()  # per MoE layer but the last: predicted ids of the next layer, [rows, k]


@dataclass(frozen=True)
class Trace:
    header: TraceHeader
    steps: tuple[Step, ...]

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.steps)

    @property
    def predicted(self) -> bool:
        return bool(self.header.meta.get("predicted"))

    def token_matrix(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(ids [N, n_moe, k], pred [N, n_moe, k] or None): every token of every step, -1 where a layer did not route
        the token. A layer with fewer rows than its step (llama.cpp's last layer computes only the rows that give
        logits) is taken to have routed the LAST rows (true for one sequence: its outputs come last). pred[:, m]
        is the prediction for layer m made at layer m - 1 (-1 for the first MoE layer)."""
        h = self.header
        ids = np.full((self.n_tokens, h.n_moe, h.k), -1, dtype=np.int64)
        pred = np.full_like(ids, -1) if self.predicted else None
        t0 = 0
        for s in self.steps:
            for m in range(h.n_moe):
                r = s.ids[m].shape[0]
                ids[t0 + s.n_tokens - r:t0 + s.n_tokens, m] = s.ids[m]
                if pred is not None and m + 1 < h.n_moe:
                    pr = s.pred[m].shape[0]
                    pred[t0 + s.n_tokens - pr:t0 + s.n_tokens, m + 1] = s.pred[m]
            t0 += s.n_tokens
        if pred is not None:
            pred[ids < 0] = -1
        return ids, pred

    def layer_ids(self, m: int) -> np.ndarray:
        """Every routed token's experts in MoE layer m (index into header.moe_layers), [rows, k] int64."""
        parts = [s.ids[m] for s in self.steps]
        k = self.header.k
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros((0, k), np.int64)

    def layer_weights(self, m: int) -> np.ndarray:
        parts = [s.weights[m] for s in self.steps]
        return np.concatenate(parts).astype(np.float32) if parts else np.zeros((0, self.header.k), np.float32)

    def counts(self) -> np.ndarray:
        """[n_moe, n_expert] how often each expert was chosen (the planner's frequency table format)."""
        h = self.header
        out = np.zeros((h.n_moe, h.n_expert), dtype=np.int64)
        for m in range(h.n_moe):
            out[m] = np.bincount(self.layer_ids(m).reshape(-1), minlength=h.n_expert)[: h.n_expert]
        return out

    def split(self, n_tokens: int) -> tuple[Trace, Trace]:
        """The steps covering the first ~n_tokens tokens, and the rest (whole steps)."""
        acc, cut = 0, len(self.steps)
        for i, s in enumerate(self.steps):
            if acc >= n_tokens:
                cut = i
                break
            acc += s.n_tokens
        return Trace(self.header, self.steps[:cut]), Trace(self.header, self.steps[cut:])


class TraceWriter:
    """Writes a trace under a temporary name; `close()` renames it into place (a context manager)."""

    def __init__(self, path: str | os.PathLike[str], header: TraceHeader) -> None:
        if header.n_expert < 1 or header.k < 1 or header.k > header.n_expert or not header.moe_layers:
            raise TraceError(f"bad trace header: {header.n_expert} experts, top-{header.k}, "
                             f"{len(header.moe_layers)} MoE layers")
        if header.n_expert > 65536:
            raise TraceError(f"traces hold expert ids up to 65535; the model has {header.n_expert} experts")
        self.path = Path(path)
        self.header = header
        self.tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        meta = json.dumps({**header.meta, "moe_layers": list(header.moe_layers)}).encode()
        try:
            self._f: BinaryIO | None = self.tmp.open("wb")
        except OSError as e:
            raise TraceError(f"cannot write trace {self.path}: {e.strerror}") from None
        self._f.write(_HEAD.pack(MAGIC, VERSION, header.n_moe, header.n_expert, header.k, header.id_bytes, len(meta)))
        self._f.write(meta)
        self.n_steps = 0
        self.n_tokens = 0

    def write_step(self, n_tokens: int, ids: list[np.ndarray], weights: list[np.ndarray],
                   pred: list[np.ndarray] | None = None) -> None:
        h = self.header
        if self._f is None:
            raise TraceError(f"trace {self.path} is closed")
        if len(ids) != h.n_moe or len(weights) != h.n_moe:
            raise TraceError(f"a step needs {h.n_moe} layers of ids and weights, got {len(ids)} and {len(weights)}")
        predicted = bool(h.meta.get("predicted"))
        if predicted != (pred is not None) or (pred is not None and (
                len(pred) != h.n_moe - 1 or any(np.shape(p) != np.shape(i) for p, i in zip(pred, ids, strict=False)))):
            raise TraceError("predictions must be given exactly when the header says so, one [rows, k] array per "
                             "MoE layer but the last")
        rows = []
        for i, w in zip(ids, weights, strict=True):
            i, w = np.asarray(i), np.asarray(w)
            if i.ndim != 2 or i.shape[1] != h.k or w.shape != i.shape or i.shape[0] > n_tokens:
                raise TraceError(f"step arrays must be [rows <= {n_tokens}, {h.k}], got ids {i.shape}, "
                                 f"weights {w.shape}")
            if i.size and (i.min() < 0 or i.max() >= h.n_expert):
                raise TraceError(f"expert id out of range 0..{h.n_expert - 1} in a step")
            rows.append(i.shape[0])
        self._f.write(struct.pack(f"<I{h.n_moe}I", n_tokens, *rows))
        for m, (i, w) in enumerate(zip(ids, weights, strict=True)):
            self._f.write(np.ascontiguousarray(i, dtype=h.id_dtype).tobytes())
            self._f.write(np.ascontiguousarray(w, dtype="<f2").tobytes())
            if pred is not None and m + 1 < h.n_moe:
                self._f.write(np.ascontiguousarray(pred[m], dtype=h.id_dtype).tobytes())
        self.n_steps += 1
        self.n_tokens += n_tokens

    def close(self) -> Path:
        if self._f is not None:
            self._f.close()
            self._f = None
            os.replace(self.tmp, self.path)
            log.info("trace: %d tokens in %d steps written to %s", self.n_tokens, self.n_steps, self.path)
        return self.path

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """The whole trace; a TraceError names the file and what is wrong (not a trace, wrong version, truncated)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise TraceError(f"cannot read trace {p}: {e.strerror}") from None
    if len(data) < _HEAD.size or data[:8] != MAGIC:
        raise TraceError(f"{p} is not a rapidmoe routing trace (no {MAGIC.decode()} header)")
    _, version, n_moe, n_expert, k, id_bytes, meta_len = _HEAD.unpack_from(data)
    if version != VERSION:
        raise TraceError(f"{p}: trace version {version}, this reader knows {VERSION}")
    if not (1 <= n_moe <= MAX_MOE_LAYERS and 1 <= n_expert <= 65536 and 1 <= k <= n_expert):
        raise TraceError(f"{p}: corrupt trace header ({n_moe} MoE layers, {n_expert} experts, top-{k})")
    off = _HEAD.size
    try:
        meta = json.loads(data[off:off + meta_len].decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise TraceError(f"{p}: unreadable trace metadata ({e})") from None
    if not isinstance(meta, dict):
        raise TraceError(f"{p}: the trace metadata is not a JSON object")
    off += meta_len
    try:
        layers = tuple(int(x) for x in meta.pop("moe_layers", range(n_moe)))
    except (TypeError, ValueError, OverflowError) as e:
        raise TraceError(f"{p}: the trace metadata's moe_layers is not a list of layer numbers ({e})") from None
    header = TraceHeader(n_expert, k, layers, meta)
    if len(layers) != n_moe or id_bytes != header.id_bytes:
        raise TraceError(f"{p}: inconsistent trace header ({n_moe} layers, metadata lists {len(layers)}; "
                         f"id width {id_bytes})")
    steps: list[Step] = []
    predicted = bool(meta.get("predicted"))
    pre = struct.Struct(f"<I{n_moe}I")
    n_total = 0
    while off < len(data):
        if off + pre.size > len(data):
            raise TraceError(f"{p}: truncated after {len(steps)} steps")
        n_tokens, *rows = pre.unpack_from(data, off)
        off += pre.size
        # every MoE layer but the last routes all of its step's tokens (llama.cpp skips rows only in the last layer)
        if any(r != n_tokens for r in rows[:-1]) or rows[-1] > n_tokens:
            raise TraceError(f"{p}: corrupt step {len(steps)} ({n_tokens} tokens, rows per layer {rows[:8]})")
        n_total += n_tokens
        if n_total * n_moe * k > len(data) + MAX_SLACK_ELEMENTS:  # only a one-MoE-layer trace can get here
            raise TraceError(f"{p}: corrupt trace: {n_total} tokens in {len(data)} bytes")
        ids, weights, pred = [], [], []
        for m, r in enumerate(rows):
            has_pred = predicted and m + 1 < n_moe
            nb_i, nb_w = r * k * id_bytes, r * k * 2
            if off + nb_i * (2 if has_pred else 1) + nb_w > len(data):
                raise TraceError(f"{p}: truncated or corrupt at step {len(steps)}")
            ids.append(np.frombuffer(data, header.id_dtype, r * k, off).reshape(r, k))
            off += nb_i
            weights.append(np.frombuffer(data, "<f2", r * k, off).reshape(r, k))
            off += nb_w
            if has_pred:
                pred.append(np.frombuffer(data, header.id_dtype, r * k, off).reshape(r, k))
                off += nb_i
            if r and max(int(ids[-1].max()), int(pred[-1].max()) if has_pred else 0) >= n_expert:
                raise TraceError(f"{p}: step {len(steps)} names an expert beyond the header's {n_expert}")
        steps.append(Step(n_tokens, tuple(ids), tuple(weights), tuple(pred)))
    return Trace(header, tuple(steps))


# what a layer's router reads (its normalised FFN input): the second source of its router matmul, whatever the
# architecture named that tensor (ffn_norm in most graphs, attn_post_norm in qwen3next's family)
INPUT_NAME = "ffn_moe_logits-{il}#src1"


class NextLayerPredictor:
    """MoEpic's predictor: the next MoE layer's router applied to this layer's FFN input; top-k of its selection
    scores (softmax gating: the logits; sigmoid gating: sigmoid(logits) + the selection bias, as DeepSeek-V3).
    Expert groups (DeepSeek-V3's group-limited routing) are not applied."""

    def __init__(self, model_path: str | os.PathLike[str], moe_layers: list[int], k: int) -> None:
        f = GGUFFile(model_path)
        arch = f.get("general.architecture")
        gating = int(f.get(f"{arch}.expert_gating_func", 0) or 0)
        names = {t.name: t for t in f.tensors}
        self.k = k
        self.sigmoid = gating == 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID; unset means softmax
        # read before llama.cpp has checked the file (the recorder is the context's eval callback): what it would
        # refuse must be a clear error here too, not a KeyError (fuzzing: model seed 100 #301)
        routers = [names.get(f"blk.{il}.ffn_gate_inp.weight") for il in moe_layers]
        for il, t in zip(moe_layers, routers, strict=True):
            if t is None or len(t.shape) != 2:
                raise ModelFileError(f"{model_path}: MoE layer {il} has routed experts but no 2-D router tensor "
                                     f"blk.{il}.ffn_gate_inp.weight")
        self.router = [tensor_f32(t) for t in routers if t is not None]  # [n_expert, d]
        bias = [names.get(f"blk.{il}.exp_probs_b.bias") for il in moe_layers]
        self.bias = [tensor_f32(b) if b is not None else None for b in bias]

    def predict(self, m: int, x: np.ndarray) -> np.ndarray:
        """Top-k experts of MoE layer m (index) for inputs x (any shape ending in n_embd), [rows, k]."""
        w = self.router[m]
        logits = x.reshape(-1, w.shape[1]).astype(np.float32) @ w.T
        score = logits
        if self.sigmoid:
            score = 1.0 / (1.0 + np.exp(-logits))
            bias = self.bias[m]
            if bias is not None:
                score = score + bias.reshape(1, -1)
        return np.argsort(-score, axis=1, kind="stable")[:, : self.k]


class TraceRecorder:
    """Records a llama.cpp context's routing into a trace file: `callback` is the eval callback to install,
    `flush()` after each llama_decode moves what the callback captured into the file, `close()` finishes it."""

    def __init__(self, path: str | os.PathLike[str], *, moe_layers: list[int], n_expert: int, k: int,
                 meta: dict[str, Any], predictor: NextLayerPredictor | None = None) -> None:
        from ._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use)

        if not moe_layers:
            raise TraceError("the model has no MoE layers: nothing to trace")
        self.moe_layers = list(moe_layers)
        self.k = k
        self.predictor = predictor if len(self.moe_layers) > 1 else None
        self._names = [(f"{TOPK_NAME}-{il}", f"{WEIGHTS_NAME}-{il}") for il in self.moe_layers]
        names = [n for pair in self._names for n in pair]
        self._inputs = [INPUT_NAME.format(il=il) for il in self.moe_layers[:-1]] if self.predictor else []
        self.callback = _core.TensorCapture(names + self._inputs)
        meta = {"weights": WEIGHTS_NAME, "predicted": self.predictor is not None,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), **meta}
        self.writer = TraceWriter(path, TraceHeader(n_expert, k, tuple(self.moe_layers), meta))

    def flush(self) -> int:
        """Write every batch computed since the last flush; returns the number of steps written."""
        got = [(self.callback.get(t), self.callback.get(w)) for t, w in self._names]
        xs = [self.callback.get(x) for x in self._inputs]
        self.callback.clear()
        n = {len(t) for t, _ in got} | {len(w) for _, w in got} | {len(x) for x in xs}
        if len(n) != 1:
            raise TraceError(f"the graph computed the MoE layers unevenly ({sorted(n)} batches): cannot record "
                             "a consistent trace")
        n_steps = n.pop()
        for s in range(n_steps):
            ids = [t[s].reshape(-1, self.k).astype(np.int64) for t, _ in got]
            weights = [w[s].reshape(-1, self.k) for _, w in got]
            pred = None
            if self.predictor is not None:
                pred = [self.predictor.predict(m + 1, x[s])[-ids[m].shape[0]:] for m, x in enumerate(xs)]
            self.writer.write_step(max(x.shape[0] for x in ids), ids, weights, pred)
        return n_steps

    def close(self) -> Path:
        self.flush()
        return self.writer.close()

    def abort(self) -> None:
        self.writer.abort()
