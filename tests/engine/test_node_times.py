"""Per-node times of the CPU graph loop (patch 0019, backend/cpu/rapidmoe-node-times.cpp) through
tools/profile_nodes.py: the kinds of node a split-routing decode step computes, how many of each a token, and the
weight bytes each matmul reads, against the model file's own tensor sizes (gguf-py); the file format's errors."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from gguf import GGUFReader
from testkit import ROOT

TOOL = ROOT / "tools" / "profile_nodes.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("profile_nodes", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["profile_nodes"] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


def _field(reader: GGUFReader, suffix: str) -> int:
    key = next(k for k in reader.fields if k.endswith(suffix))
    return int(reader.fields[key].parts[-1][0])


@pytest.mark.slow
@pytest.mark.native
def test_decode_nodes_and_their_weight_bytes(make_split, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """r = 1 on a tiny qwen3moe pair: per token, one gate, up and down matmul of 8 routed experts per layer, each
    reading top-k experts' matrices of the .wq.gguf; the sidecars (masked) one expert's of the .wr.gguf; the output
    head its whole matrix once; thread 0's node times fit in the measured wall time."""
    _, wq, wr = make_split("qwen3moe")
    out_json = tmp_path / "nodes.json"
    steps = 6
    run = subprocess.run([sys.executable, str(TOOL), str(wq), "--residual", str(wr), "-r", "1", "--steps", str(steps),
                          "--top", "500", "--json", str(out_json)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    res = json.loads(out_json.read_text())
    rows = {(r["op"], r["name"]): r for r in res["rows"]}

    q = GGUFReader(wq)
    w = GGUFReader(wr)
    n_layer = _field(q, ".block_count")
    n_expert = _field(q, ".expert_count")
    k = _field(q, ".expert_used_count")
    q_bytes = {t.name: int(t.n_bytes) for t in q.tensors}
    w_bytes = {t.name: int(t.n_bytes) for t in w.tensors}

    def routed(names: dict[str, int], suffix: str, experts: int) -> float:
        return sum(names[f"blk.{il}.{suffix}"] // n_expert * experts for il in range(n_layer)) / 1e6

    up = rows["MUL_MAT_ID", "ffn_moe_up"]
    assert up["per_token"] == pytest.approx(n_layer)
    assert up["weight_mb"] == pytest.approx(routed(q_bytes, "ffn_up_exps.weight", k), rel=1e-6)
    up_wr = rows["MUL_MAT_ID_MASKED", "rapidmoe_up_wr"]
    assert up_wr["per_token"] == pytest.approx(n_layer)
    assert up_wr["weight_mb"] == pytest.approx(routed(w_bytes, "ffn_up_exps.wr", 1), rel=1e-6)
    head = rows["MUL_MAT", "result_output"]
    head_name = "output.weight" if "output.weight" in q_bytes else "token_embd.weight"
    assert head["per_token"] == pytest.approx(1.0)
    assert head["weight_mb"] == pytest.approx(q_bytes[head_name] / 1e6, rel=1e-6)
    assert all(r["compute0_us"] >= 0 and r["wait0_us"] >= 0 for r in res["rows"])
    node_ms = sum(r["compute0_us"] + r["wait0_us"] for r in res["rows"]) / 1e3
    assert 0 < node_ms <= res["ms_per_token"] * 1.05, (node_ms, res["ms_per_token"])


def test_reading_a_file_that_is_not_node_times(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tsv"
    bad.write_text("op\tname\n")
    with pytest.raises(ValueError, match="not a RAPIDMOE_NODE_TIMES file"):
        _tool().read_times(bad)


def test_a_missing_model_is_refused(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(TOOL), str(tmp_path / "none.gguf")], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and "no such model" in run.stderr
