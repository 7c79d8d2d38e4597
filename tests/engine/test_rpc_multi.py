"""Several hosts through llama.cpp's RPC backend, on loopback: two rpc-servers of this package's build, the model's
layers split across both (llama.cpp's -ngl with --rpc A,B), the routed WQ experts spread over both with the
sidecar here; logits equal to the all-CPU run (same CPU kernels in every process). Also the CLI: `--rpc` on run,
and `rapidmoe-cli rpc-server`."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from server_proc import ServerProc
from testkit import EXACT_PRESET, TEXT  # EXACT_PRESET: Q8_0, plain: the same CPU kernel in every process

from rapidmoe import Llama, RapidMoEError, _children
from rapidmoe.ggufio import GGUFFile
from rapidmoe.placement import plan, read_gguf_shapes
from rapidmoe.placement.footprint import footprint
from rapidmoe.placement.multidevice import gpu_layer_bytes, plan_across
from rapidmoe.placement.typeplan import native_types
from rapidmoe.rpc import RPC_SERVER, RPCServer, _free_port, parse_servers, server_command

pytestmark = [pytest.mark.native, pytest.mark.usefixtures("plain_q8_0")]  # one Q8_0 kernel everywhere

TOL = 1e-3  # relative L2 of the logits (measured: 0)


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[RPCServer, RPCServer]]:
    with RPCServer(threads=1) as a, RPCServer(threads=1) as b:
        yield a, b


def _logits(path: Path, toks: list[int], **kw) -> tuple[np.ndarray, dict[str, str]]:  # type: ignore[no-untyped-def]
    names = kw.pop("where", [])
    llm = Llama(path, n_ctx=128, logits_all=True, verbose=False, n_threads=2, **kw)
    try:
        llm.eval(toks)
        return np.array(llm.scores[: len(toks)], dtype=np.float64), {n: llm.tensor_buffer(n) for n in names}
    finally:
        llm.close()


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _layers(path: Path) -> tuple[int, list[int]]:
    f = GGUFFile(path)
    n_layer = int(f.get(f"{f.get('general.architecture')}.block_count"))
    moe = sorted({int(t.name.split(".")[1]) for t in f.tensors if t.name.endswith("ffn_up_exps.weight")})
    return n_layer, moe


def test_parse_servers() -> None:
    assert parse_servers("127.0.0.1:5000, 10.0.0.2:50052") == ["127.0.0.1:5000", "10.0.0.2:50052"]
    assert parse_servers(None) == []
    for bad, msg in [("127.0.0.1:5000,127.0.0.1:5000", "given twice"), (",", "no RPC server"),
                     ("127.0.0.1:5000,host", "bad RPC server address")]:
        with pytest.raises(RapidMoEError, match=msg):
            parse_servers(bad)
    cmd = server_command("0.0.0.0", 6000, threads=3, cache=True)
    assert Path(cmd[0]).name == "rpc-server" and cmd[1:] == ["-H", "0.0.0.0", "-p", "6000", "-t", "3", "-c"]
    with pytest.raises(RapidMoEError, match="unknown ggml device 'NOPE0'"):
        server_command(devices="NOPE0")


@pytest.mark.slow
def test_two_hosts_layers_and_experts(make_split, servers: tuple[RPCServer, RPCServer]) -> None:  # type: ignore[no-untyped-def]
    a, b = servers
    _, wq, wr = make_split("qwen3moe", EXACT_PRESET)
    n_layer, moe = _layers(wq)
    vocab = Llama(wq, n_ctx=64, vocab_only=True, verbose=False)
    toks = vocab.tokenize(TEXT, add_bos=False)[:24]
    vocab.close()
    eps = [a.endpoint, b.endpoint]
    bufts = [a.device.buffer_type, b.device.buffer_type]  # "RPC<n>[host:port]", in registration order

    # 1. stock graph, every layer offloaded: llama.cpp splits the layers over the two devices (by their free memory,
    #    or as -ts says: 1:3 puts the first of the n_layer + 1 offloaded layers on A, the rest on B)
    norms = [f"blk.{i}.attn_norm.weight" for i in range(n_layer)]
    cpu, _ = _logits(wq, toks)
    dev, where = _logits(wq, toks, rpc_servers=eps, n_gpu_layers=-1, tensor_split=[1, 3], where=norms)
    used = [where[n] for n in norms]
    assert set(used) == set(bufts), used  # both hosts hold layers ...
    assert used == sorted(used, key=bufts.index), used  # ... in order: the first host the first layers
    assert _rel(dev, cpu) < TOL, _rel(dev, cpu)

    # 2. split routing, WQ experts of the first half of the MoE layers on host A, the rest on host B (as -ot spells
    #    it), sidecar in this process; at r = 0 and 2 equal to the all-CPU run, and r changes the result
    half = moe[: len(moe) // 2]
    pat = "|".join(str(i) for i in half)
    ot = [f"blk\\.({pat})\\.ffn_.*_exps={bufts[0]}", f"exps={bufts[1]}"]
    exps = [f"blk.{moe[0]}.ffn_up_exps.weight", f"blk.{moe[-1]}.ffn_down_exps.weight", f"blk.{moe[0]}.ffn_up_exps.wr"]
    by_r = {}
    for r in (0, 2):
        cpu, _ = _logits(wq, toks, residual_path=wr, n_critical=r)
        dev, where = _logits(wq, toks, residual_path=wr, n_critical=r, rpc_servers=eps, override_tensor=ot,
                             where=exps)
        assert where[exps[0]] == bufts[0] and where[exps[1]] == bufts[1], where
        assert where[exps[2]] in ("CPU", "CPU_REPACK"), where
        print(f"two hosts r={r}: rel {_rel(dev, cpu):.2e}")
        assert _rel(dev, cpu) < TOL, (r, _rel(dev, cpu))
        by_r[r] = dev
    assert _rel(by_r[2], by_r[0]) > 100 * TOL


@pytest.mark.slow
def test_plan_across_two_hosts_as_llama_cpp_loads_it(make_split, servers: tuple[RPCServer, RPCServer]) -> None:  # type: ignore[no-untyped-def]
    """`plan --gpu-mem A,B`'s layer runs and -ts: llama.cpp puts each layer on the host the plan gives it."""
    a, b = servers
    _, wq, _ = make_split("qwen3moe", EXACT_PRESET)
    m = read_gguf_shapes(wq)
    fp = footprint(m, native_types(m))
    reserve = 1 << 20

    def mk(total: int):  # type: ignore[no-untyped-def]
        return plan(m, "resplit", gpu_mem=total, n_ctx=128, reserve=reserve, as_stored=True)

    lb, _ = gpu_layer_bytes(m, mk(1 << 40), fp)
    multi = plan_across(m, [reserve + lb[0] + 1, 1 << 40], mk, fp, reserve)  # room for exactly the first layer on A
    assert [s.layers for s in multi.shares] == [(0,), tuple(range(1, m.n_layer))] and multi.fits, multi.table()
    bufts = [a.device.buffer_type, b.device.buffer_type]
    llm = Llama(wq, n_ctx=128, verbose=False, rpc_servers=[a.endpoint, b.endpoint], n_gpu_layers=999,
                tensor_split=list(multi.tensor_split))
    try:
        for s in multi.shares:
            for il in s.layers:
                assert llm.tensor_buffer(f"blk.{il}.attn_norm.weight") == bufts[s.index]
        assert llm.tensor_buffer("output_norm.weight") == bufts[-1]
    finally:
        llm.close()


@pytest.mark.slow
def test_cli_run_with_two_rpc_servers(servers: tuple[RPCServer, RPCServer], tiny_qwen: Path) -> None:
    """`rapidmoe-cli run --rpc A,B -ngl 99 -ts 1,3` (a layer on each host) generates the same greedy text as the
    all-CPU run; bad --rpc and -ts values are usage errors."""
    a, b = servers
    base = [sys.executable, "-m", "rapidmoe.cli", "run", str(tiny_qwen), "-p", "Once upon a time", "-n", "12",
            "--temp", "0", "-t", "2"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cpu = subprocess.run(base, capture_output=True, text=True, timeout=300, env=env)
    assert cpu.returncode == 0, cpu.stderr[-1000:]
    dev = subprocess.run([*base, "--rpc", f"{a.endpoint},{b.endpoint}", "-ngl", "99", "-ts", "1,3"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert dev.returncode == 0, dev.stderr[-1000:]
    assert dev.stdout == cpu.stdout and len(cpu.stdout) > len("Once upon a time")
    bad = subprocess.run([*base, "--rpc", "127.0.0.1"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 1 and "bad RPC server address" in bad.stderr
    bad = subprocess.run([*base, "-ts", "1,x"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "not a comma-separated list of numbers" in bad.stderr


@pytest.mark.slow
def test_cli_rpc_server_serves(tiny_qwen: Path) -> None:
    """`rapidmoe-cli rpc-server` runs the package's rpc-server: a model offloads to it. The CLI process becomes the
    server (exec), so ending it leaves no child behind."""
    port = _free_port("127.0.0.1")
    proc = _children.spawn([sys.executable, "-m", "rapidmoe.cli", "rpc-server", "-p", str(port), "-t", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
                time.sleep(0.1)
        if sys.platform.startswith("linux"):
            assert Path(f"/proc/{proc.pid}/exe").resolve() == RPC_SERVER.resolve()
            assert not Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        llm = Llama(tiny_qwen, n_ctx=64, n_gpu_layers=-1, rpc_servers=[f"127.0.0.1:{port}"], verbose=False)
        try:
            buft = llm.tensor_buffer("blk.0.attn_norm.weight")
            assert buft == llm.rpc_devices[0].buffer_type == f"RPC0[127.0.0.1:{port}]"
        finally:
            llm.close()
    finally:
        _children.stop(proc)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.slow
def test_serve_with_two_rpc_servers(servers: tuple[RPCServer, RPCServer], tiny_qwen: Path, tmp_path: Path) -> None:
    """`serve --rpc A,B -ngl 99 -ts 1,3` answers /completion with the same greedy text as an all-CPU serve."""
    a, b = servers
    body = {"prompt": "Once upon a time", "n_predict": 12, "temperature": 0}
    texts = []
    accepted = [srv.output().count("Accepted client connection") for srv in servers]
    for i, extra in enumerate([(), ("--rpc", f"{a.endpoint},{b.endpoint}", "-ngl", "99", "-ts", "1,3")]):
        srv = ServerProc(tiny_qwen, "-np", "1", "-c", "256", "-t", "1", *extra, log_path=tmp_path / f"serve{i}.log")
        try:
            status, out = srv.request("POST", "/completion", body)
            assert status == 200, out
            texts.append(out["content"])
        finally:
            srv.stop()
    assert texts[0] == texts[1] and texts[0]
    assert all(srv.output().count("Accepted client connection") > n for srv, n in zip(servers, accepted, strict=True))
