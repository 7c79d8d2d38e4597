"""UMIA's latency model with a device (umia/device.py, umia/profile.py): the layer formula (max of the overlapped
stages, sum when serial), the machine-profile terms against a roofline computed here from the profile's numbers,
the streaming threshold against its closed form, the stage-term fit recovering known terms, and `plan --machine`
printing the threshold. Pure Python: no build needed."""
from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from rapidmoe.cli.app import app
from rapidmoe.errors import RapidMoEError
from rapidmoe.placement.cost import CostModel, ModelCosts
from rapidmoe.placement.machine import MACHINES, MachineProfile
from rapidmoe.placement.shapes import get_shape_set
from rapidmoe.resplit.presets import get_preset
from rapidmoe.umia.device import (
    DeviceCosts,
    DevicePoint,
    distinct_experts,
    fit_stage_terms,
    layer_ms,
    predict_ms,
    profile_costs,
    stream_threshold,
)
from rapidmoe.umia.latency import DeviceModel, LatencyModel, PhaseCosts, load_latency_model
from rapidmoe.umia.profile import profile_report, profile_terms

TERMS = DeviceCosts(fixed_ms=5.0, hit_ms=0.01, miss_ms=0.2, wr_ms=0.3, active_ms=0.05, xfer_ms=0.1, sync_ms=0.02)


def test_layer_is_the_max_of_overlapped_stages_and_the_sum_when_serial() -> None:
    k, h, r = 8, 0.75, 2
    dev = 0.1 + k * h * 0.01  # 0.16
    cpu = k * (1 - h) * 0.2 + r * 0.3 + 0.05  # 1.05
    conc = layer_ms(TERMS, k, h, r, 1.0)
    ser = layer_ms(TERMS, k, h, r, 1.0, overlap=False)
    assert (conc.device_ms, conc.cpu_ms) == pytest.approx((dev, cpu))
    assert conc.total_ms == pytest.approx(max(dev, cpu) + 0.02)
    assert ser.total_ms == pytest.approx(dev + cpu + 0.02)
    with_extra = DeviceCosts(**{**TERMS.to_dict(), "serial_sync_ms": 0.5})
    assert layer_ms(with_extra, k, h, r, 1.0, overlap=False).total_ms == pytest.approx(dev + cpu + 0.02 + 0.5)
    assert layer_ms(with_extra, k, h, r, 1.0).total_ms == pytest.approx(conc.total_ms)
    # every expert cached and r = 0: nothing for the CPU, no hand-over
    assert layer_ms(TERMS, k, 1.0, 0, 0.0).total_ms == pytest.approx(0.1 + k * 0.01)
    assert predict_ms(TERMS, k, h, [2.0, 0.0]) == pytest.approx(
        5.0 + conc.total_ms + max(0.1 + k * h * 0.01, k * (1 - h) * 0.2) + 0.02)
    with pytest.raises(RapidMoEError, match="hit rate"):
        layer_ms(TERMS, k, 1.5, 0, 0)
    with pytest.raises(RapidMoEError, match="streaming cost"):
        layer_ms(TERMS, k, h, r, 1.0, stream=True)


def test_profile_terms_are_the_roofline_of_the_profile() -> None:
    machine = MACHINES["24gb"]
    model = get_shape_set("deepseek-v3").model_shapes()
    mc = ModelCosts.of(model, get_preset("paper"))
    cost = CostModel(machine, mc)
    dec = profile_costs(cost, 0.5, 1, n_embd=7168)
    # decode: one token reads each expert it uses whole; per slot the larger of bytes / bandwidth and FLOPs / rate
    gpu = max(mc.expert_bytes / machine.gpu_bw, mc.expert_flops / machine.gpu_flops)
    cpu = max(mc.expert_bytes / machine.cpu_bw, mc.expert_flops / machine.cpu_flops)
    assert (dec.hit_ms, dec.miss_ms) == pytest.approx((1e3 * gpu, 1e3 * cpu))
    assert dec.xfer_ms == pytest.approx(1e3 * 4 * 7168 * 2 * (mc.k + 1) / machine.pcie_bw)
    assert (dec.sync_ms, dec.serial_sync_ms) == pytest.approx((2e3 * machine.sync_s, 1e3 * machine.sync_s))
    assert dec.stream_ms == pytest.approx(1e3 * (mc.n_expert * mc.expert_bytes / machine.pcie_bw + max(
        mc.n_expert * mc.expert_bytes / machine.gpu_bw, mc.k * mc.expert_flops / machine.gpu_flops)))
    # a 512-token batch shares the expert reads: the CPU becomes FLOP-bound per slot
    pre = profile_costs(cost, 0.5, 512, n_embd=7168)
    n_d = mc.n_expert * (1 - (1 - mc.k / mc.n_expert) ** 512)
    assert distinct_experts(mc.n_expert, mc.k, 512) == pytest.approx(n_d)
    assert pre.miss_ms == pytest.approx(1e3 * max(n_d * mc.expert_bytes / machine.cpu_bw,
                                                  512 * mc.k * mc.expert_flops / machine.cpu_flops) / (512 * mc.k))


def test_stream_threshold_matches_its_closed_form() -> None:
    # a machine whose GPU is effectively free and whose CPU is FLOP-bound: streaming a layer costs its bytes over
    # PCIe once per batch, keeping the misses costs k (1 - h) FLOP-bound slots per token: the threshold is the
    # first batch B with n_expert * bytes / pcie / B < k (1 - h) * flops / cpu_flops
    m = MachineProfile(name="t", gpu_mem=1 << 30, gpu_bw=1e18, gpu_flops=1e20, pcie_bw=20e9, cpu_bw=1e18,
                       cpu_flops=1e12, cpu_cores=8, sync_s=0.0)
    mc = ModelCosts("t", "WQ", n_moe=4, n_expert=64, k=8, resident_bytes=1, resident_flops=1.0,
                    expert_bytes=6.1e6, expert_flops=4e7, residual_bytes=0.0)
    cost = CostModel(m, mc)
    h = 0.25
    x = mc.n_expert * mc.expert_bytes / m.pcie_bw / (mc.k * (1 - h) * mc.expert_flops / m.cpu_flops)
    assert abs(x - round(x)) > 0.1  # no tie at the threshold
    expected = math.floor(x) + 1
    assert stream_threshold(cost, h, r=0.0) == expected
    # all cached: no misses, streaming never pays
    assert stream_threshold(cost, 1.0, r=0.0) == 0


def _measure(terms: DeviceCosts, n_moe: int, k: int, h: float, r: int, overlap: bool) -> DevicePoint:
    """What a run would record under exactly these terms (written out here, not through layer_ms)."""
    dev = terms.xfer_ms + k * h * terms.hit_ms
    cpu = k * (1 - h) * terms.miss_ms + r * terms.wr_ms + (r > 0) * terms.active_ms
    per_layer = max(dev, cpu) if overlap else dev + cpu + (cpu > 0) * terms.serial_sync_ms
    ms = terms.fixed_ms + n_moe * per_layer
    return DevicePoint("decode", r, h, overlap, ms, n_moe * cpu if overlap else 0.0, n_moe * dev if overlap else 0.0)


def test_fit_recovers_the_terms_and_predicts_serial_runs() -> None:
    true = DeviceCosts(fixed_ms=12.0, hit_ms=0.4, miss_ms=0.3, wr_ms=0.5, active_ms=0.2, xfer_ms=1.5, sync_ms=0.0,
                       serial_sync_ms=0.7)
    n_moe, k = 24, 8
    pts = [_measure(true, n_moe, k, h, r, ov) for h in (0.5, 1.0) for r in (0, 1, 2) for ov in (False, True)]
    costs, out = fit_stage_terms(pts, n_moe, k)
    for f in ("fixed_ms", "hit_ms", "miss_ms", "wr_ms", "active_ms", "xfer_ms", "serial_sync_ms"):
        assert getattr(costs, f) == pytest.approx(getattr(true, f), rel=1e-6), f
    assert all(p.predicted_ms == pytest.approx(p.ms, rel=1e-6) for p in out)
    with pytest.raises(RapidMoEError, match=">= 3"):
        fit_stage_terms([p for p in pts if p.r == 0], n_moe, k)


@pytest.mark.native
def test_profile_report_and_plan_print_the_threshold() -> None:
    rep = profile_report("24gb", "deepseek-v3", "paper")
    t = profile_terms(get_shape_set("deepseek-v3").model_shapes(), MACHINES["24gb"], get_preset("paper"))
    assert rep["stream_threshold"] == t["stream_threshold"] > 0
    assert [row["r"] for row in rep["rows"]] == [0, 1, 2, 3]
    assert all(row["decode_concurrent_ms"] <= row["decode_serial_ms"] for row in rep["rows"])
    res = CliRunner().invoke(app, ["plan", "--shapes", "deepseek-v3", "--machine", "24gb"])
    assert res.exit_code == 0, res.output
    assert f"ubatches of >= {t['stream_threshold']} tokens" in res.output


def test_latency_model_with_a_device_part_round_trips_and_prices_per_layer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    dev = DeviceModel("profile test", 0.5, True, TERMS, None, [DevicePoint("decode", 1, 0.5, True, 9.0, 1.0, 2.0)])
    lm = LatencyModel(2, 8, PhaseCosts(1.0, 0.1, 0.2), None, 64, [], device=dev)
    # per layer: layer 0 r = 3 makes the CPU stage the longer one, layer 1 r = 0 leaves the device's
    want = 5.0 + sum(layer_ms(TERMS, 8, 0.5, r, float(r > 0)).total_ms for r in (3.0, 0.0))
    assert lm.predict_layers_ms([3.0, 0.0], [1.0, 0.0]) == pytest.approx(want)
    assert lm.predict_ms(3.0, 1.0) == pytest.approx(predict_ms(TERMS, 8, 0.5, [1.5, 1.5], [0.5, 0.5]))
    back = load_latency_model(lm.save(tmp_path / "m.latency.json"))
    assert back.device is not None and back.device.to_dict() == dev.to_dict()  # (nan != nan: compare as JSON)
    assert back.predict_layers_ms([3.0, 0.0], [1.0, 0.0]) == pytest.approx(want)
    with pytest.raises(RapidMoEError, match="no prefill terms"):
        back.predict_layers_ms([1.0, 1.0], [1.0, 1.0], phase="prefill")
