"""Parallel, resumable conversion (resplit/parallel.py, the compiled encoder core/encode.cpp): its outputs are the
one-thread numpy reference's byte for byte whatever the thread count and the cut into items; an interrupted
conversion keeps only its partial files, and --resume finishes it to the same bytes, redoing the items whose bytes
on disk are not what the journal recorded and refusing a journal of another conversion."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from rapidmoe import RapidMoEError
from rapidmoe.ggufio import GGUFFile, plan_files
from rapidmoe.resplit import check_pair, convert, get_preset
from rapidmoe.resplit import parallel as par
from rapidmoe.resplit.imatrix import Imatrix
from rapidmoe.resplit.refine import encode_refine

pytestmark = pytest.mark.native


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _imatrix(src: Path) -> Imatrix:
    """Per-column importances that differ between experts and columns (so that they matter)."""
    rng = np.random.default_rng(3)
    im = Imatrix(datasets=["random"])
    for t in GGUFFile(src).tensors:
        if "_exps" in t.name:
            im.in_sum2[t.name] = rng.uniform(0.1, 4.0, (int(t.shape[2]), int(t.shape[0]))).astype(np.float32)
            im.counts[t.name] = np.ones(int(t.shape[2]), np.float32)
    return im


CASES = [  # (architecture, preset, its overrides, with an imatrix)
    ("qwen3moe", "refine-hq", {}, False),
    ("deepseek2", "refine-hq", {}, True),
    ("qwen3moe", "cpu", {}, False),  # Q2_K WQ, Q2_K residual; llama-quantize's mixture for the rest
    ("deepseek2", "cpu", {"down_mode": "copy"}, True),  # down's copy, not a residual
    ("qwen3moe", "cpu-q8", {}, True),  # Q8_0 attention and head
]


@pytest.mark.parametrize(("arch", "preset", "over", "with_im"), CASES)
def test_compiled_encoder_writes_the_references_bytes(make_tiny, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      arch: str, preset: str, over: dict[str, str],
                                                      with_im: bool) -> None:
    """The numpy reference (one thread, one expert at a time) against the compiled encoder on 1 and 3 threads with
    small items (one expert, or 128 rows, each): the same .wq.gguf and .wr.gguf bytes, the same error report."""
    src = make_tiny(arch)
    p = get_preset(preset, **over)
    im = _imatrix(src) if with_im else None
    ref = convert(src, tmp_path / f"{arch}-ref", p, imatrix=im, progress=False, encoder="numpy")
    monkeypatch.setattr(par, "ITEM_BYTES", 64 << 10)
    for threads in (1, 3):
        res = convert(src, tmp_path / f"{arch}-t{threads}", p, imatrix=im, progress=False, threads=threads)
        assert _sha(res.wq_path) == _sha(ref.wq_path), (arch, threads)
        assert _sha(res.wr_path) == _sha(ref.wr_path), (arch, threads)
        ours, theirs = res.report["tensors"], ref.report["tensors"]
        assert isinstance(ours, list) and isinstance(theirs, list)
        for a, b in zip(ours, theirs, strict=True):  # float64 sums, other order
            assert a["name"] == b["name"]
            assert a["rel_error"] == pytest.approx(b["rel_error"], rel=1e-9)
        assert res.report["threads"] == threads
        assert not list(res.wq_path.parent.glob("*.partial")) and not list(res.wq_path.parent.glob("*.journal"))


def test_refine_encode_is_numpys_bit_for_bit() -> None:
    """The compiled refine codec on the corner cases of the scale fit (zero rows and sub-blocks, lone weights,
    outliers of either sign, tiny, subnormal and large magnitudes), with and without importances."""
    from rapidmoe._runtime import _core  # noqa: PLC0415 - the compiled part

    rng = np.random.default_rng(11)
    corner = rng.standard_normal((6, 512)).astype(np.float32)
    corner[0] = 0.0
    corner[1, 16:48] = 0.0
    corner[2, :16] = 0.0
    corner[2, 5] = 3.0
    corner[3, 20] = 40.0
    corner[4, 300] = -40.0
    corner[5, 256:] = np.abs(corner[5, 256:])
    mats = [corner, rng.standard_normal((24, 512)).astype(np.float32) * 0.02,
            rng.standard_t(3, (32, 768)).astype(np.float32) * 0.01, rng.standard_normal((4, 256)).astype(np.float32)
            * 1e3, rng.standard_normal((4, 256)).astype(np.float32) * 1e-6,
            rng.standard_normal((4, 256)).astype(np.float32) * 1e-38]
    for w in mats:
        for imp in (None, rng.uniform(0.01, 5.0, w.shape[1]).astype(np.float32)):
            with np.errstate(over="ignore"):  # 4 / s overflows for the subnormal scales (to inf, as in C)
                q, bits = encode_refine(w, imp)
            cq, cbits = _core.refine_encode(w, imp)
            assert np.array_equal(q, cq) and np.array_equal(bits, cbits)


def _interrupt_after(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    real = par.run_item
    calls = {"n": 0}

    def flaky(item, jobs, files):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] > n:
            raise KeyboardInterrupt
        return real(item, jobs, files)

    monkeypatch.setattr(par, "run_item", flaky)


def test_interrupted_conversion_resumes_to_the_same_bytes(tiny_qwen: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    p = get_preset("refine-hq")
    ref = convert(tiny_qwen, tmp_path / "ref", p, progress=False, threads=2)
    out = tmp_path / "out"
    monkeypatch.setattr(par, "ITEM_BYTES", 64 << 10)
    _interrupt_after(monkeypatch, 20)
    with pytest.raises(par.Interrupted, match="--resume continues") as e:
        convert(tiny_qwen, out, p, progress=False, threads=2)
    names = sorted(x.name for x in out.iterdir())
    assert names == ["tiny-qwen3moe-f16.resplit.journal", "tiny-qwen3moe-f16.wq.gguf.partial",
                     "tiny-qwen3moe-f16.wr.gguf.partial"], (names, e.value.message)
    journal = out / "tiny-qwen3moe-f16.resplit.journal"
    head, done = par.read_journal(journal)
    assert head is not None and len(done) == 20  # every item that finished, also after the interruption, counts
    # damage the bytes of one finished item and tear the journal's last line, as a crash can
    first = min(done)
    wq_part = out / "tiny-qwen3moe-f16.wq.gguf.partial"
    items = _items(tiny_qwen, p)
    span = items[first].spans[0]
    with wq_part.open("r+b") as f:
        f.seek(span.offset)
        f.write(bytes(8))
    with journal.open("a") as j:
        j.write('{"i": 99999, "d": "tor')
    monkeypatch.setattr(par, "run_item", _real_run_item)
    with pytest.raises(RapidMoEError, match="unfinished conversion: pass --resume"):
        convert(tiny_qwen, out, p, progress=False)
    seen: list[par.ParallelWriter] = []
    real_validate = par.ParallelWriter.validate

    def spy(self, pool):  # type: ignore[no-untyped-def]
        seen.append(self)
        return real_validate(self, pool)

    monkeypatch.setattr(par.ParallelWriter, "validate", spy)
    res = convert(tiny_qwen, out, p, progress=False, threads=3, resume=True)
    assert seen[0].progress.redone_items == 1 and seen[0].progress.reused_items == len(done) - 1
    assert _sha(res.wq_path) == _sha(ref.wq_path) and _sha(res.wr_path) == _sha(ref.wr_path)
    assert sorted(x.name for x in out.iterdir()) == ["tiny-qwen3moe-f16.resplit.json", "tiny-qwen3moe-f16.wq.gguf",
                                                     "tiny-qwen3moe-f16.wr.gguf"]
    assert json.loads(res.report_path.read_text())["total"] == pytest.approx(ref.report["total"], rel=1e-9)
    check_pair(res.wq_path, res.wr_path, verify_data=True)


_real_run_item = par.run_item


def _items(src: Path, p) -> list[par.Item]:  # type: ignore[no-untyped-def]
    """The conversion's items as convert cuts them (to find one's bytes)."""
    from gguf import GGUFWriter  # noqa: PLC0415

    from rapidmoe.resplit.convert import _Converter  # noqa: PLC0415
    from rapidmoe.resplit.sidecar import SIDECAR_ARCH  # noqa: PLC0415

    conv = _Converter(src, p, None, 4)
    conv.validate()
    wq, wr = GGUFWriter(None, arch=conv.arch), GGUFWriter(None, arch=SIDECAR_ARCH)
    plan = conv.header(wq, wr, "x" * 32)
    a, b = plan_files(wq, Path("a.gguf")), plan_files(wr, Path("b.gguf"))
    return par.make_items(conv, plan, a + b, len(a))


def test_resume_refuses_another_conversions_journal(tiny_qwen: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A partial conversion made with another preset is not resumed (nothing of it is reused); --force starts over;
    --resume with nothing to resume starts afresh."""
    out = tmp_path / "out"
    _interrupt_after(monkeypatch, 2)
    with pytest.raises(par.Interrupted):
        convert(tiny_qwen, out, get_preset("cpu"), progress=False, threads=1)
    monkeypatch.setattr(par, "run_item", _real_run_item)
    with pytest.raises(RapidMoEError, match="another source, preset"):
        convert(tiny_qwen, out, get_preset("refine-hq"), progress=False, resume=True)
    res = convert(tiny_qwen, out, get_preset("refine-hq"), progress=False, force=True)
    assert not list(out.glob("*.partial"))
    fresh = convert(tiny_qwen, tmp_path / "fresh", get_preset("refine-hq"), progress=False, resume=True)
    assert _sha(fresh.wq_path) == _sha(res.wq_path)


def test_interrupted_before_any_item_leaves_nothing(tiny_qwen: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _interrupt_after(monkeypatch, 0)
    with pytest.raises(par.Interrupted, match="nothing was kept"):
        convert(tiny_qwen, tmp_path, get_preset("cpu"), progress=False, threads=2)
    assert list(tmp_path.iterdir()) == []
