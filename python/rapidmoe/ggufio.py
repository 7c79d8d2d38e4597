"""GGUF reading for RapidMoE: a fast header parser (gguf-py's reader takes seconds on a 50k-token vocabulary),
memory-mapped tensor data, metadata copy into a gguf-py writer, and tensors as float32 through ggml. A model split
with llama.cpp's gguf-split (PREFIX-00001-of-0000N.gguf, its `split.*` keys) reads as one file from its first part.

Writing stays with gguf-py's GGUFWriter; (de)quantization goes through ggml (rapidmoe._core).
"""
from __future__ import annotations

import contextlib
import io
import math
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.gguf_writer import WriterState

from .errors import ModelFileError
from .ggml_types import block_bytes, block_size

_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NP = {GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
       GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
       GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_, GGUFValueType.UINT64: np.uint64,
       GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT64: np.float64}


class GGUFFormatError(ModelFileError):
    """The bytes are not a well-formed GGUF (truncated or corrupt header): a problem with the user's file, so a
    reader that does not name the file in its own message still ends as one error line."""


@dataclass(frozen=True)
class Field:
    vtype: GGUFValueType
    value: Any
    sub_type: GGUFValueType | None = None  # element type of an array


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] (row length) first
    tensor_type: GGMLQuantizationType
    data_offset: int  # absolute offset in the file
    n_bytes: int
    _file: GGUFFile = field(repr=False, compare=False)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def data(self) -> np.ndarray:
        """Memory-mapped view: float32/float16 in numpy order, else raw bytes [..., row_bytes]."""
        dims = tuple(reversed(self.shape))
        mm = self._file.memmap()
        raw = mm[self.data_offset: self.data_offset + self.n_bytes]
        if self.tensor_type == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(dims)
        if self.tensor_type == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(dims)
        return raw.reshape(*dims[:-1], -1)


SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS = "split.count", "split.no", "split.tensors.count"
_SPLIT_NAME = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def split_paths(first: str | os.PathLike[str], count: int) -> list[Path]:
    """The parts of a split GGUF from its first part's path, as llama.cpp names them (llama_split_path:
    PREFIX-%05d-of-%05d.gguf); ModelFileError if the path is not a first part of `count`."""
    p = Path(first)
    m = _SPLIT_NAME.match(p.name)
    if m is None or int(m.group(2)) != 1 or int(m.group(3)) != count:
        raise ModelFileError(f"{p} is part of a model split in {count} files, but not named as the first "
                             f"(PREFIX-00001-of-{count:05d}.gguf, llama.cpp's gguf-split naming)")
    return [p.with_name(f"{m.group(1)}-{i + 1:05d}-of-{count:05d}.gguf") for i in range(count)]


class GGUFFile:
    """A GGUF's metadata and tensor table, parsed from the header; tensor data memory-mapped on demand.

    A split model (llama.cpp's gguf-split) opens from its first part: `tensors` then holds every part's tensors
    (each reads from its own part, `Tensor._file`), `shards` the parts in order; `fields`, `value_offsets` and
    `data_start` are the first part's. `shards` names the parts where their names do not follow the split naming
    (files being written); `single` reads one file whatever its split keys."""

    def __init__(self, path: str | os.PathLike[str], shards: Sequence[str | os.PathLike[str]] | None = None, *,
                 single: bool = False) -> None:
        self.path = Path(path)
        self.fields: dict[str, Field] = {}
        self.tensors: list[Tensor] = []
        self.value_offsets: dict[str, int] = {}  # key -> file offset of its value's bytes (scalars and strings)
        self.data_start = 0  # file offset where the tensor data begins (the header's end, aligned)
        self.shards: list[GGUFFile] = [self]
        self._mm: np.memmap | None = None
        size = self.path.stat().st_size
        with self.path.open("rb") as f:
            try:
                self._parse(f, size)
            except (struct.error, UnicodeDecodeError, ValueError, OverflowError, MemoryError, KeyError,
                    ZeroDivisionError, TypeError) as e:
                raise GGUFFormatError(f"bad GGUF header: {e}") from e
        count = self.get(SPLIT_COUNT)
        if not single and isinstance(count, int) and count > 1:
            self._open_parts(count, shards)

    def _open_parts(self, count: int, names: Sequence[str | os.PathLike[str]] | None) -> None:
        if self.get(SPLIT_NO) != 0:
            raise ModelFileError(f"{self.path} is part {int(self.get(SPLIT_NO, 0)) + 1} of a model split in {count} "
                                 "files: give its first part (...-00001-of-...gguf)")
        paths = [Path(p) for p in names] if names is not None else split_paths(self.path, count)
        if len(paths) != count:
            raise ModelFileError(f"{self.path} is split in {count} files, {len(paths)} given")
        for i, p in enumerate(paths[1:], start=1):
            if not p.is_file():
                raise ModelFileError(f"{p} not found: {self.path} is the first of {count} parts (llama.cpp's "
                                     "gguf-split), all must be in its folder")
            part = GGUFFile(p, single=True)
            if part.get(SPLIT_NO) != i or part.get(SPLIT_COUNT) != count:
                raise ModelFileError(f"{p} is not part {i + 1} of {count} of {self.path} (its split.no is "
                                     f"{part.get(SPLIT_NO)}, split.count {part.get(SPLIT_COUNT)})")
            self.shards.append(part)
            self.tensors.extend(part.tensors)
        expected = self.get(SPLIT_TENSORS)
        if isinstance(expected, int) and expected != len(self.tensors):
            raise ModelFileError(f"{self.path}: the {count} parts hold {len(self.tensors)} tensors, its "
                                 f"split.tensors.count says {expected} (a part of another model?)")

    @property
    def paths(self) -> list[Path]:
        """Every file of the model (one, or the parts of a split model in order)."""
        return [s.path for s in self.shards]

    @property
    def size(self) -> int:
        """Bytes of every file together."""
        return sum(p.stat().st_size for p in self.paths)

    def _parse(self, f: BinaryIO, size: int) -> None:
        def read(fmt: str) -> Any:
            n = struct.calcsize(fmt)
            b = f.read(n)
            if len(b) != n:
                raise GGUFFormatError("unexpected end of file in the header")
            return struct.unpack(fmt, b)[0]

        def read_str() -> str:
            n = read("<Q")
            if n > size:
                raise GGUFFormatError("string length beyond the end of the file")
            b = f.read(n)
            if len(b) != n:
                raise GGUFFormatError("unexpected end of file in the header")
            return b.decode("utf-8")

        def read_value(vt: GGUFValueType) -> Any:
            if vt == GGUFValueType.STRING:
                return read_str()
            return read(_SCALAR[vt])

        if f.read(4) != b"GGUF":
            raise GGUFFormatError("not a GGUF file")
        version = read("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = read("<Q"), read("<Q")
        for _ in range(n_kv):
            key = read_str()
            vt = GGUFValueType(read("<I"))
            if vt == GGUFValueType.ARRAY:
                st = GGUFValueType(read("<I"))
                n = read("<Q")
                if st == GGUFValueType.STRING:
                    value: Any = [read_str() for _ in range(n)]
                elif st == GGUFValueType.ARRAY:
                    raise GGUFFormatError(f"nested arrays are not supported ({key})")
                else:
                    dt = np.dtype(_NP[st])
                    b = f.read(n * dt.itemsize)
                    if len(b) != n * dt.itemsize:
                        raise GGUFFormatError("unexpected end of file in the header")
                    value = np.frombuffer(b, dtype=dt).tolist()
                self.fields[key] = Field(vt, value, st)
            else:
                self.value_offsets[key] = f.tell() + (8 if vt == GGUFValueType.STRING else 0)  # after the length
                self.fields[key] = Field(vt, read_value(vt))
        infos = []
        for _ in range(n_tensors):
            name = read_str()
            n_dims = read("<I")
            shape = tuple(read("<Q") for _ in range(n_dims))
            qt = GGMLQuantizationType(read("<I"))
            offset = read("<Q")
            infos.append((name, shape, qt, offset))
        align = 32
        if "general.alignment" in self.fields:  # as gguf.cpp: a UINT32 power of two
            fa = self.fields["general.alignment"]
            if fa.vtype != GGUFValueType.UINT32 or fa.value < 1 or fa.value & (fa.value - 1):
                raise GGUFFormatError(f"general.alignment must be a UINT32 power of two, not {fa.vtype.name} "
                                      f"{str(fa.value)[:40]}")
            align = int(fa.value)
        start = f.tell()
        start += (-start) % align
        self.data_start = start
        for name, shape, qt, offset in infos:
            block, tsize = block_size(qt.name), block_bytes(qt.name)
            n = math.prod(shape)  # Python ints: a corrupt shape must not wrap around to a small size
            if n >= 2**63 or any(d >= 2**63 for d in shape):  # gguf.cpp refuses these too (int64 overflow)
                raise GGUFFormatError(f"tensor {name} has an impossible shape {list(shape)}")
            self.tensors.append(Tensor(name, shape, qt, start + offset, n // block * tsize, self))

    def memmap(self) -> np.memmap:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm

    def missing_data(self) -> tuple[Tensor, int] | None:
        """The first tensor whose data run past the end of its file, with that file's size (None: complete)."""
        sizes = {s.path: s.path.stat().st_size for s in self.shards}
        for t in self.tensors:
            size = sizes[t._file.path]
            if int(t.data_offset) + int(t.n_bytes) > size:
                return t, size
        return None

    def get(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        return default if f is None else f.value

    def tensor(self, name: str) -> Tensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)


SKIP_KEYS = ("GGUF.", "general.architecture", "general.alignment", "split.")  # split.*: the writer's own parts


def copy_metadata(reader: GGUFFile, writer: GGUFWriter, *, skip_prefixes: tuple[str, ...] = ()) -> None:
    """Copy every KV pair with its exact GGUF type (except the architecture, which the writer sets). Empty arrays
    (gguf-py cannot write them; llama.cpp reads an absent array as empty) are left out."""
    for key, f in reader.fields.items():
        if key.startswith(SKIP_KEYS + skip_prefixes):
            continue
        if f.vtype == GGUFValueType.ARRAY and len(f.value) == 0:
            continue
        writer.add_key_value(key, f.value, f.vtype, f.sub_type)


# -- writing at known offsets ------------------------------------------------------------------------------------
ALIGN = 32  # GGUF data alignment (our writers never set general.alignment)


def pad_to_alignment(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class FilePlan:
    """One file a GGUFWriter makes: its header bytes and where each tensor's data go, so that they can be written
    in any order (pwrite at the offsets) and give the bytes the writer's sequential writes give."""

    final: Path
    header: bytes  # header, metadata and tensor table (not padded)
    offsets: dict[str, tuple[int, int]]  # tensor -> (absolute data offset, bytes)
    size: int  # the complete file's size

    @property
    def partial(self) -> Path:
        return self.final.with_name(self.final.name + ".partial")


def split_names(final: Path, n: int) -> list[Path]:
    """llama.cpp's split naming (gguf-split, llama_split_path): PREFIX-00001-of-0000N.gguf; one file keeps its name."""
    if n == 1:
        return [final]
    stem = final.name.removesuffix(".gguf")
    return [final.with_name(f"{stem}-{i + 1:05d}-of-{n:05d}.gguf") for i in range(n)]


def plan_files(w: GGUFWriter, final: Path) -> list[FilePlan]:
    """The files a writer whose metadata and tensor table are complete makes (one, or its splits), with their header
    bytes and every tensor's place, as GGUFWriter lays them out (data aligned to 32, each tensor padded to 32)."""
    bufs = [io.BytesIO() for _ in w.tensors]
    w.fout = bufs  # type: ignore[assignment]  # the writer writes its header to these instead of opening files
    w.state = WriterState.EMPTY
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    plans = []
    for path, buf, tensors in zip(split_names(final, len(bufs)), bufs, w.tensors, strict=True):
        head = buf.getvalue()
        at = pad_to_alignment(len(head))
        offsets = {}
        for name, ti in tensors.items():
            offsets[name] = (at, int(ti.nbytes))
            at += pad_to_alignment(int(ti.nbytes))
        plans.append(FilePlan(path, head, offsets, at))
    w.fout = None
    return plans


def write_at(fd: int, data: np.ndarray, offset: int) -> None:
    """All of `data`'s bytes at `offset` (pwrite, repeated after a short write)."""
    view = np.ascontiguousarray(data).data.cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def abandon_writer(writer: GGUFWriter) -> None:
    """Close the files of a writer whose output is given up (after a failed write): the bytes it still buffers are
    dropped, where flushing them would fail again (a full disk) when the file object is collected, and print."""
    for f in writer.fout or []:
        with contextlib.suppress(OSError):
            f.close()
    writer.fout = None


def n_rows(t: Tensor) -> int:
    return int(np.prod([int(x) for x in t.shape[1:]], dtype=np.int64)) if len(t.shape) > 1 else 1


def tensor_f32(t: Tensor) -> np.ndarray:
    """The tensor as float32 in numpy order ([..., n_out, n_in]); other types are converted by ggml."""
    return tensor_rows(t, 0, n_rows(t)).reshape(tuple(int(x) for x in reversed(t.shape)))


def tensor_rows(t: Tensor, first: int, count: int) -> np.ndarray:
    """Rows [first, first+count) of the tensor's 2-D view ([rows, n_per_row]) as float32, reading only those."""
    from ._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use)

    qt = GGMLQuantizationType(int(t.tensor_type))
    n_per_row = int(t.shape[0])
    if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        flat = np.asarray(t.data).reshape(-1, n_per_row)
        return np.ascontiguousarray(flat[first: first + count], dtype=np.float32)
    rs = _core.row_size(int(qt), n_per_row)
    flat = np.asarray(t.data).view(np.uint8).reshape(-1, rs)
    rows: np.ndarray = _core.dequantize(np.ascontiguousarray(flat[first: first + count]), int(qt), n_per_row)
    return rows  # float32 [count, n_per_row] (_core.pyi; the build's stub is outside mypy's view)
