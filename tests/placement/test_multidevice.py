"""`plan` across several devices: contiguous layer runs per device that fit each budget, and a -ts that makes
llama.cpp (its layer-to-device rule, re-implemented here from llama-model.cpp) put every layer where the plan says."""
from __future__ import annotations

import bisect
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rapidmoe.placement import GPU, PlanError, get_shape_set, parse_size, plan
from rapidmoe.placement.footprint import footprint
from rapidmoe.placement.multidevice import plan_across
from rapidmoe.placement.tensors import ROUTED
from rapidmoe.placement.typeplan import resplit_types
from rapidmoe.resplit.presets import get_preset

GiB = 1 << 30


def llama_cpp_devices(tensor_split: tuple[int, ...], n_layer: int) -> list[int]:
    """llama.cpp's device per layer (0..n_layer, the last being the output layer) for -ngl >= n_layer + 1 and
    -ts tensor_split: float32 cumulative split points, std::upper_bound of il / (n_layer + 1)."""
    cum = np.cumsum(np.asarray(tensor_split, dtype=np.float32), dtype=np.float32)
    splits = [float(np.float32(c) / np.float32(cum[-1])) for c in cum]
    return [bisect.bisect_right(splits, float(np.float32(il) / np.float32(n_layer + 1))) for il in range(n_layer + 1)]


@pytest.mark.parametrize(("shapes", "preset", "budgets"), [
    ("deepseek-v3", "paper", ["24GiB", "24GiB"]),
    ("deepseek-v3", "paper", ["80GiB", "24GiB", "16GiB"]),
    ("qwen3-235b-a22b", "cpu", ["48GiB", "24GiB"]),
    ("qwen3-30b-a3b", "cpu", ["8GiB", "8GiB"]),
])
def test_runs_fit_and_llama_cpp_places_them(shapes: str, preset: str, budgets: list[str]) -> None:
    m = get_shape_set(shapes).model_shapes()
    p = get_preset(preset)
    reserve = GiB
    mems = [parse_size(b) for b in budgets]
    multi = plan_across(m, mems, lambda total: plan(m, "resplit", preset=p, gpu_mem=total, reserve=reserve),
                        footprint(m, resplit_types(p), p), reserve)
    assert multi.fits and multi.plan.scheme == "resplit", multi.table()
    runs = [list(s.layers) for s in multi.shares]
    assert [il for r in runs for il in r] == list(range(m.n_layer))  # contiguous, in order, every layer once
    for s in multi.shares:
        assert s.bytes <= s.budget
    # the shares add up to the plan's GPU bytes plus one reserve per extra device, with the routed experts as the
    # flags realize them (whole layers from --n-cpu-moe on; per-layer shares are rounded down by a few bytes)
    flags = dict(zip(multi.plan.realization.args[::2], multi.plan.realization.args[1::2], strict=True))
    fp = footprint(m, resplit_types(p), p)
    realized = sum(b * m.n_expert for il, b in fp.expert_bytes.items() if il >= int(flags.get("--n-cpu-moe", 0)))
    want = multi.plan.vram - multi.plan.device_bytes(GPU, ROUTED) + realized + (len(mems) - 1) * reserve
    assert want - m.n_layer * 2 <= sum(s.bytes for s in multi.shares) <= want
    # llama.cpp with -ngl 999 -ts <tensor_split> puts layer il on the device whose run holds it, the head on the last
    devices = [next(i for i, r in enumerate(runs) if il in r) for il in range(m.n_layer)] + [len(mems) - 1]
    assert llama_cpp_devices(multi.tensor_split, m.n_layer) == devices
    assert multi.args[-2] == "-ts" and multi.args[-1] == ",".join(map(str, multi.tensor_split))


def test_more_memory_more_on_the_devices() -> None:
    m = get_shape_set("deepseek-v3").model_shapes()
    p = get_preset("paper")
    fp = footprint(m, resplit_types(p), p)

    def mk(mems: list[int]):  # type: ignore[no-untyped-def]
        return plan_across(m, mems, lambda t: plan(m, "resplit", preset=p, gpu_mem=t, reserve=GiB), fp, GiB)

    small, big = mk([24 * GiB, 24 * GiB]), mk([80 * GiB, 80 * GiB])
    assert big.plan.experts_on_gpu > small.plan.experts_on_gpu and big.plan.hit_rate > small.plan.hit_rate
    # a budget that holds no layer: CPU-only, no -ts
    cpu = mk([GiB + 1, GiB + 1])
    assert cpu.plan.scheme == "cpu-only" and cpu.tensor_split == () and "-ts" not in cpu.args
    assert all(s.layers == () for s in cpu.shares)
    with pytest.raises(PlanError, match="at least two"):
        mk([24 * GiB])
    with pytest.raises(PlanError, match="must exceed the reserve"):
        mk([24 * GiB, GiB])


def test_cli_plan_across_devices(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    cli = [sys.executable, "-m", "rapidmoe.cli", "plan", "--shapes", "deepseek-v3"]
    p = subprocess.run([*cli, "--gpu-mem", "24GiB,24GiB", "--json", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "RESplit across 2 devices" in p.stdout and "-ts " in p.stdout
    dev = json.loads(out.read_text())["devices"]
    assert dev["fits"] and sum(dev["tensor_split"]) == 62 and dev["budgets"] == [24 * GiB, 24 * GiB]
    p = subprocess.run([*cli, "--gpu-mem", "24GiB,24GiB", "--machine", "24gb"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "one --gpu-mem" in p.stderr
