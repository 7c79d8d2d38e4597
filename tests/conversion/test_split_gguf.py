"""Split GGUFs in and out (llama.cpp's gguf-split naming, PREFIX-00001-of-0000N.gguf, and its split.* keys): a
split source converts to the same tensors as the whole file; `convert --split-max-size` writes parts of at most
that much tensor data that our loader, `run`, `serve`, `inspect` and the pair check read as one file, and that
stock llama.cpp loads from the first part with the same logits as the whole .wq.gguf."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from reference.split_logits import all_logits, prompt_tokens, stock_logits
from server_proc import ServerProc
from typer.testing import CliRunner

from rapidmoe import ModelFileError
from rapidmoe.cli.app import app
from rapidmoe.ggufio import GGUFFile, copy_metadata
from rapidmoe.resplit import check_pair, convert, get_preset

pytestmark = pytest.mark.native
runner = CliRunner()


def split_copy(src: Path, out: Path, max_size: int) -> Path:
    """`src` split as llama.cpp's gguf-split splits it (gguf-py's writer, which writes the same names and keys);
    returns the first part."""
    r = GGUFFile(src)
    out.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(out / src.name, arch=str(r.get("general.architecture")), split_max_size=max_size)
    copy_metadata(r, w)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = sorted(out.glob(f"{src.stem}-*-of-*.gguf"))
    assert len(parts) > 2 and parts[0].name.endswith(f"-00001-of-{len(parts):05d}.gguf")
    return parts[0]


def _data(path: Path) -> dict[str, bytes]:
    return {t.name: np.asarray(t.data).tobytes() for t in GGUFFile(path).tensors}


@pytest.mark.parametrize("preset", ["refine-hq", "cpu"])
def test_a_split_source_converts_like_the_whole_file(tiny_qwen: Path, tmp_path: Path, preset: str) -> None:
    first = split_copy(tiny_qwen, tmp_path / "src", 4_000_000)
    whole = convert(tiny_qwen, tmp_path / "whole", get_preset(preset), progress=False)
    split = convert(first, tmp_path / "split", get_preset(preset), progress=False, name=whole.wq_path.name[:-8])
    assert _data(split.wq_path) == _data(whole.wq_path) and _data(split.wr_path) == _data(whole.wr_path)
    assert GGUFFile(split.wq_path).get("split.count") is None  # the source's parts are not the output's
    with pytest.raises(ModelFileError, match="give its first part"):
        convert(first.with_name(first.name.replace("-00001-", "-00002-")), tmp_path / "x", get_preset(preset))


@pytest.fixture(scope="module")
def pairs(make_tiny, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(whole pair, split pair) of the tiny qwen3moe per preset, the split one through the CLI."""
    src = make_tiny("qwen3moe")
    work = tmp_path_factory.mktemp("split-out")
    made = {}
    for preset in ("refine-hq", "cpu"):
        whole = convert(src, work / f"{preset}-whole", get_preset(preset), progress=False)
        res = runner.invoke(app, ["convert", str(src), "-o", str(work / f"{preset}-split"), "--preset", preset,
                                  "--split-max-size", "100000"])
        assert res.exit_code == 0, res.output
        parts = sorted((work / f"{preset}-split").glob("*.gguf"))
        wq = [p for p in parts if ".wq-" in p.name]
        wr = [p for p in parts if ".wr-" in p.name]
        assert len(wq) > 2 and len(wr) >= 2, [p.name for p in parts]
        made[preset] = ((whole.wq_path, whole.wr_path), (wq, wr))
    return made


@pytest.mark.parametrize("preset", ["refine-hq", "cpu"])
def test_split_outputs_are_gguf_split_parts_of_the_same_tensors(pairs, preset: str) -> None:  # type: ignore[no-untyped-def]
    (wq, wr), (wq_parts, wr_parts) = pairs[preset]
    for whole, parts in ((wq, wq_parts), (wr, wr_parts)):
        n = len(parts)
        assert [p.name[-20:] for p in parts] == [f"-{i + 1:05d}-of-{n:05d}.gguf" for i in range(n)]
        for i, p in enumerate(parts):
            f = GGUFFile(p, single=True)
            assert (f.get("split.no"), f.get("split.count")) == (i, n)
            assert len(f.tensors) == 1 or sum(int(t.n_bytes) for t in f.tensors) <= 100000
        assert _data(parts[0]) == _data(whole)
    meta = check_pair(wq_parts[0], wr_parts[0], verify_data=True)
    assert "sha256 of every byte of the base and of the sidecar's data" in meta["checked"]
    res = runner.invoke(app, ["inspect", str(wq_parts[0]), "--residual", str(wr_parts[0])])
    assert res.exit_code == 0 and f"in {len(wq_parts)} parts" in res.output and "belongs to this base" in res.output


def test_a_damaged_or_missing_part_is_refused(pairs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (_, _), (wq_parts, wr_parts) = pairs["refine-hq"]
    copies = []
    for p in [*wq_parts, *wr_parts]:
        q = tmp_path / p.name
        q.write_bytes(p.read_bytes())
        copies.append(q)
    wq, wr = copies[0], copies[len(wq_parts)]
    last_wr = copies[-1]
    raw = bytearray(last_wr.read_bytes())
    raw[-100] ^= 0xFF  # a flipped bit in the last part's data: the full check sees it
    last_wr.write_bytes(bytes(raw))
    with pytest.raises(ModelFileError, match="damaged"):
        check_pair(wq, wr, verify_data=True)
    last_wr.write_bytes(bytes(raw[:-4096]))  # truncated
    with pytest.raises(ModelFileError, match="truncated"):
        check_pair(wq, wr)
    last_wr.unlink()
    with pytest.raises(ModelFileError, match="not found"):
        check_pair(wq, wr)


@pytest.mark.parametrize("preset", ["refine-hq", "cpu"])
def test_split_pair_runs_as_the_whole_pair(pairs, preset: str) -> None:  # type: ignore[no-untyped-def]
    (wq, wr), (wq_parts, wr_parts) = pairs[preset]
    toks = prompt_tokens(wq)
    whole = all_logits(wq, toks, residual_path=str(wr), n_critical=1)
    split = all_logits(wq_parts[0], toks, residual_path=str(wr_parts[0]), n_critical=1)
    np.testing.assert_array_equal(split, whole)


@pytest.mark.stock
def test_stock_llama_cpp_loads_the_split_wq(pairs, stock_bin: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (wq, _), (wq_parts, _) = pairs["cpu"]
    toks = prompt_tokens(wq)
    np.testing.assert_array_equal(stock_logits(wq_parts[0], toks, stock_bin, tmp_path),
                                  stock_logits(wq, toks, stock_bin, tmp_path))


def test_run_and_serve_take_the_first_parts(pairs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    (_, _), (wq_parts, wr_parts) = pairs["refine-hq"]
    res = runner.invoke(app, ["run", str(wq_parts[0]), "--residual", str(wr_parts[0]), "-r", "1", "-p", "Once",
                              "-n", "4", "--temp", "0"])
    assert res.exit_code == 0, res.output
    s = ServerProc(wq_parts[0], "--residual", str(wr_parts[0]), "-c", "256", "-np", "1",
                   log_path=tmp_path / "serve.log")
    try:
        status, body = s.request("POST", "/completion", {"prompt": "Once", "n_predict": 4, "temperature": 0})
        assert status == 200 and isinstance(body["content"], str), body
    finally:
        s.stop()
