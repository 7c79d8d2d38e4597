"""`run --gpu-mem` / `serve --gpu-mem`: the planner's plan turned into rapidmoe.Llama's placement arguments.

`realize` for every kind of plan (all WQ on the GPU, a per-expert cache coarsened to whole layers, the CPU-only
fallback, the CPU-offload baseline, a plan that does not fit), plans of real files as they are loaded (their own
types, a sidecar's recorded preset), and the commands: the logged plan, the same text as without --gpu-mem on a
machine without a GPU (greedy), and clear errors for conflicting flags and bad budgets."""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cache_reference import realized_plan, without_tiled
from testkit import EXACT_PRESET
from typer.testing import CliRunner

from rapidmoe.cli.app import app
from rapidmoe.cli.budget import gpu_devices
from rapidmoe.ggufio import GGUFFile
from rapidmoe.placement import CPU, GPU, ModelShapes, PlanError, ShapeSet, plan
from rapidmoe.placement.footprint import footprint
from rapidmoe.placement.realize import describe, plan_for_model, realize, sidecar_preset
from rapidmoe.placement.tensors import ROUTED, classify
from rapidmoe.placement.typeplan import resplit_types
from rapidmoe.resplit import get_preset

runner = CliRunner()
Toy = tuple[ModelShapes, int, int]  # the toy fixture: shapes, GPU bytes of all but routed experts, one expert's bytes
TOY = ShapeSet(name="toy", arch="qwen3moe", n_layer=4, n_embd=256, n_vocab=1024, n_head=4, n_head_kv=2,
               head_dim=64, n_expert=8, n_expert_used=2, n_ff_exp=256, published_params=0, published_active=0,
               source="test")
PRESET = get_preset("cpu")
CTX = 256
RUN = ["-p", "Hello", "-n", "8", "--temp", "0", "-t", "1", "-c", str(CTX)]
NO_GPU = not gpu_devices()


def _flat(text: str) -> str:
    """Command output without typer's error box and line wrapping."""
    return re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", text))


# --- realize: each kind of plan --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy() -> Toy:
    """The toy shapes, the GPU bytes of everything but routed experts (reserve 0), one expert's WQ bytes."""
    m = TOY.model_shapes()
    full = plan(m, preset=PRESET, reserve=0, n_ctx=CTX)
    return m, full.vram - full.device_bytes(GPU, ROUTED), footprint(m, resplit_types(PRESET), PRESET).expert_bytes[0]


def test_all_wq_fits_is_every_layer_on_the_gpu(toy: Toy) -> None:
    m, base, eb = toy
    p = plan(m, preset=PRESET, gpu_mem=base + 32 * eb, reserve=0, n_ctx=CTX)
    assert p.realization.exact
    assert realize(p) == {"n_ctx": CTX, "n_gpu_layers": 999, "n_cpu_moe": 0, "override_tensor": None}


def test_partial_cache_is_the_coarsened_plans_n_cpu_moe(toy: Toy) -> None:
    m, base, eb = toy
    p = plan(m, preset=PRESET, gpu_mem=base + 19 * eb, reserve=0, n_ctx=CTX)  # 19 experts: two whole layers
    assert not p.realization.exact and p.hit_rate == pytest.approx(19 / 32) and p.realization.hit_rate == 0.5
    assert realize(p) == {"n_ctx": CTX, "n_gpu_layers": 999, "n_cpu_moe": 2, "override_tensor": None}
    line = describe(p)
    assert "59.4% planned, 50.0% realized" in line and "coarsened to whole layers" in line
    assert "--n-cpu-moe 2" in line and "cannot be expressed" not in line  # said once, in the line's own words
    few = plan(m, preset=PRESET, gpu_mem=base + 7 * eb, reserve=0, n_ctx=CTX)  # not one whole layer
    assert realize(few)["n_cpu_moe"] == 4 and few.realization.hit_rate == 0.0


def test_partial_cache_on_a_device_is_realized_per_expert(toy: Toy) -> None:
    """With a device for the cache, the planned experts themselves go there (rapidmoe's expert cache)."""
    m, base, eb = toy
    p = plan(m, preset=PRESET, gpu_mem=base + 19 * eb, reserve=0, n_ctx=CTX)
    kw = realize(p, cache_device="CUDA0")
    cache = kw["expert_cache"]
    assert cache.experts == {il: list(v) for il, v in p.cached.items() if v} and cache.policy == "static"
    assert sum(map(len, cache.experts.values())) == 19 and cache.device == "CUDA0"
    assert (kw["n_gpu_layers"], kw["n_cpu_moe"], kw["override_tensor"]) == (999, 0, ["exps=CPU"])
    line = describe(p, kw)
    assert "59.4% planned: per-expert WQ cache on CUDA0 (19 experts in 4 layers" in line and "realized" not in line
    # nothing to cache per expert: the flags as before, with or without a device
    full = plan(m, preset=PRESET, gpu_mem=base + 32 * eb, reserve=0, n_ctx=CTX)
    assert realize(full, cache_device="CUDA0") == realize(full)


@pytest.mark.slow
def test_planned_cache_on_the_rpc_device_gives_the_cpu_logits(make_split) -> None:  # type: ignore[no-untyped-def]
    """The realized per-expert plan of a split pair, with the RPC stand-in as the GPU: the planned experts are in
    the device's cache, the hit rate is counted, and the logits equal the plain-layout all-CPU run bit for bit.
    Both runs use one CPU kernel per quant type (tests/cache_reference.py: the reference keeps the plain layout
    as the cache run does, and ggml's tiled kernel, chosen by rows per expert, is off)."""
    _, wq, wr = make_split("qwen3moe", EXACT_PRESET)
    whole = plan_for_model(wq, wr, gpu_mem=None, n_ctx=CTX, reserve=0)
    routed = whole.device_bytes(GPU, ROUTED)
    budget = whole.vram - routed // 2  # about half the experts
    p = plan_for_model(wq, wr, gpu_mem=budget, n_ctx=CTX, reserve=0)
    assert p.cached and not p.realization.exact
    toks = list(range(100, 124))
    (cpu, _), (dev, _), info = without_tiled(realized_plan, str(wq), str(wr), budget, CTX, toks)
    assert info["kw"]["expert_cache"].experts == {il: list(v) for il, v in p.cached.items() if v}  # the same plan
    assert info["buffer"] == info["device"]
    print(f"max |dev - cpu| {np.abs(dev - cpu).max()}, hit rate {info['hit_rate']:.3f}")
    assert np.array_equal(dev, cpu)
    assert 0 < info["hit_rate"] < 1


def test_cpu_only_fallback_offloads_nothing(toy: Toy) -> None:
    m, base, _ = toy
    for budget in (0, base - 1):
        p = plan(m, preset=PRESET, gpu_mem=budget, reserve=0, n_ctx=CTX)
        assert p.scheme == "cpu-only"
        assert realize(p) == {"n_ctx": CTX, "n_gpu_layers": 0, "n_cpu_moe": 0, "override_tensor": None}
        assert "cpu-only plan" in describe(p)


def test_cpu_offload_baseline_and_override_flags(toy: Toy) -> None:
    m, _, _ = toy
    off = plan(m, "cpu-offload", reserve=0, n_ctx=CTX)
    assert realize(off) == {"n_ctx": CTX, "n_gpu_layers": 999, "n_cpu_moe": 4, "override_tensor": None}
    r = dataclasses.replace(off.realization, args=("-ngl", "999", "-ot", "exps=CPU", "-ot", "attn=CPU", "-c", "64"))
    assert realize(dataclasses.replace(off, realization=r)) == {
        "n_ctx": 64, "n_gpu_layers": 999, "n_cpu_moe": 0, "override_tensor": ["exps=CPU", "attn=CPU"]}
    for bad, message in ((("--mlock", "1"), "cannot realize placement flag '--mlock'"),
                         (("-ngl",), "flag/value pairs"), (("-ngl", "all"), "needs an integer")):
        with pytest.raises(PlanError, match=message):
            realize(dataclasses.replace(off, realization=dataclasses.replace(r, args=bad)))


def test_a_plan_that_does_not_fit_is_refused(toy: Toy) -> None:
    m, _, _ = toy
    with pytest.raises(PlanError, match=r"does not fit: needs .* of GPU memory, the budget is 1\.0 KiB"):
        realize(plan(m, "full-gpu", gpu_mem=1024, reserve=0))
    with pytest.raises(PlanError, match=r"does not fit: needs .* of CPU memory"):
        realize(plan(m, preset=PRESET, cpu_mem=1024))


# --- plans of files as they are loaded ---------------------------------------------------------------------------

def test_plan_of_a_file_uses_its_own_types(tiny_model: Path) -> None:
    p = plan_for_model(tiny_model, gpu_mem=None, n_ctx=CTX, reserve=0)
    real = GGUFFile(tiny_model).tensors
    assert p.device_bytes(GPU, ROUTED) == sum(int(t.n_bytes) for t in real if classify(t.name) == ROUTED)
    assert p.vram + p.dram == sum(int(t.n_bytes) for t in real) + read_kv(p)
    assert "no sidecar" in p.types and p.fits and realize(p)["n_gpu_layers"] == 999


def read_kv(p) -> int:  # type: ignore[no-untyped-def]
    return sum(r.bytes for r in p.rows if r.part == "KV cache")


def test_plan_of_a_split_pair_uses_the_sidecars_preset(make_split) -> None:  # type: ignore[no-untyped-def]
    _, wq, wr = make_split("qwen3moe", "cpu")
    assert sidecar_preset(wr) == PRESET
    p = plan_for_model(wq, wr, gpu_mem=None, n_ctx=CTX, reserve=0)
    side = sum(r.bytes for r in p.rows if r.detail == "RESplit sidecar")
    assert side == sum(int(t.n_bytes) for t in GGUFFile(wr).tensors) and "sidecar of preset cpu" in p.types
    assert all(r.device == CPU for r in p.rows if r.detail == "RESplit sidecar")


# --- the commands -------------------------------------------------------------------------------------------------

def _run(*args: str) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([sys.executable, "-m", "rapidmoe.cli", "run", *args], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    return res


def _placement_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("INFO rapidmoe.cli.budget: placement:")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_run_gpu_mem_logs_the_plan_and_gives_the_same_text(tiny_qwen: Path, tmp_path: Path) -> None:
    hand = _run(str(tiny_qwen), *RUN).stdout
    full = plan_for_model(tiny_qwen, gpu_mem=None, n_ctx=CTX, reserve=0)
    base = full.vram - full.device_bytes(GPU, ROUTED)
    eb = full.device_bytes(GPU, ROUTED) // (full.n_moe_layers * full.n_expert)
    freq = tmp_path / "freq.json"
    freq.write_text(json.dumps({"0": [1] * 8, "1": [5, 1, 1, 1, 1, 1, 1, 1]}))
    cases = [  # (extra args, what the line must say)
        (["--gpu-mem", "2GiB"], ["resplit plan for GPU budget 2.0 GiB", "16/16 experts on the GPU",
                                 "GPU hit rate 100.0%", "flags -ngl 999 -c 256"]),
        (["--gpu-mem", str(base + 12 * eb), "--reserve", "0", "--freq", str(freq)],
         ["12/16 experts on the GPU", "planned, 50.0% realized", "coarsened to whole layers",
          f"expert frequencies {freq}", "flags -ngl 999 --n-cpu-moe 1 -c 256"]),
        (["--gpu-mem", "0"], ["cpu-only plan for GPU budget 0 B", "VRAM 0 B", "flags -ngl 0 -c 256"]),
    ]
    for extra, says in cases:
        res = _run(str(tiny_qwen), *RUN, *extra)
        line = _placement_line(res.stderr)
        for s in ["DRAM", *says]:
            assert s in line, (s, line)
        assert ("no GPU device here" in line) == (NO_GPU and "-ngl 0" not in line)
        if NO_GPU:  # llama.cpp runs every layer on the CPU whatever -ngl says: the same greedy text
            assert res.stdout == hand, extra


def test_run_gpu_mem_with_a_sidecar(make_split) -> None:  # type: ignore[no-untyped-def]
    _, wq, wr = make_split("qwen3moe", "cpu")
    split = [str(wq), "--residual", str(wr), "-r", "1", *RUN]
    hand = _run(*split).stdout
    res = _run(*split, "--gpu-mem", "4GiB")
    line = _placement_line(res.stderr)
    assert "sidecar of preset cpu" in line and "GPU hit rate 100.0%" in line and "-ngl 999" in line
    if NO_GPU:
        assert res.stdout == hand


def test_serve_gpu_mem_sets_the_servers_placement(tiny_qwen: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    seen: list[Any] = []
    monkeypatch.setattr("rapidmoe.server.run_server", seen.append)
    with caplog.at_level(logging.INFO, logger="rapidmoe.cli.budget"):
        res = runner.invoke(app, ["serve", str(tiny_qwen), "--gpu-mem", "0", "-c", "512"])
    assert res.exit_code == 0, res.output
    assert (seen[0].n_gpu_layers, seen[0].n_cpu_moe, seen[0].override_tensor) == (0, 0, ())
    assert "cpu-only plan" in caplog.text and "flags -ngl 0 -c 512" in caplog.text
    res = runner.invoke(app, ["serve", str(tiny_qwen), "--gpu-mem", "8GiB", "-c", "512"])
    assert res.exit_code == 0, res.output
    assert (seen[1].n_gpu_layers, seen[1].n_cpu_moe, seen[1].override_tensor) == (999, 0, ())
    res = runner.invoke(app, ["serve", str(tiny_qwen), "-ngl", "3", "-ot", "exps=CPU"])
    assert res.exit_code == 0, res.output
    assert (seen[2].n_gpu_layers, seen[2].override_tensor) == (3, ("exps=CPU",))  # by hand, as before


@pytest.mark.parametrize("command", ["run", "serve"])
@pytest.mark.parametrize("args, message", [
    (["--gpu-mem", "8GiB", "-ngl", "0"], "cannot be combined with -ngl/--n-gpu-layers"),
    (["--gpu-mem", "8GiB", "--n-cpu-moe", "1"], "cannot be combined with --n-cpu-moe"),
    (["--gpu-mem", "8GiB", "-ot", "exps=CPU", "-ngl", "99"], "cannot be combined with -ngl/--n-gpu-layers, -ot"),
    (["--gpu-mem", "24XB"], "Invalid value for '--gpu-mem': cannot read memory size '24XB'"),
    (["--gpu-mem", "-1GiB"], "cannot read memory size '-1GiB'"),
    (["--gpu-mem", "8GiB", "--reserve", "lots"], "Invalid value for '--reserve': cannot read memory size 'lots'"),
    (["--reserve", "0"], "--reserve only applies with --gpu-mem"),
    (["--freq", "f.npy", "--reserve", "0"], "--reserve and --freq only apply with --gpu-mem"),
])
def test_bad_combinations_are_usage_errors(command: str, args: list[str], message: str, tiny_qwen: Path) -> None:
    res = runner.invoke(app, [command, str(tiny_qwen), *args])
    assert res.exit_code == 2, res.output
    assert message in _flat(res.output)


def test_plan_problems_are_one_line_errors(tiny_qwen: Path, tmp_path: Path) -> None:
    res = runner.invoke(app, ["run", str(tiny_qwen), "--gpu-mem", "8GiB", "--freq", str(tmp_path / "none.npy")])
    assert res.exit_code == 1 and "rapidmoe-cli: error: frequency file not found" in res.output
    (tmp_path / "bad.json").write_text(json.dumps([[1, 2, 3]]))
    res = runner.invoke(app, ["serve", str(tiny_qwen), "--gpu-mem", "8GiB", "--freq", str(tmp_path / "bad.json")])
    assert res.exit_code == 1 and "rapidmoe-cli: error:" in res.output and "rows" in res.output


@pytest.mark.parametrize("command", ["run", "serve"])
def test_help_lists_the_budget(command: str) -> None:
    res = runner.invoke(app, [command, "--help"])
    assert res.exit_code == 0
    out = _flat(res.output)
    assert "--gpu-mem" in out and "--reserve" in out and "--freq" in out and "Not with --gpu-mem" in out
