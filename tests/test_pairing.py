"""Pairing a RESplit sidecar with its base at load: the pair id and a hash of the base's size and tensor table
(header only), the full data hash on request (`inspect --verify`), and sidecars from before the layout hash."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from typer.testing import CliRunner

from rapidmoe.cli.app import app
from rapidmoe.errors import ModelFileError
from rapidmoe.ggufio import GGUFFile, copy_metadata
from rapidmoe.resplit import check_pair
from rapidmoe.resplit.sidecar import KEY, SIDECAR_ARCH, file_sha256, layout_sha256

runner = CliRunner()


@pytest.fixture()
def pair(make_split, tmp_path: Path) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    """A private copy of the tiny qwen3moe pair (the tests modify it)."""
    _, wq, wr = make_split("qwen3moe")
    return Path(shutil.copy(wq, tmp_path / wq.name)), Path(shutil.copy(wr, tmp_path / wr.name))


def _flip_last_byte(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 0xFF]))


def test_sidecar_records_both_hashes(pair: tuple[Path, Path]) -> None:
    """The recorded hashes are the base's: the full sha256 of its bytes (hashlib, independently here) and the
    layout hash, which is the size plus the tensor table read back from the header."""
    wq, wr = pair
    meta = check_pair(wq, wr)
    import hashlib

    assert meta["base_sha256"] == hashlib.sha256(wq.read_bytes()).hexdigest()
    base = GGUFFile(wq)
    h = hashlib.sha256(f"size {wq.stat().st_size}\n".encode())
    for t in base.tensors:
        h.update(f"{t.name}\t{int(t.tensor_type)}\t{','.join(str(int(x)) for x in t.shape)}\t{t.data_offset}\n"
                 .encode())
    assert meta["base_layout_sha256"] == h.hexdigest() == layout_sha256(wq)


def test_cheap_check_refuses_a_changed_table_and_size(pair: tuple[Path, Path], tmp_path: Path) -> None:
    wq, wr = pair
    check_pair(wq, wr)
    with wq.open("ab") as f:  # one byte more: same header, other size
        f.write(b"\0")
    with pytest.raises(ModelFileError, match="size or tensor table differs"):
        check_pair(wq, wr)
    # a different base of the same model (another preset of the same source) has another pair id already; a file
    # with the right pair id but another table (a tensor renamed in place, same length) is refused by the table
    data = bytearray(wq.read_bytes()[:-1])
    name = GGUFFile(wq).tensors[-1].name.encode()
    at = data.find(name)
    data[at] ^= 0x01
    wq.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="size or tensor table differs"):
        check_pair(wq, wr)


def test_data_change_needs_verify_data(pair: tuple[Path, Path]) -> None:
    """A byte of tensor data changed in place: the header-only check cannot see it (by design: it reads no
    data), the full check can."""
    wq, wr = pair
    _flip_last_byte(wq)
    check_pair(wq, wr)
    with pytest.raises(ModelFileError, match="sha256 differs"):
        check_pair(wq, wr, verify_data=True)


def test_cheap_check_reads_no_tensor_data(pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    wq, wr = pair
    import rapidmoe.resplit.sidecar as sc

    def no_full_hash(path: Path) -> str:
        raise AssertionError(f"the default check hashed all of {path}")

    monkeypatch.setattr(sc, "file_sha256", no_full_hash)
    check_pair(wq, wr)


def _legacy_copy(wr: Path, dst: Path) -> Path:
    """The sidecar as a version without the layout hash wrote it: the same tensors and metadata, minus that key."""
    side = GGUFFile(wr)
    w = GGUFWriter(dst, arch=SIDECAR_ARCH)
    copy_metadata(side, w, skip_prefixes=(KEY + "base_layout_sha256",))
    mm = side.memmap()
    for t in side.tensors:
        raw = np.asarray(mm[t.data_offset: t.data_offset + t.n_bytes])
        rows = int(np.prod([int(x) for x in t.shape[1:]]))
        w.add_tensor(t.name, raw.reshape(rows, -1).reshape(*[int(x) for x in reversed(t.shape[1:])], -1),
                     raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_sidecar_without_layout_hash_still_loads(pair: tuple[Path, Path], tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Older sidecars load, checked by the full hash as before (with a warning saying to re-convert for the cheap
    check), and are refused when the base's data changed."""
    wq, wr = pair
    old = _legacy_copy(wr, tmp_path / "old.wr.gguf")
    meta = check_pair(wq, old)
    assert "base_layout_sha256" not in meta and meta["base_sha256"] == file_sha256(wq)
    assert {t.name: (t.tensor_type, [int(x) for x in t.shape]) for t in GGUFFile(old).tensors} == \
        {t.name: (t.tensor_type, [int(x) for x in t.shape]) for t in GGUFFile(wr).tensors}
    with caplog.at_level(logging.WARNING, logger="rapidmoe.resplit.sidecar"):
        check_pair(wq, old)
    assert "re-convert" in caplog.text
    from rapidmoe import Llama

    llm = Llama(wq, residual_path=old, n_ctx=32, verbose=False)  # and the engine takes it
    llm.close()
    _flip_last_byte(wq)
    with pytest.raises(ModelFileError, match="sha256 differs"):
        check_pair(wq, old)
    check_pair(wq, old, verify=False)  # asked not to check: pair id only


def test_inspect_verify(pair: tuple[Path, Path]) -> None:
    wq, wr = pair
    res = runner.invoke(app, ["inspect", str(wq), "--residual", str(wr)])
    assert res.exit_code == 0, res.output
    assert "checked: pair id, tensor table and size)" in res.output
    res = runner.invoke(app, ["inspect", str(wq), "--residual", str(wr), "--verify"])
    assert res.exit_code == 0, res.output
    assert "tensor table and size, sha256 of every byte" in res.output
    _flip_last_byte(wq)
    assert runner.invoke(app, ["inspect", str(wq), "--residual", str(wr)]).exit_code == 0
    res = runner.invoke(app, ["inspect", str(wq), "--residual", str(wr), "--verify"])
    assert res.exit_code == 1 and "sha256 differs" in res.output, res.output
    res = runner.invoke(app, ["inspect", str(wq), "--verify"])
    assert res.exit_code != 0 and "--residual" in res.output
