"""A second ggml device on a CPU-only machine: llama.cpp's RPC backend with a local rpc-server as the stand-in.

The routed-expert WQ tensors (or whole layers, -ngl) live in the rpc-server process and are computed there; the
sidecar stays in this process's CPU memory and its masked matmuls run here. Logits must match the all-CPU run,
at every r and under a UMIA policy, and the tensors must really be where the placement says."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from testkit import EXACT_PRESET, TEXT

from rapidmoe import Llama, RapidMoEError
from rapidmoe.ggufio import GGUFFile
from rapidmoe.rpc import RPCServer, parse_endpoint
from rapidmoe.umia import Policy

pytestmark = pytest.mark.usefixtures("plain_q8_0")  # one Q8_0 kernel in both processes (conftest)

TOL = 1e-3  # relative L2 of the logits (measured: 0, the same CPU kernels run in both processes)
RPC_THREADS = 2  # conftest's rpc fixture: the stand-in's threads


def _logits(path: Path, toks: list[int], n_critical: int | Policy | None = None,
            **kw: Any) -> tuple[np.ndarray, dict[str, str]]:
    """Logits of every position, and where the named tensors ended up."""
    names = kw.pop("where", [])
    if isinstance(n_critical, Policy):
        kw["policy"] = n_critical
    elif n_critical is not None:
        kw["n_critical"] = n_critical
    llm = Llama(path, n_ctx=128, logits_all=True, verbose=False, n_threads=2, **kw)
    try:
        llm.eval(toks)
        out = np.array(llm.scores[: len(toks)], dtype=np.float64)
        return out, {n: llm.tensor_buffer(n) for n in names}
    finally:
        llm.close()


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _tokens(path: Path) -> list[int]:
    llm = Llama(path, n_ctx=128, vocab_only=True, verbose=False)
    toks = llm.tokenize(TEXT, add_bos=False)[:24]
    llm.close()
    return toks


def _first_moe_layer(path: Path) -> int:
    return min(int(t.name.split(".")[1]) for t in GGUFFile(path).tensors if t.name.endswith("ffn_up_exps.weight"))


def test_bad_and_unreachable_addresses(make_split) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RapidMoEError, match="bad RPC server address"):
        parse_endpoint("localhost")
    with pytest.raises(RapidMoEError, match="bad RPC server address"):
        parse_endpoint("127.0.0.1:99999")
    srv = RPCServer()
    endpoint = srv.endpoint
    srv.stop()  # nothing listens there now: a clear error, not ggml's abort
    with pytest.raises(RapidMoEError, match="not reachable"):
        Llama(make_split("qwen3moe")[1], rpc_servers=[endpoint])
    with pytest.raises(RapidMoEError, match="bad RPC server address"):
        Llama(make_split("qwen3moe")[1], rpc_servers=["127.0.0.1"])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_stock_model_on_the_rpc_device(arch: str, make_split, rpc: RPCServer) -> None:  # type: ignore[no-untyped-def]
    """No sidecar: the stock graph with every layer on the stand-in device (-ngl) equals the all-CPU run."""
    _, wq, _ = make_split(arch, EXACT_PRESET)
    toks = _tokens(wq)
    buft = rpc.device.buffer_type  # "RPC<n>[host:port]": n counts servers registered earlier in this process
    exps = f"blk.{_first_moe_layer(wq)}.ffn_up_exps.weight"
    cpu, _ = _logits(wq, toks)
    dev, where = _logits(wq, toks, rpc_servers=[rpc.endpoint], n_gpu_layers=-1, where=[exps, "blk.1.attn_norm.weight"])
    assert where == {exps: buft, "blk.1.attn_norm.weight": buft}
    print(f"{arch} stock -ngl: rel {_rel(dev, cpu):.2e}")
    assert _rel(dev, cpu) < TOL, _rel(dev, cpu)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
@pytest.mark.parametrize("placement", ["exps", "ngl"])
def test_split_routing_with_wq_on_the_rpc_device(arch: str, placement: str, make_split, rpc: RPCServer) -> None:  # type: ignore[no-untyped-def]
    """WQ experts on the stand-in (only them, or every layer), sidecar in CPU memory: the same logits as all-CPU
    at r = 0, 1, 2 and k, and under a UMIA policy."""
    _, wq, wr = make_split(arch, EXACT_PRESET)
    toks = _tokens(wq)
    f = GGUFFile(wq)
    k = int(f.get(f"{f.get('general.architecture')}.expert_used_count"))
    buft = rpc.device.buffer_type  # "RPC<n>[host:port]": n counts servers registered earlier in this process
    layer = _first_moe_layer(wq)
    names = [f"blk.{layer}.ffn_{p}_exps.weight" for p in ("up", "gate", "down")]
    side = [f"blk.{layer}.ffn_up_exps.wr", f"blk.{layer}.ffn_gate_exps.wr"]
    placed = ({"override_tensor": f"exps={buft}"} if placement == "exps" else {"n_gpu_layers": -1})
    by_r: dict[int, np.ndarray] = {}
    for r in sorted({0, 1, 2, k}):
        cpu, _ = _logits(wq, toks, r, residual_path=wr)
        dev, where = _logits(wq, toks, r, residual_path=wr, rpc_servers=[rpc.endpoint], where=names + side, **placed)
        assert all(where[n] == buft for n in names), where
        # the sidecar never leaves this process's memory
        assert all(where[n] in ("CPU", "CPU_REPACK") for n in side), where
        print(f"{arch} {placement} r={r}: rel {_rel(dev, cpu):.2e}")
        assert _rel(dev, cpu) < TOL, (r, _rel(dev, cpu))
        by_r[r] = dev
    assert _rel(by_r[k], by_r[0]) > 100 * TOL  # the split is active on the device run: r changes the result
    policy = Policy(theta=0.6, alpha=0.5, beta=0.25)
    cpu, _ = _logits(wq, toks, policy, residual_path=wr)
    dev, _ = _logits(wq, toks, policy, residual_path=wr, rpc_servers=[rpc.endpoint], **placed)
    print(f"{arch} {placement} UMIA: rel {_rel(dev, cpu):.2e}")
    assert _rel(dev, cpu) < TOL, _rel(dev, cpu)

