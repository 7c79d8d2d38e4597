"""Parallel, resumable RESplit conversion: the work cut into items (a run of experts of one routed-expert tensor, or a
run of rows of another tensor, each about ITEM_BYTES of source), run on a pool of threads that read their source
bytes with pread, encode them in the compiled core (the GIL released) and pwrite the results at their final offsets
in preallocated files; so every item's bytes land where the one-thread reference writer (convert._Converter.write)
puts them, whatever the thread count or the order items finish in.

The files being written are `<final>.partial`, with a journal `<name>.resplit.journal` (JSON lines: the conversion's
identity, then one line per finished item with the sha256 of its output bytes and its error sums). A conversion that
stops (a signal, Ctrl-C, a full disk, a crash) leaves them; `resume=True` continues it: the journal must name the same
conversion (source, preset, importance matrix, split size, this encoder's version), the headers are rewritten and
every item the journal lists is read back and hashed, so only items whose bytes are on disk and intact count as done.
How tensors are chosen and typed, and the report, are convert.py's.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGMLQuantizationType
from tqdm import tqdm

from ..errors import ModelFileError, RapidMoEError
from ..ggml_types import ggml_type, tensor_bytes
from ..ggufio import FilePlan as Shard
from ..ggufio import Tensor, n_rows, pad_to_alignment, write_at
from .codecs import Codec, encode_measured
from .report import TensorReport

if TYPE_CHECKING:
    from .convert import _Converter

log = logging.getLogger(__name__)

JOURNAL_VERSION = 1
# the items' outputs and error sums depend on the encoder: bump when the compiled encoder's bytes change
ENCODER_VERSION = 1
ITEM_BYTES = 16 << 20  # source bytes per work item (at least one expert or one row): bounds a worker's memory


def default_threads() -> int:
    """Every core this process may run on (its CPU affinity: taskset, a cgroup's cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# -- the work ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Span:
    shard: int  # index into the conversion's shards (WQ's, then the sidecar's)
    offset: int
    n_bytes: int


@dataclass(frozen=True)
class Item:
    index: int
    tensor: Tensor
    target: GGMLQuantizationType | None  # None: routed experts (WQ and sidecar); else the WQ type of the rows
    first: int  # first expert, or first row
    count: int
    spans: tuple[Span, ...]
    src_offset: int  # absolute, in the tensor's own file
    src_bytes: int


@dataclass
class ExpertJob:
    """What encode_experts needs for one routed-expert tensor (shared by its items); mode None: the codec has no
    compiled encoder, its own (codec.encode) runs on the worker thread."""

    mode: int | None
    wq_type: int
    hi_type: int
    wq_row: int
    hi_row: int
    ref_types: list[int]
    sampled: set[int]
    imatrix: np.ndarray | None  # float32 [n_expert, n_in]
    report: TensorReport
    codec: Codec
    wq: str  # the types (ExpertPlan's), for the codec's own encoder
    hi: str
    copy: bool


def _expert_job(conv: _Converter, t: Tensor) -> ExpertJob:
    plan, codec = conv.plans[t.name], conv.codec
    n_in, n_out, n_expert = (int(x) for x in t.shape)
    imat = conv.imatrix.weights_for(t.name, n_expert, n_in) if conv.imatrix is not None else None
    sampled = conv.sample_experts(n_expert)
    copy = codec.is_copy(plan.role, conv.preset)
    refs = [int(ggml_type(r)) for r in codec.reference_types(n_in)]
    rep = TensorReport(t.name, plan.role, plan.wq, plan.hi, copy, fallbacks=plan.describe_fallbacks())
    c = codec.compiled(plan.wq, plan.hi, copy, n_in)
    if c is not None:
        return ExpertJob(c.mode, c.wq_type, c.hi_type, c.wq_row, c.hi_row, refs, sampled, imat, rep, codec, plan.wq,
                         plan.hi, copy)
    hi_row = codec.sidecar_tensor((n_in, n_out, n_expert), plan.hi)[1][-1]
    return ExpertJob(None, int(ggml_type(plan.wq)), 0, tensor_bytes(plan.wq, (n_in,)), hi_row, refs, sampled, imat, rep,
                     codec, plan.wq, plan.hi, copy)


def _src_row(t: Tensor) -> int:
    return int(t.n_bytes) // n_rows(t)


def make_items(conv: _Converter, plan: list[tuple[Tensor, GGMLQuantizationType | None]], shards: list[Shard],
               n_wq: int, item_bytes: int | None = None) -> list[Item]:
    """Every item of the conversion, in file order (shards: the WQ file's n_wq, then the sidecar's); items of about
    item_bytes of source (default ITEM_BYTES)."""
    item_bytes = item_bytes or ITEM_BYTES
    where: dict[str, tuple[int, int, int]] = {}  # output tensor -> (shard, offset, bytes)
    for i, sh in enumerate(shards):
        for name, (off, n) in sh.offsets.items():
            where[name] = (i, off, n)
    wq_shards = set(range(n_wq))
    items: list[Item] = []
    for t, target in plan:
        src_row = _src_row(t)
        if target is None:
            _, n_out, n_expert = (int(x) for x in t.shape)
            per = n_out * src_row
            step = max(1, min(n_expert, item_bytes // per))
            wq_i, wq_off, wq_n = _find(where, t.name, wq_shards, True)
            wr_i, wr_off, wr_n = _find(where, conv.sidecar_names[t.name], wq_shards, False)
            wq_e, wr_e = wq_n // n_expert, wr_n // n_expert
            for e in range(0, n_expert, step):
                c = min(step, n_expert - e)
                items.append(Item(len(items), t, None, e, c,
                                  (Span(wq_i, wq_off + e * wq_e, c * wq_e), Span(wr_i, wr_off + e * wr_e, c * wr_e)),
                                  int(t.data_offset) + e * per, c * per))
        else:
            rows = n_rows(t)
            step = max(1, min(rows, item_bytes // max(1, src_row)))
            wq_i, wq_off, wq_n = _find(where, t.name, wq_shards, True)
            out_row = wq_n // rows
            for r in range(0, rows, step):
                c = min(step, rows - r)
                items.append(Item(len(items), t, target, r, c, (Span(wq_i, wq_off + r * out_row, c * out_row),),
                                  int(t.data_offset) + r * src_row, c * src_row))
    return items


def _find(where: dict[str, tuple[int, int, int]], name: str, wq_shards: set[int], wq: bool) -> tuple[int, int, int]:
    i, off, n = where[name]
    assert (i in wq_shards) == wq, name
    return i, off, n


# -- reading and writing ---------------------------------------------------------------------------------------------
def _pread(fd: int, n: int, offset: int, what: str) -> np.ndarray:
    buf = np.empty(n, dtype=np.uint8)
    done = 0
    while done < n:
        got = os.preadv(fd, [buf.data[done:]], offset + done)
        if got == 0:
            raise ModelFileError(f"{what} ends at byte {offset + done}, inside its tensor data (a truncated file?)")
        done += got
    return buf


@dataclass
class _Files:
    """Open descriptors: the source files (by path) and the partial outputs (by shard)."""

    src: dict[Path, int] = field(default_factory=dict)
    out: list[int] = field(default_factory=list)

    def source(self, t: Tensor) -> int:
        path = t._file.path
        fd = self.src.get(path)
        if fd is None:
            fd = self.src[path] = os.open(path, os.O_RDONLY)
        return fd

    def close(self) -> None:
        for fd in [*self.src.values(), *self.out]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.src.clear()
        self.out.clear()


Stats = tuple[float, float, float, float, list[float]]


def run_item(item: Item, jobs: dict[str, ExpertJob], files: _Files) -> tuple[str, Stats | None]:
    """Encode one item and write its bytes; returns the sha256 of its output bytes (in span order) and, for routed
    experts, its error sums."""
    from .._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use)

    t = item.tensor
    raw = _pread(files.source(t), item.src_bytes, item.src_offset, f"source tensor {t.name} ({t._file.path})")
    h = hashlib.sha256()
    stats: Stats | None = None
    if item.target is None:
        job = jobs[t.name]
        n_in, n_out = int(t.shape[0]), int(t.shape[1])
        src = raw.reshape(item.count * n_out, _src_row(t))
        wq = np.empty((item.count * n_out, job.wq_row), dtype=np.uint8)
        hi = np.empty((item.count * n_out, job.hi_row), dtype=np.uint8)
        im = job.imatrix[item.first: item.first + item.count] if job.imatrix is not None else None
        sampled = [e in job.sampled for e in range(item.first, item.first + item.count)]
        if job.mode is None:
            stats = _encode_in_python(job, t, src, item.count, wq, hi, im, sampled)
        else:
            w2, wq2, crit2, ref_w2, ref2 = _core.encode_experts(src, int(t.tensor_type), n_in, n_out, job.mode,
                                                                job.wq_type, job.hi_type, wq, hi, im, job.ref_types,
                                                                sampled)
            stats = (w2, wq2, crit2, ref_w2, list(ref2))
        outs = [wq, hi]
    else:
        outs = [_other_rows(t, item.target, raw, item.count)]
    for span, data in zip(item.spans, outs, strict=True):
        assert data.nbytes == span.n_bytes, (t.name, data.nbytes, span.n_bytes)
        write_at(files.out[span.shard], data, span.offset)
        h.update(np.ascontiguousarray(data).data.cast("B"))
    return h.hexdigest()[:32], stats


def _encode_in_python(job: ExpertJob, t: Tensor, src: np.ndarray, count: int, wq: np.ndarray, hi: np.ndarray,
                      im: np.ndarray | None, sampled: list[bool]) -> Stats:
    """A codec without a compiled encoder: its own encode, expert by expert, with the error sums encode_experts
    returns (report.TensorReport.add's)."""
    n_out = int(t.shape[1])
    rows = _float_rows(t, src, count * n_out)
    refs = [GGMLQuantizationType(rt).name for rt in job.ref_types]
    sums = TensorReport(t.name, job.report.role, job.wq, job.hi, job.copy)
    for i in range(count):
        w, ei = rows[i * n_out: (i + 1) * n_out], im[i] if im is not None else None
        enc = encode_measured(job.codec, w, job.wq, job.hi, job.copy, ei, refs if sampled[i] else (), sums)
        wq[i * n_out: (i + 1) * n_out], hi[i * n_out: (i + 1) * n_out] = enc.wq, enc.sidecar
    a = sums.acc
    return a.w2, a.wq2, a.crit2, a.ref_w2, [a.ref2.get(name, 0.0) for name in refs]


def _float_rows(t: Tensor, raw: np.ndarray, count: int) -> np.ndarray:
    """`count` rows of a tensor's source bytes as float32 [count, n_per_row]."""
    from .._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use)

    src_t = GGMLQuantizationType(int(t.tensor_type))
    n_per_row = int(t.shape[0])
    if src_t == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(count, n_per_row)
    if src_t == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(count, n_per_row).astype(np.float32)
    out: np.ndarray = _core.dequantize(raw.reshape(count, -1), int(src_t), n_per_row, 1)
    return out


def _other_rows(t: Tensor, target: GGMLQuantizationType, raw: np.ndarray, count: int) -> np.ndarray:
    """Rows of a non-expert tensor in its WQ type, as the reference writer makes them."""
    from .._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use)

    src_t = GGMLQuantizationType(int(t.tensor_type))
    if target == src_t:  # kept as stored
        return raw
    rows = _float_rows(t, raw, count)
    if target == GGMLQuantizationType.F32:
        return np.ascontiguousarray(rows, dtype=np.float32)
    if target == GGMLQuantizationType.F16:
        return rows.astype(np.float16)
    out: np.ndarray = _core.quantize(np.ascontiguousarray(rows, dtype=np.float32), int(target), None, 1)
    return out


def _digest(item: Item, files: _Files) -> str:
    """The sha256 of the item's output bytes as they are in the partial files now."""
    h = hashlib.sha256()
    for span in item.spans:
        h.update(_pread(files.out[span.shard], span.n_bytes, span.offset, "partial output").data)
    return h.hexdigest()[:32]


# -- the journal -----------------------------------------------------------------------------------------------------
def identity(pair_id: str, shards: Sequence[Shard], items: Sequence[Item]) -> str:
    """What a journal must name for its items to be reused: the pair id (source, preset, importance matrix), every
    output header and the cut into items."""
    h = hashlib.sha256(f"journal {JOURNAL_VERSION} encoder {ENCODER_VERSION} pair {pair_id}\n".encode())
    for sh in shards:
        h.update(f"{sh.final.name} {sh.size}\n".encode())
        h.update(sh.header)
    for it in items:
        h.update(f"{it.tensor.name} {it.first} {it.count} {[(s.shard, s.offset, s.n_bytes) for s in it.spans]}\n"
                 .encode())
    return h.hexdigest()


def read_journal(path: Path) -> tuple[dict[str, Any] | None, dict[int, dict[str, Any]]]:
    """The journal's first line and its items by index (a torn or unreadable line, as a crash leaves, ends it)."""
    head: dict[str, Any] | None = None
    done: dict[int, dict[str, Any]] = {}
    with contextlib.suppress(FileNotFoundError), path.open("r", encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break
            if not isinstance(rec, dict):
                break
            if n == 0:
                head = rec
            elif isinstance(rec.get("i"), int) and isinstance(rec.get("d"), str):
                done[rec["i"]] = rec
    return head, done


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a conversion; `message` says what was kept and how to continue."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# -- the run ---------------------------------------------------------------------------------------------------------
@dataclass
class Progress:
    done_items: int = 0
    reused_items: int = 0
    redone_items: int = 0  # listed in the journal, but their bytes did not match (redone)


class ParallelWriter:
    """Writes one conversion's partial files with `threads` threads; `complete()` says whether all items are done."""

    def __init__(self, conv: _Converter, shards: list[Shard], items: list[Item], journal: Path, pair_id: str,
                 threads: int) -> None:
        self.conv, self.shards, self.items, self.journal, self.pair_id = conv, shards, items, journal, pair_id
        self.threads = max(1, threads)
        self.ident = identity(pair_id, shards, items)
        self.stats: dict[int, Stats | None] = {}
        self.progress = Progress()
        self.files = _Files()
        self.stop = threading.Event()

    # partial files ---------------------------------------------------------------------------------------------------
    def partials(self) -> list[Path]:
        return [sh.partial for sh in self.shards] + [self.journal]

    def existing(self) -> list[Path]:
        return [p for p in self.partials() if p.exists()]

    def open(self, resume: bool) -> None:
        """Open (resume) or create the partial files, sized and with their headers written."""
        create = not resume
        if resume:
            head, _ = read_journal(self.journal)
            if head is None or head.get("identity") != self.ident or not all(sh.partial.exists() for sh in self.shards):
                why = ("it has no journal" if head is None else
                       "its files are incomplete" if not all(sh.partial.exists() for sh in self.shards) else
                       "it was started from another source, preset, importance matrix, split size or RapidMoE version")
                raise RapidMoEError(f"cannot resume the conversion in {self.journal.parent}: {why}; pass --force "
                                    "instead of --resume to start over")
        try:
            for sh in self.shards:
                flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
                fd = os.open(sh.partial, flags, 0o644)
                self.files.out.append(fd)
                _reserve(fd, sh.size)
                write_at(fd, np.frombuffer(sh.header, dtype=np.uint8), 0)  # rewritten on resume: never trusted
                pad = pad_to_alignment(len(sh.header)) - len(sh.header)
                if pad:
                    write_at(fd, np.zeros(pad, dtype=np.uint8), len(sh.header))
            if create:
                with self.journal.open("w", encoding="utf-8") as f:
                    f.write(json.dumps({"journal": JOURNAL_VERSION, "identity": self.ident, "pair_id": self.pair_id,
                                        "items": len(self.items)}) + "\n")
        except OSError:
            self.files.close()
            if create:
                self.discard()
            raise

    def discard(self) -> None:
        for p in self.partials():
            with contextlib.suppress(OSError):
                p.unlink(missing_ok=True)

    # the items -------------------------------------------------------------------------------------------------------
    def _jobs(self) -> dict[str, ExpertJob]:
        return {t.name: _expert_job(self.conv, t) for t in {it.tensor.name: it.tensor for it in self.items
                                                             if it.target is None}.values()}

    def validate(self, pool: ThreadPoolExecutor) -> None:
        """Items the journal lists whose bytes are on disk as recorded count as done; the others are redone."""
        _, listed = read_journal(self.journal)
        checks = {i: pool.submit(_digest, self.items[i], self.files) for i in listed if 0 <= i < len(self.items)}
        for i, fut in checks.items():
            rec = listed[i]
            if fut.result() == rec["d"]:
                s = rec.get("s")
                self.stats[i] = None if s is None else (s[0], s[1], s[2], s[3], list(s[4]))
                self.progress.reused_items += 1
            else:
                self.progress.redone_items += 1
        log.info("resume: %d items kept, %d redone (bytes differ from the journal)", self.progress.reused_items,
                 self.progress.redone_items)

    def run(self, resume: bool, progress: bool) -> None:
        jobs = self._jobs()
        total = sum(it.src_bytes for it in self.items)
        with ThreadPoolExecutor(self.threads, thread_name_prefix="resplit") as pool, \
                self.journal.open("a", encoding="utf-8") as jf:
            if resume:
                self.validate(pool)
            todo = iter([it for it in self.items if it.index not in self.stats])
            done_bytes = sum(self.items[i].src_bytes for i in self.stats)
            with tqdm(total=total, initial=done_bytes, unit="B", unit_scale=True, desc="resplit",
                      disable=not progress, smoothing=0.05) as bar:
                self._drain(pool, todo, jobs, jf, bar)

    def _drain(self, pool: ThreadPoolExecutor, todo: Iterator[Item], jobs: dict[str, ExpertJob], jf: Any,
               bar: Any) -> None:
        pending: dict[Future[tuple[str, Stats | None]], Item] = {}
        limit = 2 * self.threads  # items in flight: bounds the memory to about two items per thread
        try:
            while True:
                while len(pending) < limit and not self.stop.is_set():
                    it = next(todo, None)
                    if it is None:
                        break
                    pending[pool.submit(self._guarded, it, jobs)] = it
                if not pending:
                    return
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    it = pending.pop(fut)
                    digest, stats = fut.result()
                    self._record(jf, it, digest, stats)
                    bar.update(it.src_bytes)
        except BaseException:
            self.stop.set()
            for fut in pending:
                fut.cancel()
            for fut, it in pending.items():  # keep what finished meanwhile
                if not fut.cancelled():
                    with contextlib.suppress(BaseException):
                        digest, stats = fut.result()
                        self._record(jf, it, digest, stats)
            raise

    def _guarded(self, it: Item, jobs: dict[str, ExpertJob]) -> tuple[str, Stats | None]:
        if self.stop.is_set():
            raise StoppedError
        return run_item(it, jobs, self.files)

    def _record(self, jf: Any, it: Item, digest: str, stats: Stats | None) -> None:
        self.stats[it.index] = stats
        self.progress.done_items += 1
        jf.write(json.dumps({"i": it.index, "d": digest, "s": stats}) + "\n")
        jf.flush()

    def complete(self) -> bool:
        return len(self.stats) == len(self.items)

    def reports(self) -> list[TensorReport]:
        """The per-tensor error report, the items' sums added in item order (the same for any thread count)."""
        jobs = self._jobs()
        for it in self.items:
            s = self.stats[it.index]
            if it.target is None and s is not None:
                acc = jobs[it.tensor.name].report.acc
                acc.w2 += s[0]
                acc.wq2 += s[1]
                acc.crit2 += s[2]
                acc.ref_w2 += s[3]
                for name, v in zip(_ref_names(self.conv, it.tensor), s[4], strict=True):
                    acc.ref2[name] = acc.ref2.get(name, 0.0) + v
        return [jobs[t.name].report for t in {it.tensor.name: it.tensor for it in self.items
                                              if it.target is None}.values()]


class StoppedError(Exception):
    """An item not started because the run is stopping."""


def _ref_names(conv: _Converter, t: Tensor) -> list[str]:
    return conv.codec.reference_types(int(t.shape[0]))


def _reserve(fd: int, size: int) -> None:
    """The file's blocks allocated up front (a full disk or a file size limit fails now, not hours later)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
        os.ftruncate(fd, size)
    if os.fstat(fd).st_size != size:  # a resumed file longer than this conversion's
        os.ftruncate(fd, size)
