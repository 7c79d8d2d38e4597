"""Overlap of the CPU's residual work with the device's WQ work (begin/join ops around the WQ matmuls).

The overlapped graph must compute exactly what the serial one does: the worker runs the same masked matmul
kernels on the same inputs, and join adds (or selects) exactly as the serial graph's nodes do. So logits are
compared bit for bit: all-CPU with overlap forced on vs off, and with the WQ experts on the RPC stand-in device
(where "auto" overlaps) vs all-CPU. The serial graph itself is checked against numpy in test_split_routing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from testkit import TEXT

from rapidmoe import Llama, RapidMoEError
from rapidmoe.overlap import OverlapStats, overlap_mode
from rapidmoe.rpc import RPCServer
from rapidmoe.umia import Policy


def _run(wq: Path, wr: Path, r: int | Policy, decode: int = 3, **kw) -> tuple[np.ndarray, OverlapStats]:  # type: ignore[no-untyped-def]
    """Logits of a prompt (one prefill batch) and of `decode` single-token steps, and the overlap timing."""
    crit = {"policy": r} if isinstance(r, Policy) else {"n_critical": r}
    llm = Llama(wq, residual_path=wr, n_ctx=128, logits_all=True, verbose=False, n_threads=2, **crit, **kw)
    try:
        toks = llm.tokenize(TEXT, add_bos=False)[:16]
        llm.eval(toks[:-decode])
        for t in toks[-decode:]:
            llm.eval([t])
        return np.array(llm.scores[: len(toks)], dtype=np.float32), llm.overlap_stats()
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_overlapped_graph_equals_serial_on_the_cpu(arch: str, make_split) -> None:  # type: ignore[no-untyped-def]
    """All-CPU, overlap forced on: the same logits as the serial graph, bit for bit, at r = 0, 1, k, under a UMIA
    policy and for the drop baseline; every split layer ran one begin/join pair per stage and graph."""
    _, wq, wr = make_split(arch)
    llm = Llama(wq, residual_path=wr, vocab_only=False, n_ctx=32, verbose=False)
    assert llm.residual is not None
    k, n_moe = llm.residual.n_expert_used, len(llm.moe_layers)
    llm.close()
    for r in (0, 1, k, Policy(theta=0.6, alpha=0.5, beta=0.25)):
        off, s_off = _run(wq, wr, r, overlap="off")
        on, s_on = _run(wq, wr, r, overlap="on")
        assert np.array_equal(on, off), (r, float(np.abs(on - off).max()))
        assert s_off.pairs == 0
        # one prefill graph + 3 decode graphs, each with one pair per stage in every MoE layer
        assert s_on.gate_up.pairs == s_on.down.pairs == 4 * n_moe, s_on
        for s in (s_on.gate_up, s_on.down):  # the intervals nest by construction
            assert 0 <= s.device_ms <= s.wall_ms and 0 <= s.wait_ms <= s.wall_ms
            assert (s.cpu_ms == 0) == (r == 0)  # no critical slot: begin writes zeros, the worker is not woken
    off, _ = _run(wq, wr, 1, overlap="off", skip_noncritical=True)
    on, _ = _run(wq, wr, 1, overlap="on", skip_noncritical=True)
    assert np.array_equal(on, off)


def test_auto_does_not_overlap_an_all_cpu_model(make_split) -> None:  # type: ignore[no-untyped-def]
    """The default ("auto") overlaps only layers whose WQ experts are on another device."""
    _, wq, wr = make_split("qwen3moe")
    _, stats = _run(wq, wr, 1)
    assert stats.pairs == 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_overlap_with_wq_on_the_rpc_device(arch: str, make_split, rpc: RPCServer) -> None:  # type: ignore[no-untyped-def]
    """WQ experts on the stand-in: "auto" overlaps and gives the all-CPU serial logits exactly, as "off" does.
    Preset cpu-q8: its non-expert matrices are Q8_0, which the CPU runs with the same kernel as the stand-in (x86
    has no repacked Q8_0 layout); the cpu preset's Q4_K attention would be repacked on the CPU and not on the
    stand-in (a different summation order), so "exactly" would compare two kernels rather than two schedules."""
    _, wq, wr = make_split(arch, "cpu-q8")
    on_device: dict[str, Any] = {"rpc_servers": [rpc.endpoint], "override_tensor": f"exps={rpc.device.buffer_type}"}
    for r in (1, 2):
        cpu, _ = _run(wq, wr, r, overlap="off")
        auto, s_auto = _run(wq, wr, r, **on_device)
        serial, s_serial = _run(wq, wr, r, overlap="off", **on_device)
        assert np.array_equal(auto, cpu) and np.array_equal(serial, cpu)
        assert s_auto.pairs > 0 and s_serial.pairs == 0
        assert s_auto.gate_up.cpu_ms > 0 and s_auto.gate_up.device_ms > 0


def test_bad_overlap_arguments(make_split) -> None:  # type: ignore[no-untyped-def]
    _, wq, wr = make_split("qwen3moe")
    with pytest.raises(RapidMoEError, match="overlap must be one of off, auto, on"):
        Llama(wq, residual_path=wr, overlap="sometimes", verbose=False)
    with pytest.raises(RapidMoEError, match="overlap_threads must be >= 1"):
        Llama(wq, residual_path=wr, overlap_threads=0, verbose=False)
    with pytest.raises(RapidMoEError, match="no residual sidecar"):
        llm = Llama(wq, n_ctx=32, verbose=False)
        try:
            llm.overlap_stats()
        finally:
            llm.close()
    assert overlap_mode("on") == 2


def test_cli_run_overlap_and_stats(make_split) -> None:  # type: ignore[no-untyped-def]
    """`run --overlap on --stats` reports the overlap timing; greedy text equals `--overlap off`; a bad mode is
    a usage error naming the choices."""
    _, wq, wr = make_split("qwen3moe")
    base = [sys.executable, "-m", "rapidmoe.cli", "run", str(wq), "--residual", str(wr), "-p", "Hello", "-n", "8",
            "--temp", "0", "-c", "128", "--stats"]
    on = subprocess.run([*base, "--overlap", "on"], capture_output=True, text=True, timeout=300)
    off = subprocess.run([*base, "--overlap", "off"], capture_output=True, text=True, timeout=300)
    assert on.returncode == 0 and off.returncode == 0, on.stderr[-2000:] + off.stderr[-2000:]
    assert on.stdout == off.stdout
    assert "overlap gate/up:" in on.stderr and "overlap down:" in on.stderr and "hidden" in on.stderr
    assert "overlap gate/up:" not in off.stderr
    bad = subprocess.run([*base, "--overlap", "maybe"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "maybe" in bad.stderr and "auto" in bad.stderr
