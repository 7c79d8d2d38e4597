"""The all-CPU reference that an expert-cache run must equal, and a way to compute it with one CPU kernel per matmul.

Two things make a cache run on the RPC stand-in round differently from a naive all-CPU run of the same file, though
every slot takes exactly one backend's value from the right weights:

1. Repacking. llama.cpp repacks CPU weights into the interleaved `CPU_REPACK` layout (other kernels, other
   summation order) unless `use_extra_bufts` is off (`Llama(repack=False)`), and `override_tensor="exps=CPU"`
   does NOT turn it off: the experts still land in `CPU_REPACK`. A cache run loads with it off (the cache copies
   slices of the plain layout), so the reference must too: `PlainLlama`.
2. Kernel choice by batch size. ggml-cpu computes an expert of a `mul_mat_id` with its tiled K-quant kernel when
   at least 8 rows are routed to that expert (`ggml-cpu/tiled/tiled.cpp: ggml_tiled_min_batch`), else with the
   row-by-row `vec_dot`: the two sum a row's sub-blocks in another order. The cache's device matmul parks every
   miss on slot 0 (a real expert's finite output, masked out afterwards), so the expert in slot 0 of each cached
   layer sees more rows on the device than the all-CPU run gives it and may cross that threshold: its hit slots
   then differ from the all-CPU run by a few ulps, which the rest of the network carries on. Every other slot
   sees the same rows as in the all-CPU run. `without_tiled` runs a function in a fresh process (and so in the
   rpc-server it starts) with the tiled kernel off (`GGML_CPU_TILED_MM=0`, read once per process): one kernel
   per quant type, and the cache run must then equal the reference bit for bit.
"""
from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from testkit import TEXT

from rapidmoe import Llama, llama_cpp
from rapidmoe._runtime import _core
from rapidmoe.cache import ExpertCacheConfig
from rapidmoe.ggufio import GGUFFile
from rapidmoe.placement.realize import plan_for_model, realize
from rapidmoe.rpc import RPCServer

T = TypeVar("T")

TILED_ENV = "GGML_CPU_TILED_MM"


class PlainLlama(Llama):
    """rapidmoe.Llama with repack=False: every CPU weight stays in the plain layout, as in a run with an expert
    cache."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, repack=False, **kwargs)


def last_logits(llm: Llama) -> np.ndarray:
    """The last position's logits as the context computed them (Llama.scores holds them only with logits_all)."""
    p = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    out = np.ctypeslib.as_array(p, shape=(llm.n_vocab(),)).copy()
    assert np.isfinite(out).all() and np.abs(out).max() > 0
    return out


def step_logits(llm: Llama, prompt: list[int], rest: list[int]) -> list[np.ndarray]:
    """The last position's logits after the prompt and after each further token (one decode step each)."""
    out = [_eval_last(llm, prompt)]
    out.extend(_eval_last(llm, [t]) for t in rest)
    return out


def _eval_last(llm: Llama, tokens: list[int]) -> np.ndarray:
    llm.eval(tokens)
    return last_logits(llm)


def expert_shape(path: Path) -> tuple[int, int]:
    """(n_expert, top-k) of the file."""
    f = GGUFFile(path)
    arch = f.get("general.architecture")
    return int(f.get(f"{arch}.expert_count")), int(f.get(f"{arch}.expert_used_count"))


def prompt_tokens(path: Path) -> list[int]:
    """The first 24 tokens of testkit.TEXT in the file's vocabulary."""
    vocab = Llama(path, n_ctx=128, vocab_only=True, verbose=False)
    toks = vocab.tokenize(TEXT, add_bos=False)[:24]
    vocab.close()
    return toks


def without_tiled(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) in a fresh Python process, and every rpc-server it starts, with ggml-cpu's tiled K-quant matmul
    off. fn must be importable (a module-level function); its result comes back pickled."""
    old = os.environ.get(TILED_ENV)
    os.environ[TILED_ENV] = "0"  # inherited by the child at spawn; this process has no thread reading it meanwhile
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
            future = pool.submit(fn, *args)
    finally:
        if old is None:
            del os.environ[TILED_ENV]
        else:
            os.environ[TILED_ENV] = old
    return future.result()


Run = tuple[np.ndarray, dict[str, list[np.ndarray]]]  # logits of every position, captured graph tensors


def run_logits(cls: type[Llama], path: str, toks: list[int], names: list[str], **kw: Any) -> Run:
    """One evaluation of toks: the logits of every position and each named graph tensor as computed."""
    cap = _core.TensorCapture(names) if names else None
    llm = cls(path, n_ctx=128, logits_all=True, verbose=False, n_threads=2, eval_callback=cap, **kw)
    try:
        llm.eval(toks)
        logits = np.array(llm.scores[: len(toks)], dtype=np.float32)
        return logits, {n: [np.asarray(a) for a in cap.get(n)] for n in names} if cap is not None else {}
    finally:
        llm.close()


def realized_plan(wq: str, wr: str, gpu_mem: int, n_ctx: int, toks: list[int]) -> tuple[Run, Run, dict[str, Any]]:
    """The plan of the pair for gpu_mem realized with a local rpc-server as the cache's device (n_critical 1): the
    plain-layout all-CPU run, the realized run, and what the realized run reports (its realize() arguments, the
    first cached layer's cache buffer, the hit rate). Meant for `without_tiled`."""
    p = plan_for_model(wq, wr, gpu_mem=gpu_mem, n_ctx=n_ctx, reserve=0)
    ref = run_logits(PlainLlama, wq, toks, [], residual_path=wr, n_critical=1, override_tensor="exps=CPU")
    with RPCServer(threads=1) as srv:
        kw = realize(p, cache_device=srv.device.name)
        llm = Llama(wq, residual_path=wr, n_critical=1, rpc_servers=[srv.endpoint], logits_all=True, verbose=False,
                    n_threads=2, **kw)
        try:  # closed before the server stops: a model whose device is gone hangs or aborts when freed
            assert llm.expert_cache is not None
            layer = min(kw["expert_cache"].experts or {})
            info: dict[str, Any] = {"kw": kw, "buffer": llm.tensor_buffer(f"blk.{layer}.ffn_up_exps.cache"),
                    "device": srv.device.buffer_type}
            llm.eval(toks)
            dev = np.array(llm.scores[: len(toks)], dtype=np.float32)
            info["hit_rate"] = llm.expert_cache.stats().hit_rate
        finally:
            llm.close()
    return ref, (dev, {}), info


def eval_runs(path: str, toks: list[int], n_decode: int, runs: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Each run of toks (the last n_decode one token per ubatch): (logits, expert cache stats or None, overlap
    stats or None, captured tensors). A run is Llama arguments plus "plain": True (the plain-layout all-CPU
    reference, `PlainLlama` with the experts overridden to the CPU), "device": True (the stand-in's arguments:
    the experts stacked in CPU memory, everything else on a local rpc-server, the run's expert_cache ({layer:
    [ids]}) there as an ExpertCacheConfig) and
    "capture": [names]. Meant for `without_tiled`."""
    out: list[tuple[Any, ...]] = []
    with RPCServer(threads=1) as srv:
        for run in runs:
            kw = {k: v for k, v in run.items() if k not in ("plain", "device", "capture")}
            cls = PlainLlama if run.get("plain") else Llama
            if run.get("plain"):
                kw["override_tensor"] = "exps=CPU"
            if run.get("device"):
                kw.update(rpc_servers=[srv.endpoint], n_gpu_layers=-1, override_tensor="exps=CPU")
                if "expert_cache" in kw:
                    kw["expert_cache"] = ExpertCacheConfig(experts=kw["expert_cache"], device=srv.device.buffer_type)
            names = run.get("capture", [])
            cap = _core.TensorCapture(names) if names else None
            llm = cls(path, n_ctx=128, logits_all=True, verbose=False, n_threads=2, eval_callback=cap, **kw)
            try:
                llm.eval(toks[: len(toks) - n_decode])
                for t in toks[len(toks) - n_decode:]:  # decode steps: one token per ubatch
                    llm.eval([t])
                logits = np.array(llm.scores[: len(toks)], dtype=np.float32)
                stats = llm.expert_cache.stats() if llm.expert_cache is not None else None
                ov = llm.overlap_stats() if "residual_path" in kw else None
                got = {n: [np.asarray(a) for a in cap.get(n)] for n in names} if cap is not None else {}
                out.append((logits, stats, ov, got))
            finally:
                llm.close()
    return out
