"""RESplit conversion on tiny synthetic models: every WQ x WR pair round-trips to the expected error (checked
in numpy with gguf-py's own dequantizers, independent of ggml), outputs pair up, bad inputs are refused."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize
from testkit import ROOT

from rapidmoe import ModelFileError, RapidMoEError
from rapidmoe.ggufio import GGUFFile, copy_metadata, tensor_f32
from rapidmoe.resplit import Preset, check_pair, convert, get_preset
from rapidmoe.resplit.convert import _Converter
from rapidmoe.resplit.imatrix import Imatrix
from rapidmoe.resplit.presets import WQ_TYPES, WR_TYPES

# Relative error of a quantized Gaussian-like tensor, per type (upper bounds with margin, measured on these
# weights): the residual's own error ratio bounds how much WR can shrink WQ's error.
WR_RATIO_MAX = {"Q2_K": 0.40, "Q3_K": 0.24, "Q4_K": 0.13}


def _uniform_imatrix(src: Path) -> Imatrix:
    r = GGUFFile(src)
    im = Imatrix(datasets=["uniform"])
    for t in r.tensors:
        if "_exps" in t.name:
            im.in_sum2[t.name] = np.ones((int(t.shape[2]), int(t.shape[0])), np.float32)
            im.counts[t.name] = np.ones(int(t.shape[2]), np.float32)
    return im


def _tensors(path: Path) -> dict[str, tuple[GGMLQuantizationType, np.ndarray]]:
    r = GGUFFile(path)
    return {t.name: (GGMLQuantizationType(int(t.tensor_type)), np.array(t.data)) for t in r.tensors}


def _f32(qt: GGMLQuantizationType, data: np.ndarray) -> np.ndarray:
    if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return data.astype(np.float32)
    return np_dequantize(data, qt).astype(np.float32)


def _rel(err: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(err.ravel().astype(np.float64)) / np.linalg.norm(ref.ravel().astype(np.float64)))


@pytest.mark.native
@pytest.mark.parametrize("wq", WQ_TYPES)
@pytest.mark.parametrize("wr", WR_TYPES)
def test_every_pair_round_trips(micro: Path, tmp_path: Path, wq: str, wr: str) -> None:
    preset = Preset(f"{wq}+{wr}", wq, wr, "residual")
    res = convert(micro, tmp_path, preset, imatrix=_uniform_imatrix(micro), progress=False, report_experts=None)
    src, base, side = _tensors(micro), _tensors(res.wq_path), _tensors(res.wr_path)
    reported = {t["name"]: t["rel_error"] for t in res.report["tensors"]}  # type: ignore[attr-defined]
    for role in ("gate", "up", "down"):
        name = f"blk.0.ffn_{role}_exps.weight"
        w = _f32(*src[name])
        q_type, q_data = base[name]
        r_type, r_data = side[f"blk.0.ffn_{role}_exps.wr"]
        assert q_type.name == wq and r_type.name == wr
        deq_wq = _f32(q_type, q_data)  # gguf-py's numpy dequantizers, not ggml's
        deq_wr = _f32(r_type, r_data)
        e_wq = _rel(w - deq_wq, w)
        e_pair = _rel(w - (deq_wq + deq_wr), w)
        assert e_pair < WR_RATIO_MAX[wr] * e_wq, f"{name}: {wq}+{wr} {e_pair:.4f} vs WQ alone {e_wq:.4f}"
        assert e_pair < e_wq / 2.5  # a wide margin over WQ alone
        # the converter's own report agrees with the independent numpy computation
        assert reported[name]["wq_only"] == pytest.approx(e_wq, rel=1e-3)
        assert reported[name]["critical"] == pytest.approx(e_pair, rel=1e-3)
        assert reported[name]["Q8_0"] < reported[name]["Q4_K"] < e_wq


@pytest.mark.native
def test_paper_preset_down_copy_and_bits(micro: Path, tmp_path: Path) -> None:
    res = convert(micro, tmp_path, get_preset("paper"), imatrix=_uniform_imatrix(micro), progress=False)
    side = _tensors(res.wr_path)
    assert set(side) == {"blk.0.ffn_gate_exps.wr", "blk.0.ffn_up_exps.wr", "blk.0.ffn_down_exps.hi"}
    assert side["blk.0.ffn_down_exps.hi"][0].name == "Q4_K"
    w = _f32(*_tensors(micro)["blk.0.ffn_down_exps.weight"])
    assert _rel(w - _f32(*side["blk.0.ffn_down_exps.hi"]), w) < 0.12  # a Q4_K copy, not a residual
    bits = res.report["bits"]
    assert bits["wq"] == 1.75 and bits["wr_gate_up"] == 2.625 and bits["down_sidecar"] == 4.5  # type: ignore[index]
    assert json.loads(res.report_path.read_text())["pair_id"] == res.report["pair_id"]
    # non-expert tensors: Q8_0 matrices, F32 norms and router
    base = _tensors(res.wq_path)
    assert base["blk.0.attn_q.weight"][0] == GGMLQuantizationType.Q8_0
    assert base["blk.0.ffn_gate_inp.weight"][0] == GGMLQuantizationType.F32
    assert base["blk.0.attn_norm.weight"][0] == GGMLQuantizationType.F32


@pytest.mark.native
def test_ggml_dequantize_matches_gguf_py(micro: Path) -> None:
    """_core.dequantize (the kernels' view) equals gguf-py's independent numpy decoder."""
    from rapidmoe import _core  # noqa: PLC0415 - the compiled parts (the module imports without them)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    for name in ("Q2_K", "Q3_K", "Q4_K", "Q8_0", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ3_XXS"):
        qt = GGMLQuantizationType[name]
        q = _core.quantize(x, int(qt), np.ones(512, np.float32))
        np.testing.assert_allclose(_core.dequantize(q, int(qt), 512), np_dequantize(q, qt), rtol=1e-6, atol=1e-6)


@pytest.mark.native
def test_sidecar_pairs_only_with_its_base(micro: Path, tmp_path: Path) -> None:
    im = _uniform_imatrix(micro)
    a = convert(micro, tmp_path / "a", get_preset("cpu"), progress=False)
    b = convert(micro, tmp_path / "b", get_preset("paper"), imatrix=im, progress=False)
    assert check_pair(a.wq_path, a.wr_path)["pair_id"] == a.report["pair_id"]
    with pytest.raises(ModelFileError, match="does not belong"):
        check_pair(b.wq_path, a.wr_path)
    with pytest.raises(ModelFileError, match="does not belong"):
        check_pair(micro, a.wr_path)
    # same pair id but the base's data was modified afterwards: its last byte is in the last tensor's last sampled
    # window, so the load's check sees it, and the full check does (test_pairing.py: what each one sees)
    data = bytearray(a.wq_path.read_bytes())
    data[-1] ^= 0xFF
    a.wq_path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match=r"the sampled data of blk\.\d+\.ffn_down_exps\.weight \(1 of"):
        check_pair(a.wq_path, a.wr_path)
    with pytest.raises(ModelFileError, match="sha256 of the base differs"):
        check_pair(a.wq_path, a.wr_path, verify=False, verify_data=True)


@pytest.mark.native
def test_wq_runs_in_ours(micro: Path, tmp_path: Path) -> None:
    from rapidmoe import Llama  # noqa: PLC0415 - the compiled parts (the module imports without them)

    res = convert(micro, tmp_path, get_preset("cpu"), progress=False)
    llm = Llama(res.wq_path, n_ctx=64, verbose=False)
    out: Any = llm.create_completion("Hello", max_tokens=6, temperature=0.0)  # not streamed: one dict
    assert out["usage"]["completion_tokens"] == 6
    llm.close()


@pytest.mark.native
@pytest.mark.stock
def test_wq_runs_in_stock_llama_cpp(micro: Path, tmp_path: Path, stock_bin: Path) -> None:
    res = convert(micro, tmp_path, get_preset("cpu"), progress=False)
    code = ("import sys, llama_cpp; m = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, verbose=False); "
            "print(m.create_completion('Hello', max_tokens=6, temperature=0.0)['usage']['completion_tokens'])")
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(stock_bin), PYTHONPATH=str(ROOT / "vendor" / "llama_cpp_py"))
    out = subprocess.run([sys.executable, "-c", code, str(res.wq_path)], env=env, capture_output=True, text=True,
                         check=True, cwd=ROOT / "vendor")
    assert out.stdout.strip().splitlines()[-1] == "6"


@pytest.mark.native
def test_refuses_bad_inputs(micro: Path, tmp_path: Path, vocab_dir: Path) -> None:
    with pytest.raises(ModelFileError, match="dense"):
        convert(vocab_dir / "ggml-vocab-gpt-2.gguf", tmp_path, get_preset("cpu"), progress=False)
    with pytest.raises(RapidMoEError, match="IQ1_M needs an importance matrix"):
        convert(micro, tmp_path, get_preset("paper"), progress=False)
    odd = tmp_path / "odd-rows.gguf"  # down's rows cut to 100 values: no quantized type's block divides them
    src = GGUFFile(micro)
    w = gguf.GGUFWriter(odd, arch=str(src.get("general.architecture")))
    copy_metadata(src, w)
    for t in src.tensors:
        data = np.array(t.data)
        if t.name == "blk.0.ffn_down_exps.weight":
            data = np.ascontiguousarray(tensor_f32(t)[..., :100])
        w.add_tensor(t.name, data, raw_dtype=None if t.name == "blk.0.ffn_down_exps.weight" else t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"blk\.0\.ffn_down_exps\.weight has rows of 100 values, which no "):
        convert(odd, tmp_path, get_preset("cpu"), progress=False)
    convert(micro, tmp_path, get_preset("cpu"), progress=False)
    with pytest.raises(RapidMoEError, match="exists; pass --force"):
        convert(micro, tmp_path, get_preset("cpu"), progress=False)
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("nope")
    with pytest.raises(ValueError, match="WQ type Q8_0 not supported"):
        get_preset("paper", wq="Q8_0")


def test_incomplete_experts_of_any_architecture_are_refused(tmp_path: Path, micro: Path) -> None:
    """The architecture's name decides nothing; a layer whose experts are up alone cannot be split."""
    src = GGUFFile(micro)
    path = tmp_path / "foo.gguf"
    w = gguf.GGUFWriter(path, arch="foomoe")
    w.add_uint32("foomoe.expert_count", 4)
    w.add_uint32("foomoe.expert_used_count", 2)
    t = next(t for t in src.tensors if t.name.endswith("ffn_up_exps.weight"))
    w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match=r"ffn_up_exps\.weight: layer \d+ has routed experts up; RESplit splits"):
        convert(path, tmp_path / "out", get_preset("cpu"), progress=False)


@pytest.mark.native
def test_interrupted_conversion_leaves_nothing(micro: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The numpy reference writes complete outputs or none (the compiled encoder keeps its partial files for
    --resume: test_parallel_convert.py)."""
    calls = {"n": 0}
    real = _Converter.convert_expert

    def flaky(self, t):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(self, t)

    monkeypatch.setattr(_Converter, "convert_expert", flaky)
    with pytest.raises(KeyboardInterrupt):
        convert(micro, tmp_path, get_preset("cpu"), progress=False, encoder="numpy")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.native
@pytest.mark.parametrize("preset", ["cpu", "cpu-fast"])
def test_mixture_preset_matches_llama_quantize(micro: Path, tmp_path: Path, preset: str) -> None:
    """The cpu presets' non-expert tensors take llama-quantize's Q4_K_M mixture (patch 0003) with the preset's
    token-embedding and output types given as llama-quantize's own --token-embedding-type / --output-tensor-type:
    the same type and the same bytes as llama.cpp's quantization of the same file, tensor by tensor; only the
    routed experts differ."""
    from rapidmoe import llama_cpp  # noqa: PLC0415 - the compiled parts (the module imports without them)

    p = get_preset(preset)
    res = convert(micro, tmp_path / "split", p, progress=False)
    out = tmp_path / "q4km.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 2
    fixed = p.tensor_types({t.name for t in GGUFFile(micro).tensors})
    assert fixed, "the micro model should exercise the preset's per-tensor types"
    if "token_embd.weight" in fixed:
        params.token_embedding_type = GGMLQuantizationType[fixed["token_embd.weight"]].value
    if "output.weight" in fixed:
        params.output_tensor_type = GGMLQuantizationType[fixed["output.weight"]].value
    assert llama_cpp.llama_model_quantize(str(micro).encode(), str(out).encode(), ctypes.byref(params)) == 0
    stock = {t.name: t for t in GGUFFile(out).tensors}
    ours = {t.name: t for t in GGUFFile(res.wq_path).tensors}
    assert ours.keys() == stock.keys()
    others = [n for n in ours if "_exps." not in n]
    assert len(others) > 5
    for n in others:
        assert ours[n].tensor_type == stock[n].tensor_type, n
        assert bytes(np.asarray(ours[n].data).reshape(-1).view(np.uint8)) == \
            bytes(np.asarray(stock[n].data).reshape(-1).view(np.uint8)), n
    assert {ours[n].tensor_type.name for n in ours if "_exps." in n} == {"Q2_K"}
    assert all(ours[n].tensor_type.name == ty for n, ty in fixed.items())
    with pytest.raises(ValueError, match="not supported"):
        get_preset("cpu", other="Q9_K_M")
    with pytest.raises(ValueError, match="output type Q3_K not supported"):
        get_preset("cpu", output="Q3_K")
