"""UMIA: the in-graph arbitration op against a numpy reference (every modulation, edge cases), policy validation,
and the policy reaching the model (histograms, phases, equivalences with fixed r and the drop baseline)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from testkit import repeated_text

import rapidmoe
from rapidmoe import RapidMoEError
from rapidmoe.umia import Policy, PolicyError, load_policy
from rapidmoe.umia.arbitration import critical_ids, n_critical

N_LAYER = 5
MOE_LAYERS = [1, 2, 3, 4]  # layer 0 dense, as in deepseek2


def _tau_reference(theta: float, alpha: float, beta: float, m: int, n_moe: int, prefill: bool,
                   cutoff: float = 1.0) -> float:
    """The documented threshold, written out independently of Policy.thresholds."""
    depth = m / (n_moe - 1) if n_moe > 1 else 0.0
    if not prefill and depth > cutoff:
        return 0.0
    tau = theta * (1.0 + alpha * (1.0 - depth)) * ((1.0 + beta) if prefill else 1.0)
    return min(max(tau, 0.0), 1.0)


def _r_loop(w: np.ndarray, tau: float, r_min: int, r_max: int) -> np.ndarray:
    """Per-token loop version of the rule (the slowest, plainest statement of it)."""
    out = []
    for row in w:
        k = len(row)
        order = sorted(range(k), key=lambda j: -row[j])  # sorted() is stable: ties keep slot order
        total = sum(float(row[j]) for j in order)
        t = float(np.float32(tau))
        if t <= 0:
            r = 0
        else:
            cum, r = 0.0, k
            for i, j in enumerate(order):
                cum += float(row[j])
                if cum >= min(t, 1.0) * total:
                    r = i + 1
                    break
        out.append(min(max(r, min(r_min, k)), min(max(r_max, r_min), k)))
    return np.array(out)


def _run_op(w: np.ndarray, policy: Policy, il: int, phase: int) -> tuple[np.ndarray, np.ndarray]:
    arr = policy.to_array(N_LAYER, MOE_LAYERS, w.shape[1])
    return rapidmoe._core.umia_eval(np.ascontiguousarray(w, dtype=np.float32), arr, il, phase)


def _router_weights(rng: np.random.Generator, T: int, k: int) -> np.ndarray:
    """Softmax-like top-k weights with a spread of peakedness (some tokens flat, some one-expert)."""
    logits = rng.normal(size=(T, k)) * rng.uniform(0.1, 4.0, size=(T, 1))
    w = np.exp(logits)
    return (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.native
@pytest.mark.parametrize("phase", [0, 1])
@pytest.mark.parametrize("policy", [
    Policy(theta=0.5),
    Policy(theta=0.5, alpha=0.6),
    Policy(theta=0.4, alpha=0.3, beta=0.5),
    Policy(theta=0.7, alpha=1.0, beta=1.0, r_min=1, r_max=3),
    Policy(theta=0.3, beta=0.8, phase="decode"),
    Policy(theta=0.3, beta=0.8, phase="prefill"),
    Policy(theta=0.9, layer_scale=[1.1, 0.5, 0.9, 1.0]),  # type: ignore[arg-type]  # a list, as JSON has it
    Policy(theta=0.6, alpha=0.2, beta=0.3, depth_cutoff=0.5),
], ids=lambda p: p.describe() if isinstance(p, Policy) else str(p))
def test_op_matches_numpy_every_layer_and_phase(policy: Policy, phase: int) -> None:
    rng = np.random.default_rng(7)
    k, T = 8, 300
    w = _router_weights(rng, T, k)
    for m, il in enumerate(MOE_LAYERS):
        ids, hist = _run_op(w, policy, il, phase)
        eff_phase = {"auto": phase, "decode": 0, "prefill": 1}[policy.phase]
        if policy.layer_scale is not None:
            tau = min(policy.theta * policy.layer_scale[m] * ((1 + policy.beta) if eff_phase else 1.0), 1.0)
        else:
            tau = _tau_reference(policy.theta, policy.alpha, policy.beta, m, len(MOE_LAYERS), eff_phase == 1,
                                 policy.depth_cutoff)
        r_max = k if policy.r_max is None else policy.r_max
        r_loop = _r_loop(w, tau, policy.r_min, r_max)
        np.testing.assert_array_equal(n_critical(w, tau, policy.r_min, r_max), r_loop)
        want = critical_ids(w, np.tile(np.arange(k), (T, 1)), r_loop)
        np.testing.assert_array_equal(ids, want, err_msg=f"layer {il} phase {phase}")
        np.testing.assert_array_equal(hist, np.bincount(r_loop, minlength=k + 1))
    # the modulations really move r: shallow layers and prefill never get fewer critical experts
    rs = [(_run_op(w, policy, il, phase)[0] >= 0).sum() for il in MOE_LAYERS]
    if policy.alpha > 0 and policy.layer_scale is None:
        assert rs[0] >= rs[-1]
        if policy.r_max is None:
            assert rs[0] > rs[-1]


@pytest.mark.native
def test_op_edge_cases() -> None:
    k = 4
    # ties: equal weights keep the router's slot order
    ids, _ = _run_op(np.full((3, k), 0.25, np.float32), Policy(theta=0.5), 1, 0)
    np.testing.assert_array_equal(ids, np.tile([0, 1, -1, -1], (3, 1)))
    tie = np.array([[0.1, 0.3, 0.3, 0.3]], np.float32)
    np.testing.assert_array_equal(_run_op(tie, Policy.fixed(2), 1, 0)[0], [[-1, 1, 2, -1]])
    # r_min = r_max: fixed r whatever the weights and theta
    w = _router_weights(np.random.default_rng(1), 50, k)
    for r in range(k + 1):
        ids, hist = _run_op(w, Policy(theta=0.2, r_min=r, r_max=r), 2, 1)
        assert ((ids >= 0).sum(axis=1) == r).all() and hist[r] == 50
    # theta = 0: nobody is critical (unless r_min); theta = 1: everybody
    assert (_run_op(w, Policy(theta=0.0), 1, 0)[0] < 0).all()
    assert ((_run_op(w, Policy(theta=0.0, r_min=1), 1, 0)[0] >= 0).sum(axis=1) == 1).all()
    assert (_run_op(w, Policy(theta=1.0), 1, 0)[0] >= 0).all()
    # k = 1
    one = np.array([[1.0], [0.5]], np.float32)
    np.testing.assert_array_equal(_run_op(one, Policy(theta=0.5), 1, 0)[0], [[0], [0]])
    np.testing.assert_array_equal(_run_op(one, Policy(theta=0.5, r_max=0), 1, 0)[0], [[-1], [-1]])
    # weights without a positive mass: all critical (bounded by r_max)
    zero = np.zeros((1, k), np.float32)
    assert (_run_op(zero, Policy(theta=0.5), 1, 0)[0] >= 0).sum() == k
    assert (_run_op(zero, Policy(theta=0.5, r_max=2), 1, 0)[0] >= 0).sum() == 2
    # unnormalised weights (sigmoid routing without renormalisation): the threshold is relative to the sum
    w2 = np.array([[4.0, 3.0, 2.0, 1.0]], np.float32)
    np.testing.assert_array_equal(_run_op(w2, Policy(theta=0.7), 1, 0)[0], [[0, 1, -1, -1]])
    with pytest.raises(ValueError, match="bad arguments"):
        rapidmoe._core.umia_eval(w, Policy().to_array(N_LAYER, MOE_LAYERS, k), N_LAYER, 0)


@pytest.mark.parametrize("doc, match", [
    ({"theta": 0.5, "gamma": 1}, "unknown key.*gamma"),
    ({"theta": 1.5}, r"theta must be in \[0, 1\]"),
    ({"theta": "high"}, "theta must be a number"),
    ({"theta": True}, "theta must be a number"),
    ({"alpha": -0.1}, "alpha must be in"),
    ({"depth_cutoff": 1.5}, r"depth_cutoff must be in \[0, 1\]"),
    ({"beta": 11}, "beta must be in"),
    ({"r_min": 3, "r_max": 2}, r"r_max \(2\) must be >= r_min \(3\)"),
    ({"r_min": 1.5}, "r_min must be an integer"),
    ({"r_max": 65}, "r_max must be in 0..64"),
    ({"phase": "warmup"}, "phase must be one of auto, decode, prefill"),
    ({"layer_scale": []}, "layer_scale must be a non-empty list"),
    ({"layer_scale": [1, "x"]}, "layer_scale values must be numbers"),
    ({"format": "something-else"}, "format is 'something-else'"),
    ({"version": 99}, "version 99 is not supported"),
    ([1, 2], "a UMIA policy is a JSON object"),
])
def test_policy_json_refused_with_clear_errors(tmp_path: Path, doc: object, match: str) -> None:
    p = tmp_path / "policy.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(PolicyError, match=match):
        load_policy(p)


def test_policy_files(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{theta: 1")
    with pytest.raises(PolicyError, match="not valid JSON"):
        load_policy(tmp_path / "bad.json")
    pol = Policy(theta=0.55, alpha=0.3, beta=0.4, r_min=1, r_max=6, meta={"calibrated_on": "x"})
    assert load_policy(pol.save(tmp_path / "p.json")) == pol
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(PolicyError, match="layer_scale has 2 values, the model has 4 MoE layers"):
        Policy(layer_scale=[1.0, 1.0]).to_array(N_LAYER, MOE_LAYERS, 8)  # type: ignore[arg-type]



def _scores(llm: rapidmoe.Llama, toks: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(toks)
    return np.array(llm.scores[: len(toks)], dtype=np.float64)


@pytest.mark.native
@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_policy_in_the_model(make_split, arch: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, wq, wr = make_split(arch)
    llm = rapidmoe.Llama(wq, residual_path=wr, n_ctx=128, logits_all=True, verbose=False, n_threads=2)
    assert llm.residual is not None
    k = llm.residual.n_expert_used
    toks = llm.tokenize(repeated_text(2))[:40]
    fixed = {r: (llm.set_n_critical(r), _scores(llm, toks))[1] for r in (0, k)}
    llm.r_histogram(reset=True)
    # theta = 1 is fixed r = k, theta = 0 is fixed r = 0, bit for bit
    llm.set_policy(Policy(theta=1.0))
    np.testing.assert_array_equal(_scores(llm, toks), fixed[k])
    llm.set_policy(Policy(theta=0.0))
    np.testing.assert_array_equal(_scores(llm, toks), fixed[0])
    # an adaptive policy from a JSON file: r varies per token, shallow layers get more, the result lies between
    path = Policy(theta=0.75, alpha=0.3).save(tmp_path / "p.json")
    llm.set_policy(str(path))
    llm.r_histogram(reset=True)
    mid = _scores(llm, toks)
    h = llm.r_histogram()
    assert h.tokens(phase=1) == len(toks) and h.tokens(phase=0) == 0  # one batch of 40 tokens: prefill
    mean = h.mean_r(phase=1)
    assert 0 < mean.mean() < k and mean[0] > mean[-1]
    assert (h.counts[:, 1] > 0).sum(axis=1).max() >= 2  # more than one r value in a layer: adaptive
    assert not np.array_equal(mid, fixed[0]) and not np.array_equal(mid, fixed[k])
    # phases: a one-token step after the prompt is decode; beta raises prefill thresholds only
    llm.set_policy(Policy(theta=0.3, beta=2.0))
    llm.reset()
    llm.r_histogram(reset=True)
    llm.eval(toks[:10])
    llm.eval(toks[10:11])
    h = llm.r_histogram()
    assert h.tokens(phase=1) == 10 and h.tokens(phase=0) == 1
    assert h.mean_r(phase=1).mean() > h.mean_r(phase=0).mean()
    # forcing the phase applies decode thresholds to the prompt batch
    llm.set_policy(Policy(theta=0.3, beta=2.0, phase="decode"))
    llm.r_histogram(reset=True)
    _scores(llm, toks[:10])
    forced = llm.r_histogram()
    assert forced.tokens(phase=1) == 10  # counted under the graph's phase, with the decode threshold
    assert forced.mean_r(phase=1).mean() < h.mean_r(phase=1).mean()
    # counters agree with the histogram
    c = llm.moe_counters()
    assert sum(x.critical_slots for x in c) == pytest.approx(forced.critical_slots_per_token(1) * 10)
    llm.close()


@pytest.mark.native
def test_drop_baseline(make_split) -> None:  # type: ignore[no-untyped-def]
    _, wq, wr = make_split("qwen3moe")
    toks = rapidmoe.Llama(wq, n_ctx=64, vocab_only=True, verbose=False).tokenize(repeated_text(2))[:24]
    normal = rapidmoe.Llama(wq, residual_path=wr, n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    drop = rapidmoe.Llama(wq, residual_path=wr, n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                 skip_noncritical=True)
    assert normal.residual is not None
    k = normal.residual.n_expert_used
    for llm in (normal, drop):
        llm.set_n_critical(k)
    # all experts critical: dropping nothing changes nothing
    np.testing.assert_allclose(_scores(drop, toks), _scores(normal, toks), rtol=0, atol=1e-4)
    normal.set_n_critical(1)
    drop.set_n_critical(1)
    full, one_wq, one_drop = None, _scores(normal, toks), _scores(drop, toks)
    normal.set_n_critical(k)
    full = _scores(normal, toks)
    # keeping the non-critical experts in WQ is closer to full precision than dropping them
    assert np.abs(one_wq - full).mean() < np.abs(one_drop - full).mean()
    normal.close()
    drop.close()


@pytest.mark.native
def test_policy_needs_a_sidecar(tiny_qwen: Path) -> None:
    with pytest.raises(RapidMoEError, match="need a residual sidecar"):
        rapidmoe.Llama(tiny_qwen, policy=Policy(theta=0.5), verbose=False)
