"""A third codec added through the registry alone (rapidmoe.resplit.codecs): ToyCodec below is its whole definition
and `register(ToyCodec())` its one registry line; with it a preset converts a tiny synthetic model (both encoders),
the pair loads and runs, and the planner sizes its sidecar, with no edit anywhere else.

The toy cannot bring a C++ op at test time, so it reuses the residual op: like the residual codec's, its sidecar
carries no rapidmoe.residual.codec key, which the loader reads as its residual codec id. What it chooses itself:
Q8_0 residuals of gate, up and down (a type the residual codec's WR does not take), encoded by its own numpy code
(gguf-py's Q8_0 quantizer, not ggml's) and no compiled encoder (the parallel writer runs its encode on its threads).
Checked against references independent of it: the residual against W - deq(WQ), r = 0 bit for bit against a built-in
preset with the same WQ, r = k against the F32 model of deq(WQ) + deq(WR) (tests/reference/critical_model.py)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize
from gguf.quants import quantize as np_quantize
from reference.critical_model import write_critical_model
from reference.split_logits import all_logits, prompt_tokens, rel_error

from rapidmoe import ModelFileError, _core
from rapidmoe.ggml_types import ggml_type
from rapidmoe.ggufio import GGUFFile, tensor_rows
from rapidmoe.placement.tensors import read_gguf_shapes
from rapidmoe.placement.typeplan import sidecar_bytes
from rapidmoe.resplit import Preset, check_pair, convert, read_sidecar_meta
from rapidmoe.resplit.codecs import REGISTRY, Compiled, Encoded, codec_of, get_codec, register
from rapidmoe.resplit.codecs.residual import ResidualCodec
from rapidmoe.resplit.report import format_table

pytestmark = pytest.mark.native
Q8_0 = GGMLQuantizationType.Q8_0


class ToyCodec(ResidualCodec):
    """WQ in a ggml type + a Q8_0 residual of every role, quantized by gguf-py's numpy code."""

    name = "toy-q8-residual"
    title = "the toy codec"
    wr_types: tuple[str, ...] = ()  # claims no WR type name: only a preset that names it gets it
    down_modes: tuple[str, ...] = ("residual",)
    no_mix: str | None = "is a test's"

    def check_preset(self, preset: Preset) -> None:
        if preset.wr.upper() != "Q8_0" or preset.down_mode != "residual":
            raise ValueError(f"{self.title} takes WR Q8_0 and down 'residual', not {preset.wr} {preset.down_mode!r}")

    def encode(self, w: np.ndarray, wq: str, hi: str, copy: bool, importance: np.ndarray | None) -> Encoded:
        assert hi == "Q8_0" and not copy
        wq_t = int(ggml_type(wq))
        q = _core.quantize(w, wq_t, importance)
        dq = _core.dequantize(q, wq_t, w.shape[1])
        side = np_quantize(np.ascontiguousarray(w - dq, dtype=np.float32), Q8_0)
        return Encoded(q, side, dq, dq + np_dequantize(side, Q8_0))

    def compiled(self, wq: str, hi: str, copy: bool, n_in: int) -> Compiled | None:
        return None


@pytest.fixture
def toy() -> Iterator[ToyCodec]:
    codec = register(ToyCodec())  # the registry line
    yield codec
    del REGISTRY[codec.name]


def _toy_preset(codec: ToyCodec) -> Preset:
    return Preset("toy", "Q2_K", "Q8_0", "residual", other="Q8_0", description="a test's", codec=codec.name)


def test_the_registry_knows_the_toy_only_once_registered(toy: ToyCodec) -> None:
    assert get_codec(toy.name) is toy and codec_of(_toy_preset(toy)) is toy
    with pytest.raises(ValueError, match="registered already"):
        register(ToyCodec())
    with pytest.raises(ValueError, match="takes WR Q8_0"):
        Preset("toy", "Q2_K", "Q4_K", "residual", codec=toy.name)
    with pytest.raises(ValueError, match="it takes no mix"):
        Preset("toy", "Q2_K", "Q8_0", "residual", mix="down=Q3_K", codec=toy.name)
    with pytest.raises(ValueError, match="WR type Q8_0 not supported"):  # a preset that does not name it
        Preset("x", "Q2_K", "Q8_0", "residual")
    assert _toy_preset(toy).bits()["critical"] == pytest.approx(2.625 + 8.5)
    assert _toy_preset(toy).record()["codec"] == toy.name  # the WR type and down mode alone name another codec
    del REGISTRY[toy.name]
    with pytest.raises(ValueError, match="unknown codec 'toy-q8-residual'"):
        _toy_preset(toy)
    REGISTRY[toy.name] = toy


def test_the_toy_codec_converts_and_runs(toy: ToyCodec, micro: Path, tmp_path: Path) -> None:
    preset = _toy_preset(toy)
    res = convert(micro, tmp_path / "compiled", preset, progress=False, report_experts=None)
    ref = convert(micro, tmp_path / "numpy", preset, progress=False, report_experts=None, encoder="numpy")
    for a, b in ((res.wq_path, ref.wq_path), (res.wr_path, ref.wr_path)):  # the parallel writer ran its encode
        assert a.read_bytes() == b.read_bytes()
    assert res.report["codec"] == toy.name and res.report["tensors"] == ref.report["tensors"]

    meta = check_pair(res.wq_path, res.wr_path)
    assert "codec" not in meta and meta["preset.codec"] == toy.name  # the residual op's sidecar, read as such
    src, base, side = GGUFFile(micro), GGUFFile(res.wq_path), GGUFFile(res.wr_path)
    assert {t.name for t in side.tensors} == {f"blk.0.ffn_{r}_exps.wr" for r in ("gate", "up", "down")}
    reported = {t["name"]: t for t in res.report["tensors"]}  # type: ignore[attr-defined]
    shapes = {t.name: t for t in read_gguf_shapes(micro).tensors}
    for role in ("gate", "up", "down"):
        name = f"blk.0.ffn_{role}_exps.weight"
        n_in, n_out, n_expert = (int(x) for x in src.tensor(name).shape)
        wq, wr = base.tensor(name), side.tensor(f"blk.0.ffn_{role}_exps.wr")
        assert wq.tensor_type == GGMLQuantizationType.Q2_K and wr.tensor_type == Q8_0
        assert sidecar_bytes(shapes[name], preset) == wr.n_bytes  # the planner sizes it as written
        dq = np_dequantize(np.array(wq.data), wq.tensor_type).reshape(n_expert, n_out, n_in).astype(np.float64)
        dr = np_dequantize(np.array(wr.data), Q8_0).reshape(n_expert, n_out, n_in).astype(np.float64)
        w = np.stack([tensor_rows(src.tensor(name), e * n_out, n_out) for e in range(n_expert)]).astype(np.float64)
        # the sidecar holds W - deq(WQ) to Q8_0's precision: the critical path is W within ~0.5 %
        assert rel_error(dq + dr, w) < 0.01 < rel_error(dq, w)
        assert reported[name]["rel_error"]["critical"] == pytest.approx(rel_error(dq + dr, w), rel=1e-3)
        assert reported[name]["sidecar_type"] == "Q8_0" and not reported[name]["sidecar_is_copy"]
    assert "Q8_0 res" in format_table(res.report).splitlines()[2]

    toks = prompt_tokens(res.wq_path)
    k = int(base.get(f"{base.get('general.architecture')}.expert_used_count"))
    low = all_logits(res.wq_path, toks, residual_path=res.wr_path, n_critical=0)
    full = all_logits(res.wq_path, toks, residual_path=res.wr_path, n_critical=k)
    # r = 0: WQ only, the same bits as a built-in preset with the same WQ (and other tensors) under its own sidecar
    builtin = convert(micro, tmp_path / "builtin", Preset("b", "Q2_K", "Q2_K", "residual", other="Q8_0"),
                      progress=False)
    np.testing.assert_array_equal(low, all_logits(builtin.wq_path, toks, residual_path=builtin.wr_path,
                                                  n_critical=0))
    # r = k: the critical path is deq(WQ) + deq(WR), as an F32 model of them computes it (float-level: the split
    # computes the WQ and WR matmuls apart, on quantized activations)
    summed = tmp_path / "sum.gguf"
    write_critical_model(res.wq_path, res.wr_path, summed)
    ref_logits = all_logits(summed, toks)
    assert rel_error(full, ref_logits) < 0.03, rel_error(full, ref_logits)
    assert rel_error(full, ref_logits) < 0.2 * rel_error(low, ref_logits)


def test_a_sidecar_that_is_not_its_codecs_is_refused(micro: Path, tmp_path: Path) -> None:
    """The pair check asks the codec the sidecar names (its codec key; none: the residual codec) about its tensors:
    a refine sidecar's bit plane against a base whose experts are not Q3_K is refused before the load."""
    res = convert(micro, tmp_path / "refine", Preset("r", "Q3_K", "REFINE1", "refine"), progress=False)
    meta = read_sidecar_meta(res.wr_path)
    assert meta["codec"] == "q3k-refine1" and "preset.codec" not in meta
    problem = get_codec("q3k-refine1").validate(
        {t.name: ("Q2_K" if t.name.endswith("_exps.weight") else t.tensor_type.name, [int(x) for x in t.shape])
         for t in GGUFFile(res.wq_path).tensors}, meta["tensors"])
    assert problem is not None and "refines Q3_K experts, but the base's blk.0.ffn_" in problem
    assert get_codec("residual").validate({}, meta["tensors"]) is not None  # .rf: not a residual sidecar's
    with pytest.raises(ModelFileError, match="does not belong"):  # (another pair's: the pair id comes first)
        check_pair(convert(micro, tmp_path / "cpu", Preset("c", "Q2_K", "Q2_K"), progress=False).wq_path,
                   res.wr_path)
