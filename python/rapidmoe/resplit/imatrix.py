"""Importance matrices for quantization: llama.cpp's imatrix files, read (GGUF or legacy .dat) and written (GGUF).

Collecting one runs the model, so it lives a layer up: rapidmoe.calibration.imatrix.collect_imatrix.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from ..atomic import outputs
from ..errors import ModelFileError
from ..ggufio import GGUFFile, GGUFFormatError, abandon_writer


@dataclass
class Imatrix:
    """Per weight name: summed squared activations [n_mat, n_in] and how many rows were summed [n_mat]."""

    in_sum2: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0

    def weights_for(self, name: str, n_mat: int, n_in: int) -> np.ndarray | None:
        """Mean squared activation [n_mat, n_in] for the weight `name` (experts never routed to get the
        mean of the others), or None if the matrix has no entry."""
        s = self.in_sum2.get(name)
        if s is None:
            return None
        c = self.counts[name].astype(np.float64)
        if s.shape != (n_mat, n_in) and not (s.shape[0] == 1 and s.shape[1] == n_in):
            raise ModelFileError(f"imatrix entry {name} has shape {s.shape}, the weight needs ({n_mat}, {n_in})")
        s = np.broadcast_to(s, (n_mat, n_in)).astype(np.float64)
        c = np.broadcast_to(c, (n_mat,))
        out = np.zeros((n_mat, n_in), dtype=np.float64)
        seen = c > 0
        out[seen] = s[seen] / c[seen, None]
        if not seen.all():
            fill = out[seen].mean(axis=0) if seen.any() else np.ones(n_in)
            out[~seen] = fill
        return np.ascontiguousarray(np.maximum(out, 1e-12), dtype=np.float32)


def read_imatrix(path: str | os.PathLike[str]) -> Imatrix:
    """Read llama.cpp's imatrix: the GGUF format (`.in_sum2`/`.counts` tensors) or the legacy .dat format."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"imatrix file not found: {p}")
    try:
        with p.open("rb") as f:
            magic = f.read(4)
        return _read_gguf(p) if magic == b"GGUF" else _read_legacy(p)
    except OSError as e:  # unreadable (permissions, an I/O error): the user's to fix
        raise ModelFileError(f"cannot read the imatrix {p}: {e.strerror or e}") from e


def _read_gguf(p: Path) -> Imatrix:
    try:
        r = GGUFFile(p)
    except GGUFFormatError as e:
        raise ModelFileError(f"{p} is a damaged imatrix GGUF ({e})") from None
    missing = r.missing_data()
    if missing is not None:
        raise ModelFileError(f"{p} is a truncated imatrix: tensor {missing[0].name} runs past the end of the file")
    im = Imatrix()
    if r.get("general.type", "imatrix") != "imatrix":
        raise ModelFileError(f"{p} is a GGUF but not an imatrix (general.type={r.get('general.type')})")
    for t in r.tensors:
        if t.tensor_type != GGMLQuantizationType.F32 or not t.shape or min(t.shape) < 1:
            raise ModelFileError(f"{p}: imatrix tensor {t.name} is {t.tensor_type.name} {list(t.shape)}; llama.cpp "
                                 "writes non-empty F32 tensors")
        arr = np.array(t.data, dtype=np.float32)
        if t.name.endswith(".in_sum2"):
            im.in_sum2[t.name[: -len(".in_sum2")]] = arr.reshape(-1, int(t.shape[0]))
        elif t.name.endswith(".counts"):
            im.counts[t.name[: -len(".counts")]] = arr.reshape(-1)
    if set(im.in_sum2) != set(im.counts):
        raise ModelFileError(f"{p}: imatrix tensors without matching counts")
    for name, s in im.in_sum2.items():
        if im.counts[name].size != s.shape[0]:
            raise ModelFileError(f"{p}: imatrix entry {name} has {s.shape[0]} matrices but {im.counts[name].size} "
                                 "counts")
    try:
        im.datasets = [str(d) for d in r.get("imatrix.datasets", [])]
        im.chunk_count = int(r.get("imatrix.chunk_count", 0))
        im.chunk_size = int(r.get("imatrix.chunk_size", 0))
    except (TypeError, ValueError, OverflowError) as e:
        raise ModelFileError(f"{p}: bad imatrix metadata ({e})") from None
    return im


def _read_legacy(p: Path) -> Imatrix:
    """Legacy llama-imatrix .dat: n; n x (len, name, ncall, nval, float[nval]) -- values already averaged."""
    im = Imatrix()
    data = p.read_bytes()
    try:
        (n,) = struct.unpack_from("<i", data, 0)
        off = 4
        if n < 0:
            raise ValueError(f"{n} entries")
        for _ in range(n):
            (ln,) = struct.unpack_from("<i", data, off)
            if ln < 0 or off + 4 + ln > len(data):
                raise ValueError(f"a name of {ln} bytes at offset {off}")
            name = data[off + 4: off + 4 + ln].decode()
            off += 4 + ln
            ncall, nval = struct.unpack_from("<ii", data, off)
            off += 8
            if nval < 1:  # np.frombuffer reads everything left for a negative count
                raise ValueError(f"entry {name} has {nval} values")
            vals = np.frombuffer(data, dtype=np.float32, count=nval, offset=off).copy()
            off += 4 * nval
            # legacy stores sum/ncall per value for one "matrix"; keep as mean with count 1
            im.in_sum2[name] = vals.reshape(1, -1)
            im.counts[name] = np.ones(1, dtype=np.float32)
            im.chunk_count = max(im.chunk_count, ncall)
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{p} is neither a GGUF imatrix nor a legacy llama.cpp imatrix ({e})") from e
    return im


def write_imatrix(im: Imatrix, path: str | os.PathLike[str]) -> Path:
    """Write llama.cpp's GGUF imatrix layout (complete or absent: atomic.outputs)."""
    p = Path(path)
    with outputs([p]) as (tmp,):
        _write_gguf(im, tmp)
    return p


def _write_gguf(im: Imatrix, tmp: Path) -> None:
    w = GGUFWriter(tmp, arch="imatrix")
    w.add_string("general.type", "imatrix")
    w.add_array("imatrix.datasets", im.datasets or ["unknown"])
    w.add_uint32("imatrix.chunk_count", im.chunk_count)
    w.add_uint32("imatrix.chunk_size", im.chunk_size)
    for name in sorted(im.in_sum2):
        w.add_tensor(f"{name}.in_sum2", np.ascontiguousarray(im.in_sum2[name], dtype=np.float32))
        w.add_tensor(f"{name}.counts", np.ascontiguousarray(im.counts[name].reshape(-1, 1), dtype=np.float32))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    except BaseException:
        abandon_writer(w)
        raise
