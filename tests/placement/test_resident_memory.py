"""The host memory `plan` predicts is the memory a loaded model takes: the process's RSS grows by the plan's figure
(within 10 %) for the CPU-only and the per-expert-cache realizations, and its file-backed part is the plan's (weights
used in place from the mapped files). Before patch 0022 and the sidecar's in-place mapping, repacked weights stayed
resident twice (their mapped pages beside the repacked copy) and the sidecar was copied into anonymous memory: the
same loads measured with RAPIDMOE_KEEP_MAPPED=1 RAPIDMOE_SIDECAR_MMAP=0 (the old behaviour) miss the plan."""
from __future__ import annotations

import itertools
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from testkit import SANITIZED

from rapidmoe.placement.resident import _cpu_flags, _x86_rule, machine_repacks, process_memory, used_in_place
from rapidmoe.placement.tensors import TensorShape

OLD = {"RAPIDMOE_KEEP_MAPPED": "1", "RAPIDMOE_SIDECAR_MMAP": "0"}
CTX = 512

MEASURE = """
import json, sys
from rapidmoe import Llama
from rapidmoe.placement.resident import process_memory
from rapidmoe.placement.realize import plan_for_model, realize
from rapidmoe.placement.planner import GPU
from rapidmoe.placement.tensors import ROUTED
import rapidmoe._runtime  # the libraries, before the first reading
wq, wr, mode, ctx = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if mode == "cpu":
    p = plan_for_model(wq, wr, gpu_mem=0, n_ctx=ctx)
    kw, rpc, srv = {"n_ctx": ctx}, [], None
    want, want_file = p.resident, p.dram_file
else:
    from rapidmoe.rpc import RPCServer
    srv = RPCServer(threads=1).__enter__()
    whole = plan_for_model(wq, wr, gpu_mem=None, n_ctx=ctx, reserve=0)
    p = plan_for_model(wq, wr, gpu_mem=whole.vram - whole.device_bytes(GPU, ROUTED) // 2, n_ctx=ctx, reserve=0)
    kw, rpc = realize(p, cache_device=srv.device.buffer_type), [srv.endpoint]
    assert "expert_cache" in kw
    want, want_file = p.resident_cached, p.cache_dram_file
a = process_memory()
llm = Llama(wq, residual_path=wr, rpc_servers=rpc, n_threads=2, verbose=False, **kw)
b = process_memory()
llm.close()
if srv is not None:
    srv.__exit__(None, None, None)
print(json.dumps({"rss": b[0] + b[1] - a[0] - a[1], "file": b[1] - a[1], "plan": want, "plan_file": want_file}))
"""

# Loads a model with a progress callback that reads /proc/self/maps: the regions that map the model file, at each
# callback before the last (the loader unmaps what it does not use in place just before that one).
HOLES = """
import ctypes, json, sys
from rapidmoe._runtime import llama_cpp as lc
from rapidmoe.rpc import RPCServer, model_devices, register_rpc_servers
path, mode = sys.argv[1], sys.argv[2]
seen = []
@lc.llama_progress_callback
def progress(value, _):
    if value < 1.0:
        spans = [line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith(path)]
        seen.append(sorted(tuple(int(x, 16) for x in s.split("-")) for s in spans))
    return True
p = lc.llama_model_default_params()
p.progress_callback = progress
srv = None
if mode == "rpc":
    srv = RPCServer(threads=1).__enter__()
    devs = model_devices(register_rpc_servers([srv.endpoint]))
    p.devices, p.n_gpu_layers = ctypes.addressof(devs), 99
model = lc.llama_model_load_from_file(path.encode(), p)
assert model
lc.llama_model_free(model)
if srv is not None:
    srv.__exit__(None, None, None)
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def pairs(vocab_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """A model whose weights outweigh the runtime (4 layers x 64 experts of 512x512, 0.5 GB in F16) as refine-hq
    (Q3_K experts, repacked; bit planes mapped) and cpu (Q2_K experts and residuals, repacked) pairs."""
    from rapidmoe.resplit import convert, get_preset  # noqa: PLC0415 - the compiled parts
    from rapidmoe.synthetic import spec_for, write_model  # noqa: PLC0415

    work = tmp_path_factory.mktemp("resident")
    spec = spec_for("qwen3moe", "tiny", n_embd=512, n_ff_exp=512, n_layer=4, n_expert=64, n_expert_used=8,
                    vocab="gpt-2")
    src = write_model(spec, work / "m.gguf", vocab_dir)
    out = {}
    for preset in ("refine-hq", "cpu"):
        res = convert(src, work / preset, get_preset(preset), progress=False)
        out[preset] = (res.wq_path, res.wr_path)
    return out


def _measure(wq: Path, wr: Path, mode: str, env: dict[str, str] | None = None) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", MEASURE, str(wq), str(wr), mode, str(CTX)], capture_output=True,
                         text=True, env={**os.environ, **(env or {})}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


@pytest.mark.slow
@pytest.mark.native
@pytest.mark.skipif(process_memory() is None, reason="needs /proc/self/status (Linux)")
@pytest.mark.skipif(SANITIZED, reason="AddressSanitizer's shadow memory and redzones add to RSS")
@pytest.mark.parametrize(("preset", "mode"), [("refine-hq", "cpu"), ("cpu", "cpu"), ("cpu", "cache")])
def test_rss_after_load_is_the_plans(pairs: dict[str, tuple[Path, Path]], preset: str, mode: str) -> None:
    wq, wr = pairs[preset]
    m = _measure(wq, wr, mode)
    assert abs(m["rss"] - m["plan"]) <= 0.10 * m["plan"], m
    assert abs(m["file"] - m["plan_file"]) <= 0.10 * m["plan"], m
    old = _measure(wq, wr, mode, OLD)
    assert abs(old["rss"] - old["plan"]) > 0.10 * old["plan"] or \
        abs(old["file"] - old["plan_file"]) > 0.10 * old["plan"], old


def test_what_stays_in_the_file() -> None:
    """Token embeddings (GET_ROWS) and 1-D tensors are used in place; matrices as the CPU's rule says; with
    repacking off everything is."""
    rule = _x86_rule(frozenset({"avx2", "avx512_vnni"}))
    emb = TensorShape("token_embd.weight", (512, 1000), "Q4_K")
    norm = TensorShape("blk.0.attn_norm.weight", (512,), "F32")
    attn = TensorShape("blk.0.attn_q.weight", (512, 512), "Q4_K")
    exps = TensorShape("blk.0.ffn_up_exps.weight", (512, 256, 8), "Q3_K")
    assert used_in_place(emb, "Q4_K", rule, 8) and used_in_place(norm, "F32", rule, 8)
    assert not used_in_place(attn, "Q4_K", rule, 8) and used_in_place(attn, "F16", rule, 8)
    assert not used_in_place(exps, "Q3_K", rule, 8) and used_in_place(exps, "Q3_K", rule, 8, repack=False)
    assert used_in_place(exps, "Q3_K", _x86_rule(frozenset({"avx2"})), 8)  # Q3_K repacks with AVX-512 VNNI only
    assert used_in_place(TensorShape("blk.0.attn_q.weight", (512, 100), "Q4_K"), "Q4_K", rule, 8)  # rows % 8


@pytest.mark.native
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the fallback rule is llama.cpp's x86 one")
def test_the_fallback_rule_is_the_builds_on_this_cpu() -> None:
    """Without the compiled part the planner uses llama.cpp's x86 rule for this CPU's flags: it gives the build's
    answers here."""
    built, static = machine_repacks(), _x86_rule(_cpu_flags())
    for ty in ("Q4_K", "Q3_K", "Q2_K", "Q6_K", "Q8_0", "Q4_0", "F16", "F32", "BF16", "IQ2_XXS"):
        for shape, op in (((2048, 768, 128), "mul_mat_id"), ((2048, 4096), "mul_mat"), ((2048, 100), "mul_mat"),
                          ((2048, 4), "mul_mat")):
            assert built(ty, shape, op, 8) == static(ty, shape, op, 8), (ty, shape, op)


@pytest.mark.slow
@pytest.mark.native
@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc/self/maps (Linux)")
@pytest.mark.parametrize("mode", ["rpc", "cpu"])
def test_released_pages_leave_no_hole_in_the_mapping(pairs: dict[str, tuple[Path, Path]], tiny_qwen: Path,
                                                     mode: str) -> None:
    """Patch 0022 drops a copied weight's pages but keeps their addresses mapped until the loader's own final unmap.
    That unmap covers every byte not used in place (the whole file when a model is offloaded whole): a hole unmapped
    earlier could meanwhile hold another mapping, such as a new thread's stack, and it would be unmapped under it
    (serve --rpc ... -ngl 99 crashed in pthread_create within 4 to 13 loads in a loop). Offloaded whole to an
    rpc-server, and repacked on the CPU: the file's mapping stays one region while the weights are copied out of it."""
    model = tiny_qwen if mode == "rpc" else pairs["cpu"][0]
    out = subprocess.run([sys.executable, "-c", HOLES, str(model), mode], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(seen) > 3 and all(spans for spans in seen), seen[:3]  # the callback ran while weights were copied
    holes = [(i, a, b) for i, spans in enumerate(seen) for (_, a), (b, _) in itertools.pairwise(spans) if b > a]
    assert not holes, f"{len(holes)} holes, the first: {holes[0]}"
