"""UMIA calibration: the latency model fit on synthetic timings with known coefficients, frontier extraction and
choice on synthetic point sets, and the two CLI commands end to end on a tiny RESplit pair."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from rapidmoe import RapidMoEError
from rapidmoe.calibration.umia import pick_chunks, theta_for_level
from rapidmoe.cli.app import app
from rapidmoe.umia import Policy, load_policy
from rapidmoe.umia.arbitration import n_critical
from rapidmoe.umia.frontier import choose, knee, pareto
from rapidmoe.umia.latency import Point, fit, load_latency_model

N_MOE, K = 6, 8
TRUE = {"fixed_ms": 20.0, "wq_ms": 0.25, "wr_ms": 0.4, "active_ms": 0.8}


def _time(mode: str, r: int, c: dict[str, float] = TRUE) -> float:
    wq_slots = N_MOE * K if mode == "wq" else N_MOE * r
    return c["fixed_ms"] + wq_slots * c["wq_ms"] + N_MOE * r * c["wr_ms"] + (N_MOE if r else 0) * c["active_ms"]


def _points(noise: float = 0.0, seed: int = 0) -> list[Point]:
    rng = np.random.default_rng(seed)
    pts = [Point("decode", "wq", r, _time("wq", r) * (1 + noise * rng.standard_normal())) for r in range(K + 1)]
    pts += [Point("decode", "drop", r, _time("drop", r) * (1 + noise * rng.standard_normal())) for r in (1, 4)]
    return pts


def test_latency_fit_recovers_known_costs_exactly() -> None:
    lm = fit(_points(), N_MOE, K, prefill_batch=64)
    for name, want in TRUE.items():
        assert getattr(lm.decode, name) == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert lm.fit_errors("decode")["max_rel_err"] < 1e-9
    assert lm.fit_errors("decode")["loo_max_rel_err"] < 1e-9
    # prediction for an adaptive run: 2.5 critical slots per layer on average, 5 of 6 layers active
    assert lm.predict_ms(N_MOE * 2.5, 5.0) == pytest.approx(20 + 48 * 0.25 + 15 * 0.4 + 5 * 0.8)
    assert lm.predict_drop_ms(N_MOE * 1.0, N_MOE) == pytest.approx(_time("drop", 1))


def test_latency_fit_with_noise_and_round_trip(tmp_path: Path) -> None:
    lm = fit(_points(noise=0.01, seed=3), N_MOE, K, prefill_batch=64, machine={"cpu": "test"})
    assert lm.decode.wr_ms == pytest.approx(TRUE["wr_ms"], rel=0.25)
    for r in range(K + 1):  # 1% noise on the inputs: the noiseless times come back within a few percent
        assert lm.predict_ms(N_MOE * r) == pytest.approx(_time("wq", r), rel=0.03)
    assert lm.fit_errors("decode")["mean_rel_err"] < 0.02
    back = load_latency_model(lm.save(tmp_path / "lat.json"))
    assert back.decode == lm.decode and back.machine == {"cpu": "test"}
    assert [(p.r, p.ms, p.predicted_ms) for p in back.points] == [(p.r, p.ms, p.predicted_ms) for p in lm.points]
    assert "NaN" not in (tmp_path / "lat.json").read_text()  # strict JSON: unknown values are null
    assert "leave-one-out" in lm.table()


def test_latency_fit_never_negative() -> None:
    # a noisy machine can make more work look faster; the fit must still not predict negative costs
    pts = [Point("decode", "wq", r, 10.0 - r) for r in range(K + 1)] + [Point("decode", "drop", 1, 12.0),
                                                                       Point("decode", "drop", 4, 3.0)]
    lm = fit(pts, N_MOE, K, prefill_batch=64)
    assert min(lm.decode.fixed_ms, lm.decode.wq_ms, lm.decode.wr_ms, lm.decode.active_ms) >= 0
    assert all(lm.predict_ms(N_MOE * r) >= 0 for r in range(K + 1))


def test_latency_fit_refuses_what_it_cannot_separate(tmp_path: Path) -> None:
    only_wq = [p for p in _points() if p.mode == "wq"]
    with pytest.raises(RapidMoEError, match="cannot separate"):
        fit(only_wq, N_MOE, K, prefill_batch=64)
    with pytest.raises(RapidMoEError, match="at least 4 measurements"):
        fit(_points()[:2], N_MOE, K, prefill_batch=64)
    (tmp_path / "x.json").write_text('{"format": "something"}')
    with pytest.raises(RapidMoEError, match="not a rapidmoe latency model"):
        load_latency_model(tmp_path / "x.json")
    with pytest.raises(RapidMoEError, match="does not exist"):
        load_latency_model(tmp_path / "none.json")


def _brute_pareto(lat: list[float], kl: list[float]) -> set[int]:
    out = set()
    for i in range(len(lat)):
        dominated = any((lat[j] <= lat[i] and kl[j] <= kl[i]) and (lat[j] < lat[i] or kl[j] < kl[i])
                        for j in range(len(lat)))
        dup_first = all(not (lat[j] == lat[i] and kl[j] == kl[i]) for j in range(i))
        if not dominated and dup_first:
            out.add(i)
    return out


def test_pareto_matches_brute_force_on_random_sets() -> None:
    rnd = random.Random(5)
    for _ in range(200):
        n = rnd.randint(1, 30)
        lat = [rnd.choice([1.0, 2.0, 3.0, 4.0]) + rnd.random() * rnd.choice([0, 1]) for _ in range(n)]
        kl = [rnd.choice([0.1, 0.2, 0.3]) + rnd.random() * rnd.choice([0, 1]) for _ in range(n)]
        front = pareto(lat, kl)
        assert set(front) == _brute_pareto(lat, kl)
        assert [lat[i] for i in front] == sorted(lat[i] for i in front)


def test_choice_under_budget_and_knee() -> None:
    lat = [1.0, 2.0, 3.0, 4.0, 5.0, 2.5]
    kl = [1.0, 0.3, 0.2, 0.15, 0.14, 0.5]
    assert pareto(lat, kl) == [0, 1, 2, 3, 4]
    assert choose(lat, kl, budget=3.2) == 2
    assert choose(lat, kl, budget=2.0) == 1
    assert choose(lat, kl, budget=None) == knee(lat, kl) == 1  # the big drop is 1 -> 2 ms; after it, little gain
    assert choose(lat, kl, budget=3.2, allowed=[0, 1, 5]) == 1
    with pytest.raises(RapidMoEError, match=r"no candidate meets the latency budget 0\.50"):
        choose(lat, kl, budget=0.5)


def test_theta_for_level_hits_the_target_and_chunks_are_seeded() -> None:
    rng = np.random.default_rng(0)
    w = [np.exp(rng.normal(size=(400, 8)) * 2).astype(np.float32) for _ in range(4)]

    for alpha in (0.0, 0.5):
        for level in (1.5, 2.0, 3.0):
            theta = theta_for_level(w, alpha, level, 0, 8)
            assert theta == round(theta, 2)
            tau = Policy(theta=theta, alpha=alpha).thresholds(4)[:, 0]
            got = np.mean([n_critical(x, tau[m], 0, 8).mean() for m, x in enumerate(w)])
            assert abs(got - level) < 0.1
    toks = list(range(1000))
    a, b = pick_chunks(toks, 300, 100, seed=1), pick_chunks(toks, 300, 100, seed=1)
    assert a == b and len(a) == 3 and all(len(c) == 100 for c in a)
    assert pick_chunks(toks, 300, 100, seed=2) != a
    with pytest.raises(RapidMoEError, match="not enough for 20 chunks"):
        pick_chunks(toks, 2000, 100, seed=0)


@pytest.mark.native
@pytest.mark.slow
def test_calibrate_commands_end_to_end(make_split, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, wq, wr = make_split("qwen3moe")
    runner = CliRunner()
    lat = tmp_path / "lat.json"
    res = runner.invoke(app, ["calibrate-latency", str(wq), "--residual", str(wr), "-o", str(lat), "-t", "2",
                              "--decode-tokens", "4", "--prefill-batch", "16", "--repeats", "1"])
    assert res.exit_code == 0, res.output
    assert "leave-one-out" in res.output and "R(c, a)" in res.output
    d = json.loads(lat.read_text())
    assert d["machine"]["threads"] == 2 and len(d["points"]) >= 8
    text = tmp_path / "calib.txt"
    text.write_text("The experts of a mixture each see a few tokens; routers pick them by weight. " * 60)
    out = tmp_path / "umia"
    res = runner.invoke(app, ["calibrate", str(wq), "--residual", str(wr), "--text", str(text), "--latency",
                              str(lat), "-o", str(out), "--tokens", "64", "--chunk", "32", "--alphas", "0,0.5",
                              "--levels", "1.5,2", "-t", "2"])
    assert res.exit_code == 0, res.output
    pol = load_policy(out / "policy.json")
    assert pol.phase == "auto" and pol.meta["tokens"] == 64
    front = json.loads((out / "frontier.json").read_text())
    kinds = {e["kind"] for e in front["evaluations"]}
    # beta rows (prefill) only when the choice is a UMIA policy: a fixed r has nothing for beta to change
    assert kinds == {"fixed", "umia", "drop"} | (set() if pol.r_min == pol.r_max else {"beta"})
    # r = k is the reference itself: KL 0
    rk = next(e for e in front["evaluations"] if e["label"] == f"r={d['k']}")
    assert rk["kl_mean"] < 1e-6
    assert (out / "frontier.md").exists()
    # a budget nothing meets is refused with the fastest prediction named
    res = runner.invoke(app, ["calibrate", str(wq), "--residual", str(wr), "--text", str(text), "--latency",
                              str(lat), "-o", str(out), "--tokens", "64", "--chunk", "32", "--latency-budget",
                              "0.001", "--alphas", "0", "--levels", "1.5"])
    assert res.exit_code == 1 and "no candidate meets the latency budget" in res.output
    res = runner.invoke(app, ["calibrate", str(wq), "--residual", str(wr), "--text", str(tmp_path / "none.txt")])
    assert res.exit_code == 1 and "does not exist" in res.output


@pytest.mark.native
@pytest.mark.slow
def test_device_latency_and_beta_search_end_to_end(make_split, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """calibrate-latency --device on the RPC stand-in writes a latency model with measured device terms (every
    run's step time predicted); calibrate prices its candidates with it and searches beta with prefill thresholds:
    the realised critical slots grow with beta, and a prefill budget picks the lowest prompt KL within it."""
    from rapidmoe.calibration.umia import calibrate  # noqa: PLC0415
    from rapidmoe.rpc import RPCServer  # noqa: PLC0415 - the extension: native tests only
    from rapidmoe.umia.latency import load_latency_model  # noqa: PLC0415

    _, wq, wr = make_split("qwen3moe", "cpu-q8")
    lat = tmp_path / "dev.latency.json"
    with RPCServer(threads=1) as srv:
        res = CliRunner().invoke(app, [
            "calibrate-latency", str(wq), "--residual", str(wr), "-o", str(lat), "-t", "1", "--device",
            srv.device.buffer_type, "--rpc", srv.endpoint, "--decode-tokens", "4", "--prefill-batch", "16",
            "--repeats", "1"])
    assert res.exit_code == 0, res.output
    assert "concurrent" in res.output and "measured on RPC" in res.output
    lm = load_latency_model(lat)
    assert lm.device is not None and lm.device.prefill is not None
    assert 0.0 < lm.device.hit_rate < 1.0  # the first cache fraction: half of each layer's experts
    # every expert cached (fraction 1): every slot is a hit
    assert sorted({round(p.hit_rate, 6) for p in lm.device.points})[-1] == 1.0
    assert {(p.phase, p.overlap) for p in lm.device.points} == {(ph, o) for ph in ("decode", "prefill")
                                                                for o in (False, True)}
    assert all(np.isfinite(p.predicted_ms) and p.predicted_ms > 0 for p in lm.device.points)
    text = tmp_path / "calib.txt"
    text.write_text("The experts of a mixture each see a few tokens; routers pick them by weight. " * 60)
    kw = {"n_tokens": 64, "chunk": 32, "alphas": (0.0,), "levels": (1.5,), "fixed_r": (), "drop_r": (),
          "cutoffs": (), "refine": False, "threads": 2, "progress": False, "betas": (0.0, 1.0, 4.0)}
    res1 = calibrate(wq, wr, text, lm, **kw)  # type: ignore[arg-type]
    beta_rows = [e for e in res1.evaluations if e.kind == "beta"]
    assert [e.policy.beta for e in beta_rows] == [0.0, 1.0, 4.0]
    assert all(e.policy.phase == "prefill" for e in beta_rows)
    crit = [e.critical_per_token for e in beta_rows]
    assert crit[0] <= crit[1] <= crit[2] and crit[0] < crit[2]  # prefill thresholds (1 + beta) really applied
    assert all(np.isfinite(e.predicted_ms) for e in beta_rows)
    assert res1.policy.beta in (0.0, 1.0, 4.0) and res1.policy.phase == "auto"
    # a prefill budget at the cheapest beta's cost: the lowest prompt KL among the betas priced within it
    budget = min(e.predicted_ms for e in beta_rows)
    want = min((e for e in beta_rows if e.predicted_ms <= budget), key=lambda e: e.kl_mean).policy.beta
    res2 = calibrate(wq, wr, text, lm, prefill_budget_ms=budget, **kw)  # type: ignore[arg-type]
    assert res2.policy.beta == want and "within the prefill budget" in res2.settings["beta_choice"]
