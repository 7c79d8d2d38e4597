"""Pairing a RESplit sidecar with its base at load: the pair id (source table and sampled data), sizes, the
sidecar's header hash, the base's tensor table, sampled fingerprints of both files' tensor data; the full hashes on
request (`inspect --verify`); sidecars from before the fingerprints and before the layout hash."""
from __future__ import annotations

import hashlib
import importlib
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from typer.testing import CliRunner

from rapidmoe import Llama
from rapidmoe.cli.app import app
from rapidmoe.errors import ModelFileError
from rapidmoe.ggufio import GGUFFile, copy_metadata
from rapidmoe.resplit import check_pair, convert, get_preset, sidecar
from rapidmoe.resplit.fingerprint import SampleScheme, absolute_windows
from rapidmoe.resplit.sidecar import FINGERPRINT_KEYS, KEY, SIDECAR_ARCH, file_sha256, layout_sha256
from rapidmoe.synthetic import spec_for, write_model

runner = CliRunner()
convert_mod = importlib.import_module("rapidmoe.resplit.convert")  # the module (the package exports the function)
Pair = tuple[Path, Path]


@pytest.fixture()
def pair(make_split, tmp_path: Path) -> Pair:  # type: ignore[no-untyped-def]
    """A private copy of the tiny qwen3moe pair (seed 0; the tests modify it)."""
    _, wq, wr = make_split("qwen3moe")
    return Path(shutil.copy(wq, tmp_path / wq.name)), Path(shutil.copy(wr, tmp_path / wr.name))


@pytest.fixture(scope="module")
def seed7(model_dir: Path, vocab_dir: Path) -> Path:
    """The tiny qwen3moe of another seed: the same architecture, size and tensor table, other weights."""
    path = model_dir / "tiny-qwen3moe-seed7.gguf"
    if not path.exists():
        write_model(spec_for("qwen3moe", "tiny", seed=7, dtype="f16"), path, vocab_dir)
    return path


def _flip(path: Path, at: int) -> None:
    with path.open("r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def _cut(path: Path, n: int) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - n)


def _covered(path: Path, scheme: SampleScheme) -> np.ndarray:
    """A mask of the file's bytes that the sampled check reads (the windows the scheme puts in its tensors)."""
    mask = np.zeros(path.stat().st_size, dtype=bool)
    for ws in absolute_windows(GGUFFile(path), scheme):
        for off, n in ws:
            mask[off: off + n] = True
    return mask


def test_sidecar_records_its_fingerprints(pair: Pair) -> None:
    """What the conversion records, recomputed independently here (hashlib over the raw bytes): the base's full and
    layout hashes; the tiny sidecar's data fit in the sampling budget, so each tensor's digest is of all its bytes;
    the data hash; the header hash over the size and the header bytes with its own value zeroed."""
    wq, wr = pair
    meta = check_pair(wq, wr)
    assert meta["base_sha256"] == hashlib.sha256(wq.read_bytes()).hexdigest()
    base = GGUFFile(wq)
    h = hashlib.sha256(f"size {wq.stat().st_size}\n".encode())
    for t in base.tensors:
        h.update(f"{t.name}\t{int(t.tensor_type)}\t{','.join(str(int(x)) for x in t.shape)}\t{t.data_offset}\n"
                 .encode())
    assert meta["base_layout_sha256"] == h.hexdigest() == layout_sha256(wq)
    raw = wr.read_bytes()
    side = GGUFFile(wr)
    assert meta["data_samples"] == "".join(
        hashlib.sha256(raw[t.data_offset: t.data_offset + t.n_bytes]).hexdigest()[:16] for t in side.tensors)
    assert len(meta["base_samples"]) == 16 * len(base.tensors)
    assert meta["data_sha256"] == hashlib.sha256(raw[side.data_start:]).hexdigest()
    head = bytearray(raw[: side.data_start])
    at = head.find(meta["header_sha256"].encode())
    head[at: at + 64] = b"0" * 64
    assert meta["header_sha256"] == hashlib.sha256(f"size {len(raw)}\n".encode() + bytes(head)).hexdigest()
    assert meta["checked"] == ["sizes", "pair id", "sidecar header", "base size and tensor table",
                               "sampled tensor data of both"]


def test_another_seed_gets_another_pair_id(make_split, seed7: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The issue's case: two models of one layout (other seeds), converted with the same preset. The pair ids
    differ (they cover the source's sampled data), so the cross pair is refused by the header alone, by check_pair
    and by the engine."""
    _, wq_a, wr_a = make_split("qwen3moe")
    b = convert(seed7, tmp_path / "b", get_preset("cpu"), progress=False)
    assert GGUFFile(wq_a).get("rapidmoe.resplit.pair_id") != b.report["pair_id"]
    for wq, wr in ((wq_a, b.wr_path), (b.wq_path, wr_a)):
        with pytest.raises(ModelFileError, match=f"sidecar {wr} does not belong to {wq}: pair id"):
            check_pair(wq, wr)
    with pytest.raises(ModelFileError, match="does not belong"):
        Llama(wq_a, residual_path=b.wr_path, n_ctx=32, verbose=False)
    res = runner.invoke(app, ["run", str(wq_a), "--residual", str(b.wr_path), "-p", "hi", "-n", "1"])
    assert res.exit_code == 1 and f"sidecar {b.wr_path} does not belong to {wq_a}" in res.output, res.output


@pytest.fixture(scope="module")
def same_id_pairs(make_split, seed7: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Pair, Pair]:  # type: ignore[no-untyped-def]
    """Both seeds converted as if the pair id covered the tensor table only (as before the fingerprints): the
    ids are equal, and what refuses the cross pair is the base's sampled data."""
    src_a, _, _ = make_split("qwen3moe")
    out = tmp_path_factory.mktemp("same-id")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(convert_mod, "sample_digests", lambda reader: [])
        a = convert(src_a, out / "a", get_preset("cpu"), progress=False)
        b = convert(seed7, out / "b", get_preset("cpu"), progress=False)
    assert a.report["pair_id"] == b.report["pair_id"] and layout_sha256(a.wq_path) == layout_sha256(b.wq_path)
    return (a.wq_path, a.wr_path), (b.wq_path, b.wr_path)


def test_cross_pair_with_equal_ids_is_refused_by_the_sampled_data(same_id_pairs: tuple[Pair, Pair]) -> None:
    (wq_a, wr_a), (wq_b, wr_b) = same_id_pairs
    check_pair(wq_a, wr_a)
    check_pair(wq_b, wr_b)
    for wq, wr in ((wq_a, wr_b), (wq_b, wr_a)):
        with pytest.raises(ModelFileError, match=f"sidecar {wr} was not made from the data in {wq}: the sampled "
                                                 r"data of .* differ .*another model with the same layout"):
            check_pair(wq, wr)


def _swap_in(dst: Path, src: Path, name: str, start: int = 0, stop: int | None = None) -> tuple[int, int]:
    """Bytes [start, stop) of tensor `name`'s data in dst replaced by src's (same layout); returns the file range."""
    t = GGUFFile(dst).tensor(name)
    stop = t.n_bytes if stop is None else stop
    lo, hi = t.data_offset + start, t.data_offset + stop
    data = bytearray(dst.read_bytes())
    new = src.read_bytes()[lo:hi]
    assert new != bytes(data[lo:hi])
    data[lo:hi] = new
    dst.write_bytes(bytes(data))
    return lo, hi


def test_one_expert_tensor_changed(same_id_pairs: tuple[Pair, Pair], tmp_path: Path) -> None:
    """A base whose one expert tensor holds another model's weights (same pair id, same table). All of the tensor
    replaced: the sampled check names it. Only a stretch that no window reads replaced: the load cannot see it,
    --verify (the full sha256) does. Which stretch that is follows from the recorded scheme."""
    (wq_a, wr_a), (wq_b, _) = same_id_pairs
    name = "blk.1.ffn_up_exps.weight"
    wq = Path(shutil.copy(wq_a, tmp_path / "a.wq.gguf"))
    _swap_in(wq, wq_b, name)
    with pytest.raises(ModelFileError, match=rf"the sampled data of {name} \(1 of \d+ tensors\) differ"):
        check_pair(wq, wr_a)
    wq = Path(shutil.copy(wq_a, tmp_path / "a.wq.gguf"))
    scheme = sidecar.scheme_of(check_pair(wq_a, wr_a))
    t = GGUFFile(wq).tensor(name)
    covered = _covered(wq, scheme)[t.data_offset: t.data_offset + t.n_bytes]
    gaps = np.flatnonzero(~covered)
    assert covered.any() and gaps.size  # this tensor is sampled, not read whole
    start = int(gaps[0])
    stop = start + int(np.argmax(covered[start:]))  # up to the next window
    _swap_in(wq, wq_b, name, start, stop)
    check_pair(wq, wr_a)
    with pytest.raises(ModelFileError, match="sha256 of the base differs"):
        check_pair(wq, wr_a, verify_data=True)


def test_renamed_copy_is_accepted(pair: Pair, tmp_path: Path) -> None:
    wq, wr = pair
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    wq2, wr2 = moved / "my-model.gguf", moved / "residuals-for-it.bin"
    shutil.move(wq, wq2)
    shutil.copy(wr, wr2)
    assert check_pair(wq2, wr2, verify_data=True)["checked"][-1] == \
        "sha256 of every byte of the base and of the sidecar's data"
    llm = Llama(wq2, residual_path=wr2, n_ctx=32, verbose=False)
    assert llm.create_completion("Hi", max_tokens=2, temperature=0.0)["usage"]["completion_tokens"] == 2  # type: ignore[index]
    llm.close()


@pytest.mark.parametrize("which", ["base", "sidecar"])
@pytest.mark.parametrize("n", [1, 100, 5000])
def test_truncated_file_is_refused(pair: Pair, which: str, n: int) -> None:
    """Always, also with verify=False: the tensor table says where each tensor's data ends."""
    wq, wr = pair
    path = wq if which == "base" else wr
    _cut(path, n)
    for verify in (True, False):
        with pytest.raises(ModelFileError, match=rf"{which} {path} is truncated: tensor \S+ ends at byte \d+, the "
                                                 r"file has \d+ .*not used with"):
            check_pair(wq, wr, verify=verify)


def test_cheap_check_reads_a_few_mb(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default check hashes no file whole; it reads the headers and the sampled windows only."""
    wq, wr = pair

    def no_full_hash(path: Path, start: int = 0) -> str:
        raise AssertionError(f"the default check hashed all of {path}")

    read: list[int] = []
    pread = os.pread  # the os module fingerprint reads with

    def counting(fd: int, n: int, off: int) -> bytes:
        read.append(n)
        return pread(fd, n, off)

    monkeypatch.setattr(sidecar, "file_sha256", no_full_hash)
    monkeypatch.setattr(os, "pread", counting)
    check_pair(wq, wr)
    n_tensors = len(GGUFFile(wq).tensors) + len(GGUFFile(wr).tensors)
    scheme = SampleScheme()
    assert sum(read) <= 2 * scheme.budget + scheme.min_windows * scheme.window * n_tensors
    assert sum(read) < wq.stat().st_size / 3  # the base (17 MB) is sampled, not read


# -- the damage sweep -------------------------------------------------------------------------------------------
DamageKind = Callable[[bytearray, int], bytes]
KINDS: dict[str, DamageKind] = {
    "flip": lambda b, at: bytes(b[:at]) + bytes([b[at] ^ 0xFF]) + bytes(b[at + 1:]),
    "zero": lambda b, at: bytes(b[:at]) + bytes(min(16, len(b) - at)) + bytes(b[at + 16:]),
    "cut": lambda b, at: bytes(b[:at]),
}


def _offsets(wr: Path, n: int) -> list[int]:
    """n spread offsets (deterministic): a third in the header, the rest in the tensor data."""
    side = GGUFFile(wr)
    rng = np.random.default_rng(25)
    head = rng.integers(0, side.data_start, n // 3)
    data = rng.integers(side.data_start, wr.stat().st_size, n - n // 3)
    return sorted(int(x) for x in np.concatenate([head, data]))


def _damaged(wr: Path, dst: Path, n: int) -> Iterator[tuple[str, int]]:
    raw = bytearray(wr.read_bytes())
    for at in _offsets(wr, n):
        for kind, damage in KINDS.items():
            new = damage(raw, at)
            if new == bytes(raw):  # zeroing bytes that are zeros already: no damage
                continue
            dst.write_bytes(new)
            yield kind, at


def _refusal(wq: Path | GGUFFile, wr: Path, **kw: bool) -> str | None:
    try:
        check_pair(wq, wr, **kw)
    except ModelFileError as e:
        return str(e)
    return None


def test_damage_sweep_is_refused_at_load(pair: Pair, tmp_path: Path) -> None:
    """300 damaged copies of the tiny sidecar (a byte flipped, 16 bytes zeroed, or the file cut, at 100 spread
    offsets): every one is refused by the load's check with a message naming the sidecar (its data fit in the
    sampling budget, so the samples are all of it, and its header and size are hashed)."""
    wq, wr = pair
    base = GGUFFile(wq)  # parsed once (its header holds the vocabulary)
    bad = tmp_path / "bad.wr.gguf"
    n = 0
    for kind, at in _damaged(wr, bad, 100):
        n += 1
        why = _refusal(base, bad)
        assert why is not None, f"{kind} at {at} loaded"
        assert str(bad) in why and ("damaged" in why or "truncated" in why or "not a readable GGUF" in why), why
    assert n >= 290


def test_damage_sweep_with_sparse_samples(make_split, tmp_path: Path,  # type: ignore[no-untyped-def]
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The same sweep on a sidecar converted with a sampling budget far below its size (as a big model's is):
    each damaged copy is refused at load, or its damage lies wholly in bytes no window reads (tensor data between
    windows) and --verify (the sidecar data's sha256) refuses it."""
    src, _, _ = make_split("qwen3moe")
    scheme = SampleScheme(window=256, budget=64 << 10)
    monkeypatch.setattr(sidecar, "DEFAULT_SCHEME", scheme)
    res = convert(src, tmp_path / "sparse", get_preset("cpu"), progress=False)
    wq, wr = res.wq_path, res.wr_path
    assert sidecar.scheme_of(check_pair(wq, wr)) == scheme
    covered = _covered(wr, scheme)
    data_start = GGUFFile(wr).data_start
    bad = tmp_path / "bad.wr.gguf"
    at_load = by_verify = 0
    base = GGUFFile(wq)
    for kind, at in _damaged(wr, bad, 100):
        if _refusal(base, bad) is not None:
            at_load += 1
            continue
        changed = slice(at, at + (16 if kind == "zero" else 1))
        assert kind != "cut" and at >= data_start and not covered[changed].any(), f"{kind} at {at} loaded"
        why = _refusal(base, bad, verify_data=True)
        assert why is not None and "sha256 of its tensor data differs" in why, f"{kind} at {at}: {why}"
        by_verify += 1
    assert at_load + by_verify >= 290 and at_load > 100 and by_verify > 20, (at_load, by_verify)


# -- older sidecars ---------------------------------------------------------------------------------------------
def _older_copy(wr: Path, dst: Path, *, layout: bool) -> Path:
    """The sidecar as an older version wrote it: the same tensors and metadata, without the fingerprints (and,
    layout=False, without the layout hash)."""
    side = GGUFFile(wr)
    w = GGUFWriter(dst, arch=SIDECAR_ARCH)
    skip = tuple(KEY + k for k in FINGERPRINT_KEYS) + (() if layout else (KEY + "base_layout_sha256",))
    copy_metadata(side, w, skip_prefixes=skip)
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


@pytest.mark.parametrize("layout", [True, False], ids=["with-layout-hash", "before-layout-hash"])
def test_older_sidecar_still_loads(pair: Pair, tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                   layout: bool) -> None:
    """Older sidecars load with a warning to re-convert, checked as their version was: by the layout hash, or by
    the full hash where there is none; refused when the base's table or data changed."""
    wq, wr = pair
    old = _older_copy(wr, tmp_path / "old.wr.gguf", layout=layout)
    assert {t.name: (t.tensor_type, [int(x) for x in t.shape]) for t in GGUFFile(old).tensors} == \
        {t.name: (t.tensor_type, [int(x) for x in t.shape]) for t in GGUFFile(wr).tensors}
    with caplog.at_level(logging.WARNING, logger="rapidmoe.resplit.sidecar"):
        meta = check_pair(wq, old)
    assert "no fingerprint of the tensor data" in caplog.text and "re-convert" in caplog.text
    assert ("base_layout_sha256" in meta) == layout and meta["base_sha256"] == file_sha256(wq)
    llm = Llama(wq, residual_path=old, n_ctx=32, verbose=False)  # and the engine takes it
    llm.close()
    _flip(wq, wq.stat().st_size - 1)
    if layout:
        check_pair(wq, old)  # the layout hash reads no data
    else:
        with pytest.raises(ModelFileError, match="sha256 of the base differs"):
            check_pair(wq, old)
    with pytest.raises(ModelFileError, match="sha256 of the base differs"):
        check_pair(wq, old, verify_data=True)
    check_pair(wq, old, verify=False)  # asked not to check: sizes and pair id only
    _cut(old, 10)
    with pytest.raises(ModelFileError, match="truncated"):
        check_pair(wq, old, verify=False)


def test_cheap_check_refuses_a_changed_table_and_size(pair: Pair) -> None:
    wq, wr = pair
    with wq.open("ab") as f:  # one byte more: same header, other size
        f.write(b"\0")
    with pytest.raises(ModelFileError, match="size or tensor table differs"):
        check_pair(wq, wr)
    data = bytearray(wq.read_bytes()[:-1])  # a tensor renamed in place (same length): the table differs
    name = GGUFFile(wq).tensors[-1].name.encode()
    data[data.find(name)] ^= 0x01
    wq.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="size or tensor table differs"):
        check_pair(wq, wr)


def test_inspect_verify(pair: Pair) -> None:
    wq, wr = pair
    res = runner.invoke(app, ["inspect", str(wq), "--residual", str(wr)])
    assert res.exit_code == 0, res.output
    assert "checked: sizes, pair id, sidecar header, base size and tensor table, sampled tensor data of both)" \
        in res.output
    res = runner.invoke(app, ["inspect", str(wr)])
    assert res.exit_code == 0 and "base_samples: 27 tensors, 16 hex digits each" in res.output, res.output
    res = runner.invoke(app, ["inspect", str(wq), "--residual", str(wr), "--verify"])
    assert res.exit_code == 0, res.output
    assert "sampled tensor data of both, sha256 of every byte of the base and of the sidecar's data)" in res.output
    # a byte between two windows of the base: the load does not read it, --verify does
    scheme = sidecar.scheme_of(check_pair(wq, wr))
    _flip(wq, int(np.flatnonzero(~_covered(wq, scheme)[GGUFFile(wq).data_start:])[0]) + GGUFFile(wq).data_start)
    assert runner.invoke(app, ["inspect", str(wq), "--residual", str(wr)]).exit_code == 0
    res = runner.invoke(app, ["inspect", str(wq), "--residual", str(wr), "--verify"])
    assert res.exit_code == 1 and "sha256 of the base differs" in res.output, res.output
    res = runner.invoke(app, ["inspect", str(wq), "--verify"])
    assert res.exit_code != 0 and "--residual" in res.output
