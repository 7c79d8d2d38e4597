"""Fewer CPU graph nodes, the same bits: the MoE expert sum as one node (patch 0012,
ops/moe-sum/cpu/rapidmoe-moe-sum.cpp) and runs of small nodes on one thread (patch 0013,
backend/cpu/rapidmoe-tiny-run.cpp). A small program
(native/moe_sum_check.cpp) builds build_moe_ffn's tail with ggml and runs it through the CPU backend fused and with
RAPIDMOE_MOE_SUM=0, against a scalar reference of the nodes' float operations; then whole models (split routing at
r = 0 and r = 1, qwen3moe and deepseek2 with its shared expert) give the same logits with each switched on and off,
and the fused node and the runs are what their graphs ran."""
from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from reference.split_logits import prompt_tokens
from testkit import ROOT, ggml_cpu_counter

from rapidmoe import Llama
from rapidmoe._runtime import LIB_DIR

CHECK = Path(__file__).parent / "native" / "moe_sum_check.cpp"
FUSED = ("decode-k8", "decode-k8-split-resid", "decode-odd-width", "decode-k2", "prompt-rows", "one-thread",
         "out-over-down-rows", "out-over-down-decode")


def test_fused_tail_is_llama_cpps_nodes_bit_for_bit(tmp_path: Path) -> None:
    """Decode rows split across 2-4 threads (a width that is not a multiple of 16 too), a 37-row prompt batch, one
    thread, top-2 to top-8, with and without split routing's ADD in front and the residual ADD after: the fused node
    ran (the intermediate tensors kept their sentinel) and both runs equal the reference's bits. A tail whose
    weighted results are read by another node is not fused and still right. An output placed over the down results
    (memory ggml's allocator may hand out once the separate nodes had read them) is written after every thread read.
    A tail of no rows (the last layer of a prompt chunk without outputs) computes nothing."""
    exe = tmp_path / "moe_sum_check"
    ggml = ROOT / "vendor" / "llama.cpp" / "ggml"
    subprocess.run(["g++", "-O2", "-std=c++17", "-ffp-contract=off", str(CHECK), f"-I{ggml / 'include'}",
                    f"-L{LIB_DIR}", "-lggml", "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{LIB_DIR}", "-o", str(exe)],
                   check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RAPIDMOE_MOE_SUM", "GGML_CPU_DISABLE_FUSION")}
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "checked 10 cases, 0 wrong" in out.stdout, out.stdout + out.stderr
    cases = {m[1]: tuple(int(v) for v in m.groups()[1:])
             for m in re.finditer(r"case (\S+) unfused_equal (\d) fused_equal (\d) fused_ran (\d) unfused_ran (\d)",
                                  out.stdout)}
    for name in FUSED:
        assert cases[name] == (1, 1, 1, 0), (name, out.stdout)
    assert cases["used-elsewhere"] == (1, 1, 0, 0), out.stdout
    assert cases["no-rows"][:2] == (1, 1), out.stdout  # nothing to compute, and no crash (it divided by zero once)


@pytest.fixture
def fusion_switch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("GGML_CPU_DISABLE_FUSION", "RAPIDMOE_MOE_SUM", "RAPIDMOE_TINY_RUN"):
        monkeypatch.delenv(var, raising=False)
    yield


def _logits(wq: Path, wr: Path, r: int, toks: list[int], counter: str = "rapidmoe_moe_sum_count",
            threads: int = 2) -> tuple[np.ndarray, int]:
    """Every position of a prompt batch, then 4 decode steps (one token each), as float32 rows, from a fresh context;
    and how much the counter grew meanwhile."""
    llm = Llama(wq, n_ctx=128, logits_all=True, verbose=False, n_threads=threads, n_threads_batch=threads,
                residual_path=wr, n_critical=r)
    before = ggml_cpu_counter(counter)
    llm.eval(toks[:16])
    for t in toks[16:20]:
        llm.eval([t])
    out = np.array(llm.scores[:20], dtype=np.float32)
    ran = ggml_cpu_counter(counter) - before
    llm.close()
    return out, ran


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_models_give_the_same_logits_fused_and_not(arch: str, make_split, fusion_switch: None,  # type: ignore[no-untyped-def]
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _, wq, wr = make_split(arch)
    toks = prompt_tokens(wq)
    for r in (0, 1):
        monkeypatch.delenv("RAPIDMOE_MOE_SUM", raising=False)
        fused, ran = _logits(wq, wr, r, toks)
        monkeypatch.setenv("RAPIDMOE_MOE_SUM", "0")  # read by the op at each call
        plain, off = _logits(wq, wr, r, toks)
        assert ran >= 5, (arch, r, ran)  # the MoE layers of the prompt batch and of each decode step
        assert off == 0, (arch, r, off)
        assert np.array_equal(fused.view(np.uint32), plain.view(np.uint32)), (arch, r)


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
@pytest.mark.parametrize("threads", [2, 3])
def test_tiny_runs_give_the_same_logits(arch: str, threads: int, make_split, fusion_switch: None,  # type: ignore[no-untyped-def]
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of small nodes on one thread (the default threshold, and one so large that every elementwise, row-wise
    and copy node of the prompt batch joins a run) give the bits of the graph without runs (RAPIDMOE_TINY_RUN=0),
    with the fused expert sum inside the runs and without it."""
    _, wq, wr = make_split(arch)
    toks = prompt_tokens(wq)
    for r in (0, 1):
        monkeypatch.setenv("RAPIDMOE_TINY_RUN", "0")
        plain, none = _logits(wq, wr, r, toks, "rapidmoe_tiny_run_count", threads)
        assert none == 0, (arch, r, none)
        for limit in (None, "100000000"):
            for moe_sum in (None, "0"):
                if limit is None:
                    monkeypatch.delenv("RAPIDMOE_TINY_RUN", raising=False)
                else:
                    monkeypatch.setenv("RAPIDMOE_TINY_RUN", limit)
                if moe_sum is None:
                    monkeypatch.delenv("RAPIDMOE_MOE_SUM", raising=False)
                else:
                    monkeypatch.setenv("RAPIDMOE_MOE_SUM", moe_sum)
                runs, ran = _logits(wq, wr, r, toks, "rapidmoe_tiny_run_count", threads)
                assert ran >= 10, (arch, r, limit, moe_sum, ran)  # several a layer and step
                assert np.array_equal(runs.view(np.uint32), plain.view(np.uint32)), (arch, r, limit, moe_sum)
