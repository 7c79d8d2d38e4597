"""Split routing with the refine codec ("q3k-refine1": a Q3_K base fitted for a finer grid, one refinement bit per
weight in the sidecar) against independent references: r = 0 is the .wq.gguf alone bit for bit (the refine op's zero
rows added to the masked WQ matmul), r = k is an F32 model of the refined experts (numpy decoding, tests/reference),
0 < r < k a numpy split MoE layer, and the combinations the codec does not run are refused."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from reference.critical_model import write_with_experts
from reference.gguf_copy import rewrite
from reference.numpy_forward import ffn, load, route
from reference.refine import refined
from reference.split_logits import all_logits as _logits
from reference.split_logits import prompt_tokens as _tokens
from reference.split_logits import rel_error as _rel

from rapidmoe import Llama, RapidMoEError, _core
from rapidmoe.cache import ExpertCacheConfig
from rapidmoe.ggufio import GGUFFile, tensor_f32

PRESET = "refine-q8"


@pytest.fixture(scope="module", params=["qwen3moe", "deepseek2"])
def refine_pair(request: pytest.FixtureRequest, make_split):  # type: ignore[no-untyped-def]
    return make_split(request.param, PRESET)




def _refined_experts(wq: GGUFFile, wr: GGUFFile, stem: str) -> np.ndarray:
    """[n_expert, n_out, n_in] float64: the base tensor's Q3_K rows refined by the sidecar's bit plane."""
    base = wq.tensor(f"{stem}.weight")
    assert base.tensor_type == GGMLQuantizationType.Q3_K
    raw = np.asarray(base.data, dtype=np.uint8)
    bits = np.asarray(wr.tensor(f"{stem}.rf").data).view(np.uint8)
    n_in = int(base.shape[0])
    return refined(raw.reshape(-1, raw.shape[-1]), bits.reshape(-1, n_in // 8), n_in).reshape(*raw.shape[:-1], n_in)


def _write_refined_model(wq: Path, wr: Path, out: Path) -> None:
    """The r = k reference: the .wq.gguf with its routed experts replaced by the refined weights in F32."""
    base, side = GGUFFile(wq), GGUFFile(wr)
    write_with_experts(wq, out, lambda t: _refined_experts(base, side, t.name.removesuffix(".weight")))


def test_the_pair_is_a_q3k_base_and_bit_planes(refine_pair) -> None:  # type: ignore[no-untyped-def]
    _, wq, wr = refine_pair
    base, side = GGUFFile(wq), GGUFFile(wr)
    experts = [t for t in base.tensors if t.name.endswith("_exps.weight")]
    assert experts and all(t.tensor_type == GGMLQuantizationType.Q3_K for t in experts)
    planes = {t.name: t for t in side.tensors}
    for t in experts:
        p = planes[t.name.removesuffix(".weight") + ".rf"]
        assert p.tensor_type == GGMLQuantizationType.I8
        assert [int(x) for x in p.shape] == [int(t.shape[0]) // 8, *[int(x) for x in t.shape[1:]]]
    assert len(planes) == len(experts)


def test_r0_is_the_wq_file_alone_bit_for_bit(refine_pair) -> None:  # type: ignore[no-untyped-def]
    """No slot critical: the masked WQ matmul computes every slot with upstream's kernel and the refine op adds zero
    rows, so the logits are those of the .wq.gguf without a sidecar (llama.cpp's own graph), bit for bit."""
    _, wq, wr = refine_pair
    toks = _tokens(wq)
    np.testing.assert_array_equal(_logits(wq, toks, residual_path=wr, n_critical=0), _logits(wq, toks))


def test_r_equal_k_matches_the_refined_model(refine_pair, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, wq, wr = refine_pair
    toks = _tokens(wq)
    ref_path = tmp_path / "refined.gguf"
    _write_refined_model(wq, wr, ref_path)
    ref = _logits(ref_path, toks)  # no sidecar: llama.cpp's graph on F32 experts
    f = GGUFFile(wq)
    k = int(f.get(f"{f.get('general.architecture')}.expert_used_count"))
    full = _logits(wq, toks, residual_path=wr, n_critical=k)
    low = _logits(wq, toks, residual_path=wr, n_critical=0)
    # the refine op quantizes activations to Q8_K (as ggml's K-quant dot products do): float-level, not bitwise
    assert _rel(full, ref) < 0.03, _rel(full, ref)
    assert _rel(full, ref) < 0.35 * _rel(low, ref), (_rel(full, ref), _rel(low, ref))
    assert (full.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_partial_r_matches_numpy_split_layer(refine_pair) -> None:  # type: ignore[no-untyped-def]
    """r = 1: each token's highest-weight slot runs the refined expert, the others the Q3_K base (numpy, from the
    files), with the router and hyperparameters from the F16 source."""
    src, wq, wr = refine_pair
    toks = _tokens(wq)
    f = GGUFFile(wq)
    arch = f.get("general.architecture")
    k = int(f.get(f"{arch}.expert_used_count"))
    il = int(f.get(f"{arch}.leading_dense_block_count", 0))
    cap = _core.TensorCapture([f"ffn_norm-{il}", f"ffn_moe_out-{il}"])
    llm = Llama(wq, n_ctx=128, logits_all=True, verbose=False, residual_path=wr, n_critical=1, eval_callback=cap)
    llm.eval(toks)
    llm.close()
    h = cap.get(f"ffn_norm-{il}")[-1].reshape(len(toks), -1).astype(np.float64)
    got = cap.get(f"ffn_moe_out-{il}")[-1].reshape(len(toks), -1).astype(np.float64)
    m = load(src)
    p = f"blk.{il}."
    ds = m.arch == "deepseek2"
    gating = {1: "softmax", 2: "sigmoid"}[m.hp("expert_gating_func", 1)] if ds else "softmax"
    experts, w = route(h, m.w(p + "ffn_gate_inp.weight"), k, gating,
                       m.w(p + "exp_probs_b.bias") if m.has(p + "exp_probs_b.bias") else None,
                       m.hp("expert_group_count", 0), m.hp("expert_group_used_count", 0),
                       bool(m.hp("expert_weights_norm", True)) if ds else True, m.hp("expert_weights_scale", 0.0))
    side = GGUFFile(wr)
    lo = {n: tensor_f32(f.tensor(f"{p}ffn_{n}_exps.weight")).astype(np.float64) for n in ("gate", "up", "down")}
    hi = {n: _refined_experts(f, side, f"{p}ffn_{n}_exps") for n in ("gate", "up", "down")}
    out = np.zeros((len(toks), k, h.shape[1]))
    refs = []
    for r in range(k + 1):
        for t in range(len(toks)):
            order = np.argsort(-w[t], kind="stable")
            for slot in range(k):
                src_w = hi if slot in order[:r] else lo
                e = experts[t, slot]
                out[t, slot] = ffn(h[t:t + 1], src_w["gate"][e], src_w["up"][e], src_w["down"][e])[0]
        refs.append(np.einsum("ts,tsd->td", w, out))
    errs = {r: _rel(got, ref) for r, ref in enumerate(refs)}
    assert errs[1] < 0.06, errs
    assert all(errs[1] < 0.7 * e for r, e in errs.items() if r != 1), errs


def test_refine_does_not_combine_with_an_expert_cache(refine_pair) -> None:  # type: ignore[no-untyped-def]
    _, wq, wr = refine_pair
    with pytest.raises(RapidMoEError, match="does not combine with expert_cache"):
        Llama(wq, n_ctx=64, verbose=False, residual_path=wr,
              expert_cache=ExpertCacheConfig(experts={1: [0]}, device="CPU"))


def test_the_loader_refuses_a_sidecar_its_codec_does_not_match(  # type: ignore[no-untyped-def]
        refine_pair, make_split, tmp_path: Path) -> None:
    """The C++ loader reads the sidecar's codec key into the layer's codec id (absent: the residual codec), which the
    graph dispatches on (the other tests here run it), and refuses a key it does not know or tensors that are not
    that codec's. Attached straight through the C API: the Python pair check would refuse these first."""
    src, wq, wr = refine_pair
    _, cpu_wq, cpu_wr = make_split(GGUFFile(src).get("general.architecture"), "cpu")
    key = "rapidmoe.residual.codec"
    cases = [
        (wq, rewrite(wr, tmp_path / "other.wr.gguf", drop_keys=(key,), strings={key: "q3k-refine2"}),
         "codec \"q3k-refine2\" is not one this build runs"),
        (wq, rewrite(wr, tmp_path / "none.wr.gguf", drop_keys=(key,)), r"\.rf is not one of the residual codec"),
        (cpu_wq, rewrite(cpu_wr, tmp_path / "refine.wr.gguf", drop_keys=(key,), strings={key: "q3k-refine1"}),
         r"\.(wr|hi) is not one of the refine codec"),
    ]
    for base, side, message in cases:
        llm = Llama(base, n_ctx=64, verbose=False)
        try:
            with pytest.raises(ValueError, match=message):
                _core.attach_residual(llm._model.model, str(side))
        finally:
            llm.close()

