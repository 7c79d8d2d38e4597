"""Our fast GGUF header reader against gguf-py's reader: same fields (values and types) and same tensors."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from rapidmoe.ggufio import GGUFFile, GGUFFormatError


def test_same_as_gguf_py(tiny_qwen: Path) -> None:
    ours, ref = GGUFFile(tiny_qwen), GGUFReader(tiny_qwen)
    ref_fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.fields) == set(ref_fields)
    for key, f in ref_fields.items():
        mine = ours.fields[key]
        assert mine.vtype == f.types[0], key
        value = f.contents()
        assert (list(mine.value) if isinstance(value, list) else mine.value) == value, key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.data_offset, a.n_bytes, a.tensor_type) == (int(b.data_offset), int(b.n_bytes), b.tensor_type)
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name


def test_corrupt_header_is_a_format_error(tmp_path: Path, tiny_qwen: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_qwen.read_bytes()[:5000])  # inside the tokenizer arrays
    with pytest.raises(GGUFFormatError, match="end of file"):
        GGUFFile(cut)
