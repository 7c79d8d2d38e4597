"""Where each field of a GGUF header lies (byte offsets of every count, type, length and value), for mutators that
edit a file by its structure; and `Edit`, the one form every mutation takes (replace a byte range), so a mutant is
its base file plus a short list of edits, small enough to keep as a regression input.

Reads a well-formed GGUF only (the base files); rapidmoe.ggufio is the reader that must cope with damaged ones.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

# GGUF value types (gguf.h): id -> (struct format, size); 8 = string, 9 = array
SCALARS: dict[int, tuple[str, int]] = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4),
                                       5: ("<i", 4), 6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8),
                                       12: ("<d", 8)}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class Edit:
    """Replace data[offset: offset + remove] by insert."""

    offset: int
    remove: int
    insert: bytes

    def to_json(self) -> list[object]:
        return [self.offset, self.remove, self.insert.hex()]

    @staticmethod
    def from_json(v: list[object]) -> Edit:
        off, rem, ins = v
        assert isinstance(off, int) and isinstance(rem, int) and isinstance(ins, str)
        return Edit(off, rem, bytes.fromhex(ins))


def apply_edits(data: bytes, edits: list[Edit]) -> bytes:
    """The edits applied to data; they are applied from the highest offset down, so each offset refers to the
    original bytes (edits that overlap: the later-starting one first, then the other over its result)."""
    out = bytearray(data)
    for e in sorted(edits, key=lambda e: e.offset, reverse=True):
        off = min(e.offset, len(out))
        out[off: off + e.remove] = e.insert
    return bytes(out)


def write_mutant(path: str | os.PathLike[str], data: bytes, edits: list[Edit]) -> int:
    """Write apply_edits(data, edits) to path without copying the untouched tail; returns the size written."""
    head = max((e.offset + e.remove for e in edits), default=0)
    head = min(max(head, max((e.offset for e in edits), default=0)), len(data))
    with open(path, "wb") as f:
        n = f.write(apply_edits(data[:head], edits))
        n += f.write(memoryview(data)[head:])
    return n


@dataclass
class StrSpan:
    """A GGUF string: its u64 length field at `off`, its bytes after it."""

    off: int
    text: bytes

    @property
    def end(self) -> int:
        return self.off + 8 + len(self.text)


@dataclass
class KV:
    key: StrSpan
    type_off: int  # u32 value type
    vtype: int
    value_off: int  # scalar bytes, string length field, or (array) the u32 element type
    end: int  # first byte after the value
    sub_type: int = -1  # arrays: element type
    count_off: int = -1  # arrays: u64 element count
    count: int = 0
    items: list[StrSpan] = field(default_factory=list)  # string arrays: every element
    items_off: int = -1  # arrays: first element


@dataclass
class TensorInfo:
    name: StrSpan
    ndims_off: int
    dims: list[int]
    dim_offs: list[int]
    type_off: int
    ggml_type: int
    offset_off: int
    offset: int  # relative to the data section
    end: int


@dataclass
class Layout:
    size: int
    version: int
    n_tensors_off: int
    n_kv_off: int
    kvs: list[KV]
    tensors: list[TensorInfo]
    header_end: int  # end of the tensor table
    data_start: int  # aligned

    def kv(self, key: str) -> KV | None:
        for kv in self.kvs:
            if kv.key.text == key.encode():
                return kv
        return None

    @property
    def alignment(self) -> int:
        return 32 if self.data_start == self.header_end else max(32, self.data_start - self.header_end)


def parse(data: bytes) -> Layout:
    """The layout of a well-formed GGUF (struct.error or ValueError on anything else)."""
    pos = 0

    def u(fmt: str) -> int:
        nonlocal pos
        (v,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return int(v)

    def string() -> StrSpan:
        nonlocal pos
        off = pos
        n = u("<Q")
        s = StrSpan(off, data[pos: pos + n])
        pos += n
        return s

    if data[:4] != b"GGUF":
        raise ValueError("not a GGUF")
    pos = 4
    version = u("<I")
    n_tensors_off = pos
    n_tensors = u("<Q")
    n_kv_off = pos
    n_kv = u("<Q")
    kvs = []
    align = 32
    for _ in range(n_kv):
        key = string()
        type_off = pos
        vt = u("<I")
        value_off = pos
        kv = KV(key, type_off, vt, value_off, 0)
        if vt == STRING:
            string()
        elif vt == ARRAY:
            kv.sub_type = u("<I")
            kv.count_off = pos
            kv.count = u("<Q")
            kv.items_off = pos
            if kv.sub_type == STRING:
                kv.items = [string() for _ in range(kv.count)]
            else:
                pos += kv.count * SCALARS[kv.sub_type][1]
        else:
            if key.text == b"general.alignment":
                (align,) = struct.unpack_from(SCALARS[vt][0], data, pos)
            pos += SCALARS[vt][1]
        kv.end = pos
        kvs.append(kv)
    tensors = []
    for _ in range(n_tensors):
        name = string()
        ndims_off = pos
        nd = u("<I")
        dim_offs = [pos + 8 * i for i in range(nd)]
        dims = [u("<Q") for _ in range(nd)]
        type_off = pos
        gt = u("<I")
        offset_off = pos
        off = u("<Q")
        tensors.append(TensorInfo(name, ndims_off, dims, dim_offs, type_off, gt, offset_off, off, pos))
    header_end = pos
    data_start = header_end + (-header_end) % int(align)
    return Layout(len(data), version, n_tensors_off, n_kv_off, kvs, tensors, header_end, data_start)


def encode_string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def encode_kv(key: bytes, vtype: int, value: bytes) -> bytes:
    """A KV pair's bytes; `value` already encoded for its type."""
    return encode_string(key) + struct.pack("<I", vtype) + value
