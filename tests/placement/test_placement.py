"""Placement planner: byte counts against real GGUF files (the tiny synthetic models, a RESplit conversion and
llama-quantize's Q4_K_M), the named shape sets against published parameter counts, placement decisions under
several budgets, frequency tables, and the `plan` command's output and one-line errors."""
from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from typer.testing import CliRunner

from rapidmoe.cli.app import app
from rapidmoe.ggufio import GGUFFile
from rapidmoe.placement import (
    CPU,
    GPU,
    SHAPE_SETS,
    ExpertFrequency,
    FrequencyError,
    PlanError,
    ShapeSet,
    SizeError,
    get_shape_set,
    load_frequency,
    parse_size,
    plan,
    plan_all,
    read_gguf_shapes,
)
from rapidmoe.placement.footprint import footprint
from rapidmoe.placement.tensors import ROUTED, classify
from rapidmoe.placement.typeplan import native_types, q4_k_m_types, resplit_types
from rapidmoe.resplit import Imatrix, convert, get_preset, write_imatrix
from rapidmoe.synthetic.writer import read_spec

runner = CliRunner()
GiB = 1 << 30
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
         "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ3_XXS")


# --- bytes ----------------------------------------------------------------------------------------------------

@pytest.mark.native
def test_type_table_matches_ggml() -> None:
    from rapidmoe._runtime import _core  # noqa: PLC0415 - the compiled parts (the module imports without them)

    for name in TYPES:
        qt = GGMLQuantizationType[name]
        _, block, size, *_ = _core.type_info(int(qt))
        assert GGML_QUANT_SIZES[qt] == (block, size), name
        assert _core.row_size(int(qt), 7168) == 7168 // block * size


def test_native_bytes_match_the_gguf(tiny_model: Path) -> None:
    m = read_gguf_shapes(tiny_model)
    real = GGUFFile(tiny_model).tensors
    fp = footprint(m, native_types(m))
    by_part: dict[str, int] = {}
    for t in real:
        by_part[classify(t.name)] = by_part.get(classify(t.name), 0) + int(t.n_bytes)
    routed = by_part.pop(ROUTED)
    assert fp.parts == by_part
    assert fp.routed_bytes == routed
    for il in m.moe_layers:
        layer = sum(int(t.n_bytes) for t in real if t.name.startswith(f"blk.{il}.ffn_") and "_exps." in t.name)
        assert fp.expert_bytes[il] * m.n_expert == layer


def test_shape_set_layout_is_the_gguf_layout(tiny_model: Path) -> None:
    """A shape set with the tiny model's hyperparameters lists exactly the file's tensors (names and shapes)."""
    spec = read_spec(tiny_model)
    assert spec is not None
    r = GGUFFile(tiny_model)
    s = ShapeSet(name="t", arch=spec.arch, n_layer=spec.n_layer, n_embd=spec.n_embd,
                 n_vocab=int(r.tensor("token_embd.weight").shape[1]), n_head=spec.n_head, n_expert=spec.n_expert,
                 n_expert_used=spec.n_expert_used, n_ff_exp=spec.n_ff_exp, published_params=0, published_active=0,
                 source="", n_head_kv=spec.n_head_kv if spec.arch == "qwen3moe" else 0, head_dim=spec.head_dim,
                 n_layer_dense_lead=spec.n_layer_dense_lead, n_ff=spec.n_ff, n_expert_shared=spec.n_expert_shared,
                 q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank,
                 qk_nope_head_dim=spec.qk_nope_head_dim, qk_rope_head_dim=spec.qk_rope_head_dim,
                 v_head_dim=spec.v_head_dim, tied_embeddings=spec.tied_embeddings)
    got = {(t.name, t.shape) for t in s.tensor_list()}
    assert got == {(t.name, tuple(int(x) for x in t.shape)) for t in r.tensors}
    assert s.kv_elements_per_token() == read_gguf_shapes(tiny_model).kv_elements_per_token


@pytest.mark.native
def test_resplit_bytes_match_a_conversion(tiny_qwen: Path, tmp_path: Path) -> None:
    preset = get_preset("cpu-q8")  # K-quants: no importance matrix needed; one type for the rest (planned exactly)
    res = convert(tiny_qwen, tmp_path, preset, progress=False, report_experts=1)
    m = read_gguf_shapes(tiny_qwen)
    fp = footprint(m, resplit_types(preset), preset)
    wq = GGUFFile(res.wq_path).tensors
    assert sum(int(t.n_bytes) for t in wq if classify(t.name) == ROUTED) == fp.routed_bytes
    assert sum(int(t.n_bytes) for t in wq if classify(t.name) != ROUTED) == sum(fp.parts.values())
    assert sum(int(t.n_bytes) for t in GGUFFile(res.wr_path).tensors) == sum(fp.sidecar.values())


@pytest.mark.native
def test_refine_bytes_match_a_conversion(tiny_qwen: Path, tmp_path: Path) -> None:
    """The refine codec: a Q3_K base and a bit plane of one bit per weight, sized as the converter writes them."""
    preset = get_preset("refine-q8")
    res = convert(tiny_qwen, tmp_path, preset, progress=False, report_experts=1)
    m = read_gguf_shapes(tiny_qwen)
    fp = footprint(m, resplit_types(preset), preset)
    wq = GGUFFile(res.wq_path).tensors
    assert sum(int(t.n_bytes) for t in wq if classify(t.name) == ROUTED) == fp.routed_bytes
    assert sum(int(t.n_bytes) for t in GGUFFile(res.wr_path).tensors) == sum(fp.sidecar.values())
    assert sum(fp.sidecar.values()) * 8 * 110 == fp.routed_bytes * 256  # 1 bit against Q3_K's 3.4375


@pytest.mark.native
def test_q4_k_m_types_are_llama_quantize_s(tiny_model: Path, tmp_path: Path) -> None:
    from rapidmoe import llama_cpp  # noqa: PLC0415 - the compiled parts (the module imports without them)

    out = tmp_path / "q4km.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 2
    assert llama_cpp.llama_model_quantize(str(tiny_model).encode(), str(out).encode(), ctypes.byref(params)) == 0
    m = read_gguf_shapes(tiny_model)
    rule = q4_k_m_types(m)
    got = {t.name: t.tensor_type.name for t in GGUFFile(out).tensors}
    assert {t.name: rule(t) for t in m.tensors} == got


# --- named shape sets -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SHAPE_SETS))
def test_shape_sets_match_published_counts(name: str) -> None:
    s = SHAPE_SETS[name]
    m = s.model_shapes()
    assert m.params() == pytest.approx(s.published_params, rel=0.02)
    assert m.active_params() == pytest.approx(s.published_active, rel=0.02)


def test_deepseek_v3_numbers() -> None:
    m = get_shape_set("deepseek-v3").model_shapes()
    assert m.moe_layers == list(range(3, 61))
    # the weights README: 36.6B activated without the input embedding table
    assert m.active_params() - 129280 * 7168 == pytest.approx(36.6e9, rel=0.005)
    assert m.kv_cache_bytes(4096) == 61 * 576 * 2 * 4096  # MLA: latent + rope part, K only, F16
    fp = footprint(m, resplit_types(get_preset("paper")), get_preset("paper"))
    routed = 58 * 256 * 3 * 7168 * 2048
    assert fp.routed_bytes == routed * 56 // 256  # IQ1_M: 56 bytes per 256 weights
    assert fp.sidecar == {"WR gate/up residual (Q2_K)": routed * 2 // 3 * 84 // 256,
                          "down copy (Q4_K)": routed // 3 * 144 // 256}


def test_qwen3_kv_cache() -> None:
    assert get_shape_set("qwen3-235b-a22b").model_shapes().kv_cache_bytes(1000) == 94 * 2 * 4 * 128 * 2 * 1000


# --- placement decisions -----------------------------------------------------------------------------------------

TOY = ShapeSet(name="toy", arch="qwen3moe", n_layer=4, n_embd=256, n_vocab=1024, n_head=4, n_head_kv=2,
               head_dim=64, n_expert=8, n_expert_used=2, n_ff_exp=256, published_params=0, published_active=0,
               source="test")
PRESET = get_preset("cpu")


@pytest.fixture(scope="module")
def toy() -> tuple[object, int, int]:
    """The toy model, the GPU bytes of everything but routed experts (reserve 0), one expert's WQ bytes."""
    m = TOY.model_shapes()
    full = plan(m, preset=PRESET, reserve=0)
    expert = footprint(m, resplit_types(PRESET), PRESET).expert_bytes[0]
    return m, full.vram - full.device_bytes(GPU, ROUTED), expert


def test_everything_fits(toy: tuple) -> None:
    m, base, eb = toy
    p = plan(m, preset=PRESET, gpu_mem=base + 32 * eb, cpu_mem=64 << 20, reserve=0)
    assert p.fits and p.scheme == "resplit" and p.vram == base + 32 * eb
    assert p.experts_on_gpu == 32 and p.hit_rate == 1.0
    assert p.device_bytes(CPU, ROUTED) == 0
    assert p.realization.exact and p.realization.args[:2] == ("-ngl", "999")
    assert "--n-cpu-moe" not in p.realization.args


def test_partial_cache_takes_the_hottest_experts(toy: tuple) -> None:
    m, base, eb = toy
    counts = np.ones((4, 8))
    counts[0, 5], counts[2, 1], counts[0, 3] = 50, 40, 30  # layer 0: sum 86, layer 2: sum 47
    freq = ExpertFrequency.from_counts({il: counts[il] for il in range(4)}, "test")
    p = plan(m, preset=PRESET, gpu_mem=base + 3 * eb + eb // 2, reserve=0, frequency=freq)
    assert p.cached == {0: (3, 5), 2: (1,)}
    assert p.hit_rate == pytest.approx((80 / 86 + 40 / 47) / 4)
    assert p.vram == base + 3 * eb and p.device_bytes(CPU, ROUTED) == 29 * eb
    assert not p.realization.exact and p.realization.hit_rate == 0.0  # not one whole layer fits
    assert any("cannot be expressed" in n for n in p.notes)


def test_uniform_cache_spreads_over_layers(toy: tuple) -> None:
    m, base, eb = toy
    p = plan(m, preset=PRESET, gpu_mem=base + 19 * eb, reserve=0)
    assert p.cached == {0: (0, 1, 2, 3, 4), 1: (0, 1, 2, 3, 4), 2: (0, 1, 2, 3, 4), 3: (0, 1, 2, 3)}
    assert p.hit_rate == pytest.approx(19 / 32)
    # whole layers for --n-cpu-moe: 19 experts' bytes hold two layers of 8, the deepest
    assert p.realization.args[:4] == ("-ngl", "999", "--n-cpu-moe", "2") and p.realization.hit_rate == 0.5


def test_too_small_gpu_falls_back_to_cpu_only(toy: tuple) -> None:
    m, base, _ = toy
    p = plan(m, preset=PRESET, gpu_mem=base - 1, reserve=0)
    assert p.scheme == "cpu-only" and p.vram == 0 and p.hit_rate == 0.0 and p.fits
    assert p.realization.args[:2] == ("-ngl", "0") and any("CPU-only" in n for n in p.notes)
    assert plan(m, preset=PRESET, gpu_mem=0).scheme == "cpu-only"
    off, full = plan(m, "cpu-offload", gpu_mem=1024, reserve=0), plan(m, "full-gpu", gpu_mem=1024, reserve=0)
    assert not off.fits and not full.fits and "GPU memory" in off.problems[0]


def test_refine_keeps_every_expert_in_dram(toy: tuple) -> None:
    """Its critical experts are computed on the CPU from the WQ experts: however large the GPU, they stay in DRAM."""
    m, _, _ = toy
    p = plan(m, preset=get_preset("refine"), reserve=0)
    assert p.experts_on_gpu == 0 and p.device_bytes(GPU, ROUTED) == 0
    assert "--n-cpu-moe" in p.realization.args and any("refine codec" in n for n in p.notes)


def test_baselines(toy: tuple) -> None:
    m, _, _ = toy
    off, full = plan(m, "cpu-offload", reserve=0), plan(m, "full-gpu", reserve=0)
    assert off.device_bytes(GPU, ROUTED) == 0 and off.hit_rate == 0.0
    assert off.realization.args == ("-ngl", "999", "--n-cpu-moe", "4", "-c", "4096")
    assert full.device_bytes(CPU, ROUTED) == 0 and full.hit_rate == 1.0
    assert off.vram + off.dram == full.vram + full.dram
    assert off.device_bytes(CPU, ROUTED) == footprint(m, q4_k_m_types(m)).routed_bytes


def test_dram_budget_and_bad_arguments(toy: tuple) -> None:
    m, _, _ = toy
    p = plan(m, preset=PRESET, cpu_mem=1024)
    assert not p.fits and "CPU memory" in p.problems[0]
    with pytest.raises(PlanError):
        plan(m, "nope", preset=PRESET)
    with pytest.raises(PlanError):
        plan(m, preset=None)
    with pytest.raises(PlanError):
        plan(m, preset=PRESET, gpu_mem=-1)


def test_deepseek_v3_under_24_gib() -> None:
    m = get_shape_set("deepseek-v3").model_shapes()
    res, off, full = plan_all(m, get_preset("paper"), gpu_mem=24 * GiB)
    assert res.fits and off.fits and not full.fits
    assert 0 < res.experts_on_gpu < 58 * 256 and res.vram <= 24 * GiB
    assert res.hit_rate == pytest.approx(res.experts_on_gpu / (58 * 256))  # uniform: hit rate = cached share


# --- sizes and frequency tables ----------------------------------------------------------------------------------

def test_parse_size() -> None:
    assert parse_size("24GiB") == 24 * GiB and parse_size("80GB") == 80 * 10**9 and parse_size("1.5G") == 3 * GiB // 2
    assert parse_size("0") == 0 and parse_size("512 MiB") == 512 << 20
    for bad in ("", "-1GiB", "24XB", "GiB"):
        with pytest.raises(SizeError):
            parse_size(bad)


def test_frequency_files(tmp_path: Path) -> None:
    layers = [1, 2]
    np.save(tmp_path / "f.npy", np.array([[0, 0, 0, 0], [1, 3, 0, 0], [0, 0, 0, 0]]))  # rows per layer, dense 0
    f = load_frequency(tmp_path / "f.npy", layers, 3, 4)
    assert f.share[1].tolist() == [0.25, 0.75, 0, 0] and f.share[2].tolist() == [0.25] * 4  # no counts: uniform
    (tmp_path / "f.json").write_text(json.dumps({"1": [1, 1, 1, 1], "2": [0, 0, 0, 2]}))
    assert load_frequency(tmp_path / "f.json", layers, 3, 4).share[2].tolist() == [0, 0, 0, 1]
    (tmp_path / "bad.json").write_text(json.dumps([[1, 2, 3]]))
    with pytest.raises(FrequencyError, match="rows"):
        load_frequency(tmp_path / "bad.json", layers, 3, 4)
    with pytest.raises(FrequencyError, match="experts"):
        load_frequency(tmp_path / "f.json", layers, 3, 8)
    with pytest.raises(FrequencyError, match="not found"):
        load_frequency(tmp_path / "none.npy", layers, 3, 4)


def test_frequency_from_an_imatrix(tmp_path: Path) -> None:
    im = Imatrix(datasets=["t"], chunk_count=1, chunk_size=8)
    for il, c in ((1, [4, 0, 0, 4]), (2, [1, 1, 1, 5])):
        for role in ("up", "gate", "down"):
            im.in_sum2[f"blk.{il}.ffn_{role}_exps.weight"] = np.ones((4, 32), dtype=np.float32)
            im.counts[f"blk.{il}.ffn_{role}_exps.weight"] = np.array(c, dtype=np.float32)
    f = load_frequency(write_imatrix(im, tmp_path / "m.imatrix.gguf"), [1, 2], 3, 4)
    assert f.share[1].tolist() == [0.5, 0, 0, 0.5] and f.share[2].tolist() == [0.125, 0.125, 0.125, 0.625]


# --- the command ---------------------------------------------------------------------------------------------------

def test_plan_command(tmp_path: Path, tiny_qwen: Path) -> None:
    res = runner.invoke(app, ["plan", "--shapes", "deepseek-v3", "--gpu-mem", "24GiB", "--json",
                              str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    assert "routed experts" in res.output and "GPU hit rate" in res.output and "--n-cpu-moe" in res.output
    doc = json.loads((tmp_path / "p.json").read_text())
    assert [p["scheme"] for p in doc["plans"]] == ["resplit", "cpu-offload", "full-gpu"]
    assert [p["fits"] for p in doc["plans"]] == [True, True, False]
    res = runner.invoke(app, ["plan", str(tiny_qwen), "--preset", "cpu", "--reserve", "0"])
    assert res.exit_code == 0, res.output
    assert "yes" in res.output and "-ngl 999" in res.output


@pytest.mark.parametrize("args, message", [
    (["--shapes", "llama-9000"], "unknown shape set 'llama-9000'"),
    (["--shapes", "deepseek-v3", "--gpu-mem", "24XB"], "cannot read memory size '24XB'"),
    (["--shapes", "deepseek-v3", "--preset", "fast"], "unknown preset 'fast'"),
    ([], "give either a MODEL.gguf or --shapes NAME"),
    (["missing.gguf"], "model file not found"),
    (["--shapes", "qwen3-30b-a3b", "--freq", "missing.npy"], "frequency file not found"),
])
def test_plan_errors_are_one_line(args: list[str], message: str) -> None:
    res = runner.invoke(app, ["plan", *args])
    assert res.exit_code == 1
    assert f"rapidmoe-cli: error: {message}" in res.output
    assert "Traceback" not in res.output
