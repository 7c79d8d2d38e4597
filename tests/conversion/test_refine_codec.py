"""The refine codec ("q3k-refine1", rapidmoe/resplit/refine.py): its Q3_K bytes are what ggml's own Q3_K
dequantization reads, its refined weights follow the agreed format (checked against a scalar transliteration of
ggml's dequantize_row_q3_K plus the format's refinement rule), its errors on a trained model's experts beat ggml's
Q4_K (refined) and stay near ggml's Q3_K (base), bad inputs are refused, and `convert` writes a pair that loads."""
from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize
from testkit import ROOT
from typer.testing import CliRunner

from rapidmoe import ModelFileError
from rapidmoe.cli.app import app
from rapidmoe.ggufio import GGUFFile, copy_metadata, tensor_rows
from rapidmoe.placement.realize import sidecar_preset
from rapidmoe.resplit import Preset, check_pair, convert, get_preset, read_sidecar_meta
from rapidmoe.resplit.codecs import codec_of
from rapidmoe.resplit.convert import codec_obstacle
from rapidmoe.resplit.imatrix import Imatrix
from rapidmoe.resplit.refine import (
    BLOCK_BYTES,
    QK_K,
    RefineShapeError,
    decode_refine,
    encode_refine,
    pack_q3k,
    unpack_q3k,
)
from rapidmoe.resplit.report import format_table

TINY_MOE_A = ROOT.parent / "shared" / "models" / "tiny-moe-a" / "model-f16.gguf"
Q3_K = int(GGMLQuantizationType.Q3_K)


def _rel(w: np.ndarray, approx: np.ndarray) -> float:
    return float(np.linalg.norm((w - approx).astype(np.float64)) / np.linalg.norm(w.astype(np.float64)))


def _matrices() -> dict[str, np.ndarray]:
    """Weights of several shapes and distributions, with the corner cases of the scale fit: zero rows and
    sub-blocks, a lone nonzero weight, a positive and a negative largest weight, tiny and large magnitudes."""
    rng = np.random.default_rng(7)
    out = {
        "gauss": rng.standard_normal((24, 512)).astype(np.float32) * 0.02,
        "student-t": rng.standard_t(3, (16, 768)).astype(np.float32) * 0.01,
        "uniform": rng.uniform(-1, 1, (8, 256)).astype(np.float32),
        "tiny": rng.standard_normal((4, 256)).astype(np.float32) * 1e-6,
        "large": rng.standard_normal((4, 256)).astype(np.float32) * 1e3,
    }
    corner = rng.standard_normal((6, 512)).astype(np.float32)
    corner[0] = 0.0  # a zero row
    corner[1, 16:48] = 0.0  # zero sub-blocks inside a row
    corner[2, :16] = 0.0
    corner[2, 5] = 3.0  # a lone positive weight
    corner[3, 20] = 40.0  # a positive outlier: the largest |w| of its super-block
    corner[4, 300] = -40.0  # a negative one
    corner[5, 256:] = np.abs(corner[5, 256:])  # a one-signed super-block
    out["corner"] = corner
    return out


def _ref_dequant_row(block_bytes: np.ndarray, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One row, scalar: ggml's dequantize_row_q3_K (ggml-quants.c) transliterated, and the format's refinement
    (refined = s * (L - 4) + s/4 * (2t - 1), bit t of column i: byte i >> 3, bit i & 7)."""
    n_blocks = len(block_bytes) // BLOCK_BYTES
    base = np.zeros(n_blocks * QK_K, np.float32)
    refined = np.zeros(n_blocks * QK_K, np.float32)
    for i in range(n_blocks):
        blk = bytes(block_bytes[i * BLOCK_BYTES: (i + 1) * BLOCK_BYTES])
        hm, qs, sb = blk[0:32], blk[32:96], blk[96:108]
        d_all = np.float32(struct.unpack("<e", blk[108:110])[0])
        aux = list(struct.unpack("<4I", sb + b"\0\0\0\0"))
        k1, k2 = 0x03030303, 0x0F0F0F0F
        tmp = aux[2]
        aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4)
        aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4)
        aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4)
        aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4)
        scales = [b if b < 128 else b - 256 for b in struct.pack("<4I", *aux)]  # int8 view, as ggml's
        y = i * QK_K
        m, is_, q0 = 1, 0, 0
        for _n in range(0, QK_K, 128):
            shift = 0
            for _j in range(4):
                for half in (0, 16):
                    dl = np.float32(d_all * np.float32(scales[is_] - 32))
                    is_ += 1
                    for ll in range(16):
                        idx = q0 + ll + half
                        lv = ((qs[idx] >> shift) & 3) + (4 if hm[ll + half] & m else 0)  # L in 0..7
                        base[y] = np.float32(dl * np.float32(lv - 4))
                        t = (int(bits[y >> 3]) >> (y & 7)) & 1
                        refined[y] = np.float32(dl * np.float32(0.25)) * np.float32(4 * (lv - 4) + 2 * t - 1)
                        y += 1
                shift += 2
                m <<= 1
            q0 += 32
    return base, refined


# -- (a) the packing ---------------------------------------------------------------------------------------------
@pytest.mark.native
@pytest.mark.parametrize("kind", list(_matrices()))
def test_base_is_ggml_q3k_exactly(kind: str) -> None:
    """ggml's own Q3_K dequantization of encode_refine's bytes equals decode_refine's base, bit for bit."""
    from rapidmoe import _core  # noqa: PLC0415 - the compiled parts (the module imports without them)

    w = _matrices()[kind]
    n_out, n_in = w.shape
    q, bits = encode_refine(w)
    assert q.dtype == np.uint8 and q.shape == (n_out, n_in // QK_K * BLOCK_BYTES)
    assert bits.dtype == np.uint8 and bits.shape == (n_out, n_in // 8)
    base, refined = decode_refine(q, bits, n_in)
    ggml_base = _core.dequantize(q, Q3_K, n_in)
    assert np.array_equal(ggml_base, base)
    assert np.array_equal(np_dequantize(q, GGMLQuantizationType.Q3_K), base)  # gguf-py's decoder agrees
    assert np.isfinite(refined).all()
    assert not refined[np.all(w == 0, axis=1)].any()  # zero rows stay zero


@pytest.mark.parametrize("kind", ["gauss", "corner", "student-t"])
def test_refined_follows_the_format(kind: str) -> None:
    """decode_refine equals the scalar reference on every row; each refined weight is the fine-grid level nearest
    to W for its sub-block's stored scale (the encoder's last step); pack/unpack round-trip."""
    w = _matrices()[kind]
    n_out, n_in = w.shape
    q, bits = encode_refine(w)
    base, refined = decode_refine(q, bits, n_in)
    for r in range(n_out):
        ref_base, ref_refined = _ref_dequant_row(q[r], bits[r])
        assert np.array_equal(ref_base, base[r]), f"row {r}"
        assert np.array_equal(ref_refined, refined[r]), f"row {r}"
    # nearest level: the 16 fine levels s/4 * (2f - 17) of each weight's sub-block scale s
    levels, sc, d = unpack_q3k(q.reshape(-1, BLOCK_BYTES))
    s = np.repeat(d.astype(np.float32)[:, None] * sc.astype(np.float32), 16, axis=1).reshape(n_out, n_in)
    grid = s[..., None] * np.float32(0.25) * (2 * np.arange(16, dtype=np.float32) - 17)
    best = np.abs(w[..., None] - grid).min(axis=-1)
    assert np.all(np.abs(w - refined) <= best * (1 + 1e-5) + 1e-30)
    assert np.array_equal(pack_q3k(levels, sc, d), q.reshape(-1, BLOCK_BYTES))


def test_importance_weights_the_error() -> None:
    """Columns with a larger importance get a smaller error than without the importance matrix."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 512)).astype(np.float32)
    imp = np.ones(512, np.float32)
    imp[::2] = 100.0
    plain = decode_refine(*encode_refine(w), 512)[1]
    weighted = decode_refine(*encode_refine(w, imp), 512)[1]

    def werr(r: np.ndarray) -> float:
        return float((imp * (w - r) ** 2).sum())
    assert werr(weighted) < 0.95 * werr(plain)
    assert np.array_equal(decode_refine(*encode_refine(w, np.ones(512, np.float32)), 512)[1], plain)


# -- (b) errors on a trained model's experts -----------------------------------------------------------------------
@pytest.mark.native
@pytest.mark.skipif(not TINY_MOE_A.exists(), reason="the trained tiny-moe-a is not on this machine")
@pytest.mark.parametrize("name", ["blk.1.ffn_gate_exps.weight", "blk.3.ffn_up_exps.weight",
                                  "blk.5.ffn_down_exps.weight"])
def test_errors_against_ggml_on_trained_experts(name: str) -> None:
    """Per weight (relative RMS vs the F16 source): the refined weights (4.4375 bpw) beat ggml's Q4_K (4.5 bpw);
    the base (stock Q3_K bytes whose scales serve the fine grid) is within 1.3x of ggml's own Q3_K."""
    from rapidmoe import _core  # noqa: PLC0415 - the compiled parts (the module imports without them)

    t = GGUFFile(TINY_MOE_A).tensor(name)
    n_in, n_out, _ = (int(x) for x in t.shape)
    for e in (0, 9):
        w = tensor_rows(t, e * n_out, n_out)
        ggml = {ty: _rel(w, _core.dequantize(_core.quantize(w, int(GGMLQuantizationType[ty]), None),
                                             int(GGMLQuantizationType[ty]), n_in)) for ty in ("Q3_K", "Q4_K")}
        base, refined = decode_refine(*encode_refine(w), n_in)
        e_base, e_ref = _rel(w, base), _rel(w, refined)
        print(f"{name} expert {e}: refined {e_ref:.5f} / Q4_K {ggml['Q4_K']:.5f} = {e_ref / ggml['Q4_K']:.3f}; "
              f"base {e_base:.5f} / Q3_K {ggml['Q3_K']:.5f} = {e_base / ggml['Q3_K']:.3f}")
        assert e_ref < ggml["Q4_K"]
        assert e_base < 1.3 * ggml["Q3_K"]


# -- (c) refusals --------------------------------------------------------------------------------------------------
def test_codec_refuses_bad_inputs() -> None:
    w = np.ones((4, 512), np.float32)
    with pytest.raises(RefineShapeError, match="whole Q3_K super-blocks of 256 weights; these rows have 384"):
        encode_refine(np.ones((4, 384), np.float32))
    with pytest.raises(RefineShapeError, match="one matrix"):
        encode_refine(np.ones(512, np.float32))
    with pytest.raises(RefineShapeError, match=r"importance has shape \(256,\)"):
        encode_refine(w, np.ones(256, np.float32))
    q, bits = encode_refine(w)
    with pytest.raises(RefineShapeError, match="are not rows of 256 weights"):
        decode_refine(q, bits, 256)
    with pytest.raises(RefineShapeError, match="refinement bits of shape"):
        decode_refine(q, bits[:, :10], 512)


def test_presets_refuse_incomplete_refine() -> None:
    with pytest.raises(ValueError, match="WQ Q2_K cannot be refined"):
        get_preset("refine", wq="Q2_K")
    with pytest.raises(ValueError, match="down_mode must be 'refine', not 'copy'"):
        get_preset("refine-q8", down_mode="copy")
    with pytest.raises(ValueError, match="down_mode must be 'refine', not 'residual'"):
        get_preset("dense", wr="REFINE1")
    with pytest.raises(ValueError, match="needs WR REFINE1, not Q4_K"):
        Preset("x", "Q3_K", "Q4_K", "refine")
    with pytest.raises(ValueError, match="WR type Q5_K not supported"):
        get_preset("dense", wr="Q5_K")
    for name in ("refine", "refine-hq", "refine-q8"):
        p = get_preset(name)
        assert p.bits() == {"wq": 3.4375, "wr_gate_up": 1.0, "down_sidecar": 1.0, "sidecar": 1.0,
                            "critical": 4.4375, "total_stored": 4.4375}
        assert p.codec == codec_of(p).name == codec_of(p).sidecar_id == "q3k-refine1"
    assert get_preset("dense").bits()["critical"] == 7.9375 and get_preset("dense").codec == "residual"
    assert codec_of(get_preset("dense")).name == "residual" and codec_of(get_preset("dense")).sidecar_id is None


def _rewrite(src: Path, dst: Path, edit: dict[str, np.ndarray | None], add: dict[str, np.ndarray]) -> Path:
    """A copy of src with tensors replaced (float32 arrays in numpy order), dropped (None) or added."""
    r = GGUFFile(src)
    w = gguf.GGUFWriter(dst, arch=str(r.get("general.architecture")))
    copy_metadata(r, w)
    for t in r.tensors:
        if t.name in edit:
            new = edit[t.name]
            if new is not None:
                w.add_tensor(t.name, np.ascontiguousarray(new, dtype=np.float32))
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, arr in add.items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _f32(r: GGUFFile, name: str) -> np.ndarray:
    return np.array(r.tensor(name).data, dtype=np.float32)


@pytest.mark.native
def test_convert_refuses_what_the_codec_does_not_take(micro: Path, tmp_path: Path) -> None:
    r = GGUFFile(micro)
    gate, up = _f32(r, "blk.0.ffn_gate_exps.weight"), _f32(r, "blk.0.ffn_up_exps.weight")
    merged = _rewrite(micro, tmp_path / "merged.gguf",
                      {"blk.0.ffn_gate_exps.weight": None, "blk.0.ffn_up_exps.weight": None},
                      {"blk.0.ffn_gate_up_exps.weight": np.concatenate([gate, up], axis=1)})
    with pytest.raises(ModelFileError, match=r"ffn_gate_up_exps\.weight: preset refine-q8 \(the refine codec\) does "
                                             "not take merged gate_up experts"):
        convert(merged, tmp_path / "o1", get_preset("refine-q8"), progress=False)
    scaled = _rewrite(micro, tmp_path / "scaled.gguf", {},
                      {"blk.0.ffn_down_exps.scale": np.ones(int(r.tensor("blk.0.ffn_down_exps.weight").shape[2]))})
    with pytest.raises(ModelFileError, match=r"ffn_down_exps\.scale: preset refine-q8 \(the refine codec\) does not "
                                             "take routed experts with per-expert scales"):
        convert(scaled, tmp_path / "o2", get_preset("refine-q8"), progress=False)
    down = _f32(r, "blk.0.ffn_down_exps.weight")
    short = _rewrite(micro, tmp_path / "short.gguf", {"blk.0.ffn_down_exps.weight": down[..., :128]}, {})
    with pytest.raises(ModelFileError, match=r"ffn_down_exps\.weight has rows of 128 values; preset refine-q8 "
                                             r"\(the refine codec\) needs rows that are whole Q3_K super-blocks"):
        convert(short, tmp_path / "o3", get_preset("refine-q8"), progress=False)
    assert not any((tmp_path / d).exists() and any((tmp_path / d).iterdir()) for d in ("o1", "o2", "o3"))
    # convert --preset auto asks the same question first (its answer: the refusal's message, or None)
    assert codec_obstacle(micro, "refine") is None
    for bad, what in ((merged, "merged gate_up"), (scaled, "per-expert scales"), (short, "rows of 128 values")):
        why = codec_obstacle(bad, "refine-hq")
        assert why is not None and what in why and "preset refine-hq" in why


# -- (d) conversion --------------------------------------------------------------------------------------------------
@pytest.mark.native
@pytest.mark.parametrize("preset", ["refine-q8", "refine", "refine-hq"])
def test_convert_writes_a_refine_pair(micro: Path, tmp_path: Path, preset: str) -> None:
    res = convert(micro, tmp_path, get_preset(preset), progress=False, report_experts=None)
    meta = check_pair(res.wq_path, res.wr_path)
    assert meta["codec"] == "q3k-refine1" and meta["preset.wr"] == "REFINE1" and meta["preset.down_mode"] == "refine"
    assert read_sidecar_meta(res.wr_path)["codec"] == "q3k-refine1"
    assert sidecar_preset(res.wr_path) == get_preset(preset)  # the planner reads the same preset back
    src, base, side = GGUFFile(micro), GGUFFile(res.wq_path), GGUFFile(res.wr_path)
    assert {t.name for t in side.tensors} == {f"blk.0.ffn_{r}_exps.rf" for r in ("gate", "up", "down")}
    reported = {t["name"]: t for t in res.report["tensors"]}  # type: ignore[attr-defined]
    for role in ("gate", "up", "down"):
        name = f"blk.0.ffn_{role}_exps.weight"
        n_in, n_out, n_expert = (int(x) for x in src.tensor(name).shape)
        wq, rf = base.tensor(name), side.tensor(f"blk.0.ffn_{role}_exps.rf")
        assert wq.tensor_type == GGMLQuantizationType.Q3_K and tuple(wq.shape) == (n_in, n_out, n_expert)
        assert rf.tensor_type == GGMLQuantizationType.I8 and tuple(rf.shape) == (n_in // 8, n_out, n_expert)
        q = np.array(wq.data).reshape(n_expert, n_out, -1)
        bits = np.array(rf.data).reshape(n_expert, n_out, n_in // 8)
        w2 = e_base = e_ref = 0.0
        for e in range(n_expert):
            w = tensor_rows(src.tensor(name), e * n_out, n_out).astype(np.float64)
            enc_q, enc_bits = encode_refine(w.astype(np.float32))
            assert np.array_equal(enc_q, q[e]) and np.array_equal(enc_bits, bits[e])
            b, r = decode_refine(q[e], bits[e], n_in)
            assert np.array_equal(np_dequantize(q[e], GGMLQuantizationType.Q3_K), b)  # stock Q3_K, read stock
            w2 += float((w ** 2).sum())
            e_base += float(((w - b) ** 2).sum())
            e_ref += float(((w - r) ** 2).sum())
        rel = reported[name]["rel_error"]
        assert reported[name]["sidecar_type"] == "REFINE1"
        assert rel["wq_only"] == pytest.approx(np.sqrt(e_base / w2), rel=1e-4)
        assert rel["critical"] == pytest.approx(np.sqrt(e_ref / w2), rel=1e-4)
        # synthetic weights: the refinement bit halves the base's error; the base stays near ggml's Q3_K (the
        # comparison with Q4_K is made on trained weights, where it is meaningful: test_errors_against_ggml_...)
        assert rel["critical"] < rel["wq_only"] / 1.8 and rel["wq_only"] < 1.3 * rel["Q3_K"]
    assert res.report["bits"]["critical"] == 4.4375  # type: ignore[index]
    # inspect lists the sidecar's bit planes at one bit per weight (its table once left .rf out)
    shown = CliRunner().invoke(app, ["inspect", str(res.wr_path)])
    assert shown.exit_code == 0, shown.output
    for role in ("gate", "up", "down"):
        rf = side.tensor(f"blk.0.ffn_{role}_exps.rf")
        line = f"{role:8s} rf     I8          1  {int(rf.n_bytes) / 1e6:9.2f}  1.000"
        assert line in shown.output, shown.output
    assert res.report["codec"] == "q3k-refine1"
    table = format_table(res.report).splitlines()
    assert table[0].split()[-3:] == ["Q3_K", "Q4_K", "Q8_0"] and "REFINE1 bits" in table[2]
    other = base.tensor("blk.0.attn_q.weight").tensor_type
    assert other == (GGMLQuantizationType.Q8_0 if preset == "refine-q8" else GGMLQuantizationType.Q4_K)
    # the output head: refine's Q4_K (as cpu-fast), refine-hq's llama.cpp Q4_K_M choice (Q6_K, as cpu), refine-q8's
    head = {"refine": GGMLQuantizationType.Q4_K, "refine-hq": GGMLQuantizationType.Q6_K,
            "refine-q8": GGMLQuantizationType.Q8_0}
    assert base.tensor("output.weight").tensor_type == head[preset]


@pytest.mark.native
def test_convert_with_importance_and_pair_id(micro: Path, tmp_path: Path) -> None:
    """A uniform importance matrix encodes exactly as none (c = 1 * |w|) but gives another pair id; a sidecar of
    one conversion does not pair with the other's base."""
    r = GGUFFile(micro)
    im = Imatrix(datasets=["uniform"])
    for t in r.tensors:
        if "_exps" in t.name:
            im.in_sum2[t.name] = np.ones((int(t.shape[2]), int(t.shape[0])), np.float32)
            im.counts[t.name] = np.ones(int(t.shape[2]), np.float32)
    a = convert(micro, tmp_path / "a", get_preset("refine-q8"), progress=False)
    b = convert(micro, tmp_path / "b", get_preset("refine-q8"), imatrix=im, progress=False)
    c = convert(micro, tmp_path / "c", get_preset("cpu-q8"), progress=False)
    assert len({a.report["pair_id"], b.report["pair_id"], c.report["pair_id"]}) == 3
    ta, tb = GGUFFile(a.wr_path), GGUFFile(b.wr_path)
    for t in ta.tensors:
        assert np.array_equal(np.array(t.data), np.array(tb.tensor(t.name).data))
    with pytest.raises(ModelFileError, match="does not belong"):
        check_pair(b.wq_path, a.wr_path)
    with pytest.raises(ModelFileError, match="does not belong"):
        check_pair(c.wq_path, a.wr_path)
