"""A GGUF file copied with some of it changed, for the tests that feed a loader a file it must refuse or read
differently: keys dropped or set, tensors dropped, tensor data copied as stored (gguf-py's writer)."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from rapidmoe.ggufio import GGUFFile, copy_metadata


def rewrite(src: Path, out: Path, *, drop_keys: tuple[str, ...] = (), drop_tensors: tuple[str, ...] = (),
            strings: Mapping[str, str] | None = None) -> Path:
    """A copy of `src` at `out` without the keys starting with one of `drop_keys` or the tensors named in
    `drop_tensors`, with the string keys of `strings` added; returns `out`."""
    r = GGUFFile(src)
    w = GGUFWriter(out, arch=str(r.get("general.architecture")))
    copy_metadata(r, w, skip_prefixes=drop_keys)
    for key, value in (strings or {}).items():
        w.add_string(key, value)
    for t in r.tensors:
        if t.name not in drop_tensors:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
