"""MoE architectures beyond the two we generate: llama.cpp's own random-weight models (tests/test-llama-archs -o of
the pinned source, built into the stock build) through run, convert and split routing, against stock llama.cpp.

The default run covers a few architectures that between them take every path (separate and merged gate/up,
per-expert biases and scales, weights applied before the FFN, grouped sigmoid routing); the whole set runs with
`python -m pytest tests/conversion/test_archs.py -m arch_sweep` (also `python tools/arch_sweep.py`, which fills the
table in docs/resplit.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from arch_sweep import make_models, sweep_one
from gguf import GGUFValueType
from reference.gguf_copy import rewrite

from rapidmoe import Llama, ModelFileError
from rapidmoe._runtime import _core
from rapidmoe.calibration.measure import calibrate_latency
from rapidmoe.ggufio import GGUFFile, tensor_f32
from rapidmoe.placement.cache.config import CachePolicyError
from rapidmoe.placement.cache.moepic import moepic_for_cache, moepic_layers, wq_expert_bytes
from rapidmoe.resplit import convert, get_preset
from rapidmoe.synthetic import spec_for, write_model
from rapidmoe.trace import read_trace

pytestmark = [pytest.mark.native, pytest.mark.stock]

# gpt-oss: biases, per-expert scales, its own gated activation; qwen35moe: merged gate_up in a hybrid (SSM) model;
# deepseek2: merged gate_up, shared expert, grouped sigmoid routing; llama4: router weights applied before the FFN
DEFAULT_ARCHS = ("gpt-oss", "qwen35moe", "deepseek2", "llama4")


@pytest.fixture(scope="session")
def arch_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("arch-models"))


@pytest.fixture(scope="session")
def sweep(arch_models: dict[str, Path], stock_bin: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    work = tmp_path_factory.mktemp("arch-sweep")
    return lambda arch: sweep_one(arch_models[arch], work / arch, stock_bin)


def _check_split(r) -> None:  # type: ignore[no-untyped-def]
    assert r.runs and r.converts, r
    assert r.r0_exact, f"{r.arch}: r = 0 differs from stock llama.cpp on the .wq.gguf ({r.note})"
    assert r.err_rk is not None and r.err_r0 is not None
    assert r.err_rk < r.err_r0, f"{r.arch}: r = k ({r.err_rk:.4f}) is not closer to the F32 experts than r = 0 " \
                                f"({r.err_r0:.4f})"


@pytest.mark.parametrize("arch", DEFAULT_ARCHS)
def test_architecture_runs_converts_and_splits(sweep, arch: str) -> None:  # type: ignore[no-untyped-def]
    _check_split(sweep(arch))


# refusals the sweep accepts, each a one-line message of RapidMoE's (never a crash or a traceback)
CLEAN_REFUSALS = {
    "runs": ("non-causal attention", "diffusion model", "encoder-only"),
    "converts": ("has no routed-expert tensors",),
}


@pytest.mark.arch_sweep
def test_every_moe_architecture(arch_models: dict[str, Path], sweep) -> None:  # type: ignore[no-untyped-def]
    """The full set: every MoE model either passes all checks or is refused with one of the known reasons."""
    bad = []
    for arch in sorted(arch_models):
        r = sweep(arch)
        try:
            if r.runs is False:
                assert any(s in r.note for s in CLEAN_REFUSALS["runs"]), r.note
            elif r.converts is False:
                assert any(s in r.note for s in CLEAN_REFUSALS["converts"]), r.note
            elif "split routing cannot apply" in r.note:
                # accepted only where the model's graph does not use its routed experts at all (refact)
                assert r.experts_unused, r.note
            else:
                _check_split(r)
        except AssertionError as e:
            bad.append(f"{arch}: {e}")
    assert not bad, "\n".join(bad)


def test_fallback_types_are_recorded_and_shown(arch_models: dict[str, Path], tmp_path: Path) -> None:
    """Rows of 384 (test-llama-archs' n_ff) do not fit Q2_K/Q4_K blocks: down takes llama-quantize's fallbacks,
    recorded in the report, the sidecar and the .wq.gguf, and listed by inspect."""
    res = convert(arch_models["qwen3moe"], tmp_path, get_preset("cpu"), progress=False)
    side, base = GGUFFile(res.wr_path), GGUFFile(res.wq_path)
    down = base.tensor("blk.0.ffn_down_exps.weight")
    assert int(down.shape[0]) % 256 != 0
    assert down.tensor_type.name == "Q4_0"  # llama-quantize's Q2_K fallback
    assert side.tensor("blk.0.ffn_down_exps.hi").tensor_type.name == "Q5_0"  # its Q4_K fallback
    assert base.tensor("blk.0.ffn_gate_exps.weight").tensor_type.name == "Q2_K"  # 256 fits: no fallback
    want = {"blk.0.ffn_down_exps.weight wq Q2_K->Q4_0", "blk.0.ffn_down_exps.weight sidecar Q4_K->Q5_0"}
    assert want <= set(side.get("rapidmoe.residual.type_fallbacks"))
    assert want <= set(base.get("rapidmoe.resplit.type_fallbacks"))
    assert want <= set(json.loads(res.report_path.read_text())["type_fallbacks"])
    out = subprocess.run([sys.executable, "-m", "rapidmoe.cli", "inspect", str(res.wq_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "blk.0.ffn_down_exps.weight wq Q2_K->Q4_0" in out.stdout, out.stdout


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rapidmoe.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("arch", ["llada-moe", "rnd1"])
def test_diffusion_models_are_refused_in_one_line(arch_models: dict[str, Path], arch: str) -> None:
    res = _cli("run", str(arch_models[arch]), "-p", "hi", "-n", "2")
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rapidmoe-cli: error:") and "non-causal" in lines[0], lines


def test_diffusion_refused_by_llama_cpp_classification(arch_models: dict[str, Path], tmp_path: Path) -> None:
    """Without the attention.causal key the header says nothing: llama.cpp's own llama_model_is_diffusion does,
    after the load and before a context exists (which for such a model stock llama-cpp-python cannot make)."""
    src = rewrite(arch_models["llada-moe"], tmp_path / "llada.gguf", drop_keys=("llada-moe.attention.causal",))
    with pytest.raises(ModelFileError, match="diffusion model"):
        Llama(src, n_ctx=64, verbose=False)


def test_vocab_only_gguf_is_refused_by_every_command(arch_models: dict[str, Path], tmp_path: Path) -> None:
    src = arch_models["qwen3moe"]  # its header (MoE hyperparameters, tokenizer) without any tensor
    vocab = rewrite(src, tmp_path / "vocab.gguf", drop_tensors=tuple(t.name for t in GGUFFile(src).tensors))
    for args in (["run", str(vocab), "-p", "hi", "-n", "2"], ["convert", str(vocab), "-o", str(tmp_path)],
                 ["serve", str(vocab), "--port", "0"]):
        res = _cli(*args)
        assert res.returncode == 1 and "Traceback" not in res.stderr, (args, res.stderr)
        # serve logs where it listens before it loads the model; the error is then its last line
        lines = [ln for ln in res.stderr.strip().splitlines() if not ln.startswith("WARNING rapidmoe.server")]
        assert len(lines) == 1 and lines[0].startswith("rapidmoe-cli: error:"), (args, lines)
        assert "vocab-only" in lines[0] or "no routed-expert tensors" in lines[0], lines
    res = _cli("inspect", str(vocab))
    assert res.returncode == 0 and "not runnable" in res.stdout and "vocab-only" in res.stdout, res.stdout
    llm = Llama(vocab, vocab_only=True, verbose=False)  # loading the tokenizer alone still works
    assert llm.n_vocab() == len(GGUFFile(src).get("tokenizer.ggml.tokens"))
    llm.close()


def test_conversion_refuses_an_incomplete_expert_layer(arch_models: dict[str, Path], tmp_path: Path) -> None:
    src = rewrite(arch_models["qwen3moe"], tmp_path / "nogate.gguf", drop_tensors=("blk.1.ffn_gate_exps.weight",))
    with pytest.raises(ModelFileError, match=r"blk\.1\.ffn_(up|down)_exps\.weight: layer 1 has routed experts down/up"):
        convert(src, tmp_path / "out", get_preset("cpu"), progress=False)


def test_array_keys_survive_conversion(arch_models: dict[str, Path], tmp_path: Path) -> None:
    """Non-empty array keys are copied exactly; empty ones (gguf-py cannot write them) are left out."""
    src = GGUFFile(arch_models["qwen3moe"])
    res = convert(arch_models["qwen3moe"], tmp_path, get_preset("cpu"), progress=False)
    wq = GGUFFile(res.wq_path)
    for k, f in src.fields.items():
        if f.vtype == GGUFValueType.ARRAY and not k.startswith("GGUF."):
            assert wq.get(k) == (f.value if f.value else None), k


def test_a_layer_the_split_cannot_reach_is_refused_at_load(vocab_dir: Path, tmp_path: Path) -> None:
    """65 experts per token is beyond what the split handles (64): the hook leaves that layer stock, and the load
    says so instead of silently running without the sidecar. The same model at k = 8 splits."""
    for k, n_expert in ((65, 66), (8, 66)):
        src = tmp_path / f"k{k}.gguf"
        write_model(spec_for("qwen3moe", "tiny", n_layer=1, n_embd=128, n_ff_exp=64, n_expert=n_expert,
                             n_expert_used=k), src, vocab_dir)
        res = convert(src, tmp_path / f"out{k}", get_preset("cpu-q8"), progress=False)
        if k > 64:
            with pytest.raises(ModelFileError, match=r"split routing cannot apply to MoE layer\(s\) 0"):
                Llama(res.wq_path, residual_path=res.wr_path, n_critical=1, n_ctx=64, verbose=False)
        else:
            llm = Llama(res.wq_path, residual_path=res.wr_path, n_critical=1, n_ctx=64, verbose=False)
            llm.eval(llm.tokenize(b"hello world"))
            assert sum(c.critical_slots for c in llm.moe_counters()) > 0
            llm.close()


# what each graph names a layer's normalised FFN input, the reference for the trace's next-layer predictions (the
# recorder reads the router matmul's input, whatever its name)
FFN_INPUT = {"deepseek2": "ffn_norm", "hy_v3": "ffn_norm", "qwen35moe": "attn_post_norm"}


@pytest.mark.parametrize("arch", sorted(FFN_INPUT))
def test_merged_gate_up_layers_are_seen_by_trace_calibration_and_moepic(arch_models: dict[str, Path], arch: str,
                                                                        tmp_path: Path) -> None:
    """Models whose MoE layers store gate and up as one ffn_gate_up_exps tensor (deepseek2: layer 0 dense, layer 1
    MoE; hy_v3 and qwen35moe: every layer MoE, so the trace's next-layer predictions too): tracing, the latency
    calibration's layer count and the MoEpic planner see every MoE layer, as conversion does (they once counted
    ffn_up_exps tensors and saw none). The predictions are the next layer's router applied to the FFN input, which
    qwen35moe's graph names attn_post_norm (tracing it once failed, reading ffn_norm)."""
    src = arch_models[arch]
    names = [t.name for t in GGUFFile(src).tensors]
    assert any(n.endswith(".ffn_gate_up_exps.weight") for n in names)
    assert not any(n.endswith(".ffn_up_exps.weight") for n in names)
    # the reference, apart from the expert tensors' names: the layers with a router
    want = sorted(int(n.split(".")[1]) for n in names if n.endswith(".ffn_gate_inp.weight"))
    assert want
    out = tmp_path / "r.trace"
    llm = Llama(src, n_ctx=64, n_batch=16, n_ubatch=16, logits_all=True, verbose=False, n_threads=2, trace=out)
    try:
        llm.eval(list(range(1, 9)))
    finally:
        llm.close()
    tr = read_trace(out)
    assert list(tr.header.moe_layers) == want and tr.n_tokens == 8
    ids, pred = tr.token_matrix()
    assert ids.shape == (8, len(want), tr.header.k) and (ids >= 0).all()  # every layer routed every token
    assert tr.predicted == (len(want) > 1)
    if pred is not None:  # against the next router on the named FFN input, captured by a second run
        cap = _core.TensorCapture([f"{FFN_INPUT[arch]}-{il}" for il in want[:-1]])
        llm = Llama(src, n_ctx=64, n_batch=16, n_ubatch=16, logits_all=True, verbose=False, n_threads=2,
                    eval_callback=cap)
        try:
            llm.eval(list(range(1, 9)))
        finally:
            llm.close()
        gf = GGUFFile(src)
        for m, il in enumerate(want[:-1]):
            x = np.concatenate([a.reshape(-1, a.shape[-1]) for a in cap.get(f"{FFN_INPUT[arch]}-{il}")])
            score = x @ tensor_f32(gf.tensor(f"blk.{want[m + 1]}.ffn_gate_inp.weight")).T
            if gf.get(f"{gf.get('general.architecture')}.expert_gating_func") == 2:  # sigmoid (+ selection bias)
                score = 1.0 / (1.0 + np.exp(-score))
                bias = f"blk.{want[m + 1]}.exp_probs_b.bias"
                if any(t.name == bias for t in gf.tensors):
                    score = score + tensor_f32(gf.tensor(bias))
            top = np.argsort(-score, axis=1, kind="stable")[:, : tr.header.k]
            assert np.array_equal(np.sort(pred[:, m + 1], axis=1), np.sort(top, axis=1)), (arch, il)
    res = convert(src, tmp_path / "conv", get_preset("cpu"), progress=False)
    lat = calibrate_latency(res.wq_path, res.wr_path, threads=2, r_values=[0, 1, 2], drop_r_values=[1],
                            decode_tokens=2, prefill_batch=8, repeats=1, progress=False)
    assert lat.n_moe_layers == len(want)
    # one expert's bytes per layer, as stored: every routed-expert tensor of the layer (gate_up and down)
    wq = GGUFFile(res.wq_path)
    per_expert = {il: sum(int(t.n_bytes) // int(t.shape[2]) for t in wq.tensors
                          if t.name.startswith(f"blk.{il}.") and t.name.endswith("_exps.weight")) for il in want}
    assert wq_expert_bytes(res.wq_path, want) == per_expert
    settings = moepic_for_cache(res.wq_path, {il: [0] for il in want})
    splits, caps = settings.per_layer(len(want))
    assert len(splits) == len(caps) == len(want)
    # the run-time split of a layer into top and bottom rows does not take merged gate_up (nor does the C++ cache)
    with pytest.raises(CachePolicyError, match="merged gate_up"):
        moepic_layers(res.wq_path, want, splits, caps, 1)
