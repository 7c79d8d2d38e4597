"""Cache policies, MoEpic's configuration, the cost model and machine profiles, against hand-computed small cases."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from rapidmoe.cli.app import app
from rapidmoe.placement import PlanError, get_shape_set
from rapidmoe.placement.cache.config import CachePolicyError, MoEpicSettings
from rapidmoe.placement.cache.moepic import hit_curve, moepic_config, plan_moepic, split_fixed_point, top_rows
from rapidmoe.placement.cache.routing import routing_stats, scale_routing
from rapidmoe.placement.cache.simulator import LRUCache, MoEpicCache, RapidMoECache, StaticCache, replay
from rapidmoe.placement.cost import CostModel, ModelCosts, umia_costs
from rapidmoe.placement.machine import MACHINES, MachineError, MachineProfile, load_machine
from rapidmoe.placement.schemes import compare_schemes
from rapidmoe.resplit.presets import get_preset


def _seq(*experts: int) -> np.ndarray:
    """One MoE layer, top-1, one token per expert id: [N, 1, 1]."""
    return np.array(experts, dtype=np.int64).reshape(-1, 1, 1)


# a machine with round numbers: GPU reads 100 B/s, CPU 10 B/s, PCIe 5 B/s; FLOPs never the bound
_M = MachineProfile(name="toy", gpu_mem=1000, gpu_bw=100.0, gpu_flops=1e30, pcie_bw=5.0, cpu_bw=10.0, cpu_flops=1e30,
                    cpu_cores=1, sync_s=0.0)
_C = ModelCosts(name="toy", form="toy", n_moe=1, n_expert=4, k=1, resident_bytes=0, resident_flops=0.0,
                expert_bytes=10.0, expert_flops=1.0, residual_bytes=5.0)


def test_lru_eviction_order_and_bytes() -> None:
    lru = LRUCache([2], expert_bytes=10.0)
    res = replay(_seq(0, 1, 0, 2, 1), lru)
    # 0 miss [0]; 1 miss [0 1]; 0 hit [1 0]; 2 miss evicts 1 [0 2]; 1 miss evicts 0 [2 1]
    assert (res.hits, res.slots) == (1, 5)
    assert res.bytes_moved == 40.0
    assert lru.resident(0) == {1, 2}
    assert list(lru.slots[0]) == [2, 1]  # least recently used first


def test_lru_zero_capacity_loads_every_use() -> None:
    res = replay(_seq(3, 3, 3), LRUCache([0], 10.0))
    assert res.hits == 0 and res.bytes_moved == 30.0


def test_static_hits_equal_a_numpy_count() -> None:
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(3)]) for _ in range(50)])  # [50, 3, 2]
    cached = [{0, 1}, {2, 3, 4}, set()]
    res = replay(ids, StaticCache(cached))
    want = sum(int(np.isin(ids[:, m], list(c)).sum()) for m, c in enumerate(cached))
    assert res.hits == want and res.slots == ids.size and res.bytes_moved == 0
    assert res.layer_hits[2] == 0
    assert replay(ids, StaticCache(cached), steps=[10, 40]).hits == want  # the same counts in two steps
    with pytest.raises(CachePolicyError, match="add up"):
        replay(ids, StaticCache(cached), steps=[1])


def test_moepic_moves_only_bottoms_of_cached_tops() -> None:
    c = MoEpicCache([1], [0.25], expert_bytes=100.0)
    res = replay(_seq(0, 0, 1, 0), c)
    # 0: all 100 (top cached after); 0: bottom 75; 1: 100, evicts 0's top; 0: 100 again
    assert res.bytes_moved == 375.0 and res.hits == 1
    # predicted experts are prefetched (not demand); a wrong guess still moves its bytes
    c = MoEpicCache([1, 1], [0.5, 0.5], expert_bytes=100.0)
    a = c.access(1, np.array([2]), np.array([1]), predicted={2, 3})
    assert a.demand_bytes == 0.0 and a.prefetch_bytes == 200.0
    a = c.access(1, np.array([2]), np.array([1]), predicted=set())
    assert a.demand_bytes == 50.0 and a.prefetch_bytes == 0.0 and a.hit_uses == 1


def test_moepic_work_area_mirrors_the_runtime() -> None:
    """work_slots (the runtime's rule): predicted experts first (lowest ids while slots last), then the step's others
    in id order while slots last, the rest on the CPU without copies or tops; tops admitted for the device's experts."""
    c = MoEpicCache([2], [0.5], expert_bytes=100.0, work_slots=[2])
    c.tops[0].update({5: None})
    a = c.access(0, np.array([1, 4, 5, 7]), np.array([1, 1, 1, 1]), predicted={7, 9, 2})
    # ahead: 2 and 7 (the two lowest predicted ids; 9 does not fit), 100 each; on demand: none (both slots hold
    # 2 and 7, 7 needed, 2 not: one slot free) -> 1 (100); 4 and 5 run on the CPU: 5's resident top is still a hit
    assert a.prefetch_bytes == 200.0 and a.demand_bytes == 100.0 and a.hit_uses == 1
    assert list(c.tops[0]) == [1, 7]  # 5 was least recently used when 1 and 7 came in
    with pytest.raises(CachePolicyError, match="work area"):
        MoEpicCache([1], [0.5], 1.0, work_slots=[0])


def test_moepic_settings_and_rows() -> None:
    assert top_rows(0.5, 768, 1) == 384 and top_rows(0.5, 768, 256) == 256 and top_rows(0.3, 768, 256) == 0
    assert top_rows(1.0, 768, 256) == 768
    s = MoEpicSettings(0.5, 3)
    assert s.per_layer(2) == ([0.5, 0.5], [3, 3])
    with pytest.raises(CachePolicyError, match="MoE layers"):
        MoEpicSettings([0.5], [1, 2]).per_layer(2)
    with pytest.raises(CachePolicyError):
        MoEpicSettings(0.5, -1)
    # plan_moepic is moepic_config over the counts' hit curves and the cost model's link and windows
    counts = np.array([[8, 4, 2, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    cost = CostModel(_M, _C)
    cfg = plan_moepic(counts, 300.0, expert_bytes=100.0, k=2, cost=cost, accuracy=[0.8, 0.8])
    want = moepic_config([hit_curve(c) for c in counts], 300.0, n_expert=8, k=2, expert_bytes=100.0, pcie_bw=5.0,
                         windows_s=[cost.window_s(2, 2)] * 2, accuracy=[0.8, 0.8])
    assert cfg == want and sum(cfg.budgets) <= 300.0 + 1e-9
    assert MoEpicSettings.from_config(cfg).per_layer(2) == (list(cfg.splits), list(cfg.capacity))


def test_rapidmoe_refresh_swaps_in_the_hot_expert_once() -> None:
    c = RapidMoECache([{0}], n_expert=3, expert_bytes=10.0, half_life_tokens=1000.0, copies_per_step=1, margin=0.0)
    res = replay(_seq(2, 2, 2, 2), c)
    assert c.cached[0] == {2} and c.swaps == 1
    assert res.hits == 3 and res.bytes_moved == 10.0  # the first use missed, then one copy
    # no copy budget: nothing moves
    c0 = RapidMoECache([{0}], n_expert=3, expert_bytes=10.0, copies_per_step=0)
    assert replay(_seq(2, 2, 2), c0).hits == 0 and c0.cached[0] == {0}


def test_replay_prices_steps_with_the_cost_model() -> None:
    cost = CostModel(_M, _C)
    # one GPU-centric miss: copy 10 B at 5 B/s, then read 10 B at 100 B/s
    r = replay(_seq(1), LRUCache([1], 10.0), cost)
    assert r.seconds == pytest.approx(2.0 + 0.1)
    # CPU-centric: a hit on the GPU (0.1 s) next to nothing; a miss on the CPU (1 s), overlapped with nothing
    assert replay(_seq(0), StaticCache([{0}]), cost).seconds == pytest.approx(0.1)
    assert replay(_seq(1), StaticCache([{0}]), cost).seconds == pytest.approx(1.0)
    # a critical slot adds the residual (5 B at 10 B/s) on the CPU: max(GPU 0.1, CPU 0.5)
    assert replay(_seq(0), StaticCache([{0}]), cost, r_critical=1).seconds == pytest.approx(0.5)
    # two tokens, one hit one miss, serial (stock order) vs overlapped
    ids = np.array([[[0, 1]]])
    assert replay(ids, StaticCache([{0}]), cost, overlap=False).seconds == pytest.approx(1.1)
    assert replay(ids, StaticCache([{0}]), cost).seconds == pytest.approx(1.0)


def test_umia_costs_are_the_cost_models_slot_costs() -> None:
    cost = CostModel(_M, _C)
    u = umia_costs(cost, hit_rate=0.25)
    assert u["wq_ms"] == pytest.approx(1e3 * (0.25 * 0.1 + 0.75 * 1.0))  # GPU 10 B at 100 B/s, CPU at 10 B/s
    assert u["wr_ms"] == pytest.approx(1e3 * 0.5) and u["fixed_ms"] == 0.0


def test_split_fixed_point_matches_the_closed_form() -> None:
    """H(n) = sqrt(n / N): the fixed point s = (1 - c)^2 eb N / b, with c = window pcie / (a k eb)."""
    n_exp, eb, k, pcie, window = 64, 1.0, 4.0, 1.0, 2.0
    curve = lambda n: math.sqrt(max(n, 0.0) / n_exp)  # noqa: E731
    sol = split_fixed_point(curve, 20.0, n_expert=n_exp, k=k, expert_bytes=eb, pcie_bw=pcie, window_s=window,
                            accuracy=1.0)
    c = window * pcie / (k * eb)
    assert sol.converged and sol.iterations > 1
    assert sol.split == pytest.approx((1 - c) ** 2 * eb * n_exp / 20.0, rel=1e-4)  # 0.8
    assert sol.n_cached == pytest.approx(25.0, rel=1e-4)
    assert sol.stall_s == pytest.approx(0.0, abs=1e-5)  # the prefetch just fits the window
    # a window that hides every fetch: whole experts, no split
    big = split_fixed_point(curve, 20.0, n_expert=n_exp, k=k, expert_bytes=eb, pcie_bw=pcie, window_s=10.0,
                            accuracy=1.0)
    assert big.split == 1.0 and big.stall_s == 0.0


def test_moepic_config_spends_the_budget_where_it_saves_most() -> None:
    n_exp, eb = 16, 1.0
    skewed = hit_curve(np.array([100, 50, 20, 10] + [1] * 12))
    flat = hit_curve(np.ones(16))
    kw: dict[str, Any] = {"n_expert": n_exp, "k": 2.0, "expert_bytes": eb, "pcie_bw": 1.0, "accuracy": [0.5, 0.5]}
    same = moepic_config([skewed, skewed], 8.0, windows_s=[0.5, 0.5], **kw)
    assert sum(same.budgets) <= 8.0 + 1e-9 and same.all_converged
    # the split of the budget is the best on its grid: no other split of the 16 quanta between the layers is better
    per = [[split_fixed_point(skewed, j * 0.5, n_expert=n_exp, k=2.0, expert_bytes=eb, pcie_bw=1.0, window_s=0.5,
                              accuracy=0.5).stall_s for j in range(17)]]
    assert same.stall_s == pytest.approx(min(per[0][j] + per[0][16 - j] for j in range(17)))
    mixed = moepic_config([skewed, flat], 8.0, windows_s=[0.5, 0.5], **kw)
    # the skewed layer hides its prefetch with a small budget (its few hot experts' tops); the flat one needs more
    assert mixed.budgets[1] > mixed.budgets[0] > 0
    assert mixed.stall_s < moepic_config([skewed, flat], 0.0, windows_s=[0.5, 0.5], **kw).stall_s
    half = [split_fixed_point(c, 4.0, n_expert=n_exp, k=2.0, expert_bytes=eb, pcie_bw=1.0, window_s=0.5,
                              accuracy=0.5).stall_s for c in (skewed, flat)]
    assert mixed.stall_s <= sum(half) + 1e-12
    with pytest.raises(CachePolicyError):
        moepic_config([skewed], 1.0, windows_s=[0.5, 0.5], **{**kw, "accuracy": [0.5]})


def test_hit_curve_is_the_sorted_cumulative_share() -> None:
    h = hit_curve(np.array([1, 3, 0, 6]))
    assert h(0) == 0 and h(1) == pytest.approx(0.6) and h(2) == pytest.approx(0.9) and h(4) == pytest.approx(1)
    assert h(1.5) == pytest.approx(0.75)


def test_scale_routing_keeps_skew_and_reuse() -> None:
    rng = np.random.default_rng(1)
    small = np.zeros((3000, 2, 2), dtype=np.int64)
    p = np.array([0.4, 0.3, 0.2, 0.1])
    for m in range(2):
        for t in range(3000):
            small[t, m] = rng.choice(4, 2, replace=False, p=p)
    st = routing_stats(small, 4)
    big, pred = scale_routing(st, n_tokens=3000, n_moe=4, n_expert=16, k=4, seed=0)
    assert big.shape == (3000, 4, 4) and pred.shape == big.shape
    assert big.min() >= 0 and big.max() < 16
    assert all(len(set(row)) == 4 for row in big.reshape(-1, 4))
    group_share = np.bincount(big[:, 0].reshape(-1) // 4, minlength=4) / big[:, 0].size
    assert np.argsort(group_share).tolist() == [3, 2, 1, 0]  # the small model's order of popularity
    st_big = routing_stats(big, 16)
    assert st_big.excess_reuse[0] == pytest.approx(st.excess_reuse[0], abs=0.05)  # locality beyond chance kept
    with pytest.raises(CachePolicyError):
        scale_routing(st, n_tokens=1, n_moe=1, n_expert=10, k=2)


def test_machine_profiles_load_from_json(tmp_path: Path) -> None:
    assert load_machine("24GB").gpu_mem == 24 << 30 and load_machine("48gb").gpu_mem == 48 << 30
    p = tmp_path / "m.json"
    p.write_text(json.dumps({**MACHINES["24gb"].to_dict(), "name": "mine", "gpu_mem": "12GiB"}))
    m = load_machine(p)
    assert m.name == "mine" and m.gpu_mem == 12 << 30 and m.pcie_bw == MACHINES["24gb"].pcie_bw
    p.write_text(json.dumps({"name": "x", "gpu_mem": 1}))
    with pytest.raises(MachineError, match="lacks"):
        load_machine(p)
    p.write_text(json.dumps({**MACHINES["24gb"].to_dict(), "pcie": 1}))
    with pytest.raises(MachineError, match="unknown machine fields pcie"):
        load_machine(p)
    with pytest.raises(MachineError, match="must be > 0"):
        MachineProfile.from_dict({**MACHINES["24gb"].to_dict(), "cpu_bw": 0})
    with pytest.raises(MachineError, match="unknown machine"):
        load_machine("no-such-machine")


def test_compare_schemes_prices_each_scheme_with_the_cost_model(tmp_path: Path) -> None:
    model = get_shape_set("qwen3-30b-a3b").model_shapes()
    preset = get_preset("paper")
    big = MACHINES["48gb"].with_gpu_mem(1 << 40)  # everything fits
    choice, plan = compare_schemes(model, big, preset, r_critical=0)
    est = {e.scheme: e for e in choice.estimates}
    assert plan.hit_rate == 1.0 and est["static"].hit_rate == 1.0
    assert est["lru"].hit_rate == pytest.approx(1.0) and est["lru"].moved_per_token == 0.0
    n_moe, k = len(model.moe_layers), model.n_expert_used
    c_res = CostModel(big, ModelCosts.of(model, preset))
    c_q4 = CostModel(big, ModelCosts.of(model))
    # hand pricing: all experts on the GPU; stock: all on the CPU after the GPU, with two hand-overs per layer
    assert est["static"].decode_tok_s == pytest.approx(1 / (c_res.resident_s(1) + n_moe * c_res.gpu_experts_s(k, k)))
    assert est["stock"].decode_tok_s == pytest.approx(
        1 / (c_q4.resident_s(1) + n_moe * (c_q4.cpu_experts_s(k, k) + 2 * big.sync_s)))
    assert choice.chosen == max(choice.estimates, key=lambda e: e.decode_tok_s).scheme and not choice.forced
    forced, _ = compare_schemes(model, MACHINES["24gb"], preset, cache_policy="moepic")  # priced on Q4 experts
    assert forced.chosen == "moepic" and forced.forced
    assert "--cache-policy moepic run it on the file's" in forced.table()
    with pytest.raises(PlanError, match="unknown cache policy"):
        compare_schemes(model, big, preset, cache_policy="fifo")

    out = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", "--shapes", "qwen3-30b-a3b", "--machine", "24gb", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "PROJECTED" in res.output and "<- chosen" in res.output
    doc = json.loads(out.read_text())
    assert doc["cache_policy"] in {e["scheme"] for e in doc["cache_schemes"]} and doc["machine"]["name"] == "24gb"
    res = CliRunner().invoke(app, ["plan", "--shapes", "qwen3-30b-a3b", "--cache-policy", "lru"])
    assert res.exit_code != 0 and "--machine" in res.output
