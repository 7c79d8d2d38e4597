"""`rapidmoe.Llama`: llama-cpp-python's `Llama` running on RapidMoE's libllama, plus MoE placement knobs.

Everything llama_cpp.Llama offers (create_completion, create_chat_completion, streaming, tokenize, ...) is
inherited unchanged; this class only adds arguments. Generation loops and sampling stay in llama_cpp.
"""
from __future__ import annotations

import ctypes
import inspect
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._runtime import _core, llama_cpp
from .cache.runtime import ExpertCache
from .errors import ModelFileError, RapidMoEError
from .modelfile import generation_problem, read_model_info
from .overlap import OverlapStats, overlap_mode
from .overrides import BufferOverrides, build_overrides
from .placement.cache.config import ExpertCacheConfig
from .placement.cache.moepic import moe_layers_of
from .residual import MoELayerCounters, ResidualInfo, load_residual_info
from .resplit.codecs import get_codec
from .rpc import RPCDevice, model_devices, register_rpc_servers
from .stream import check_min_batch, set_stream_min_batch
from .tokenize_stack import run_with_stack_for
from .trace import NextLayerPredictor, TraceRecorder
from .umia.policy import Policy, PolicyError, load_policy
from .umia.stats import RHistogram


@dataclass(frozen=True)
class Timings:
    """llama.cpp's performance counters for a context since the last reset."""

    prompt_tokens: int  # tokens evaluated in prompt (prefill) batches
    prompt_ms: float
    decode_tokens: int  # tokens generated one at a time
    decode_ms: float

    @property
    def prompt_tps(self) -> float:
        return 1e3 * self.prompt_tokens / self.prompt_ms if self.prompt_ms > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return 1e3 * self.decode_tokens / self.decode_ms if self.decode_ms > 0 else 0.0


RAPIDMOE_MAX_TOP_K = 64  # RAPIDMOE_LLAMA_MAX_TOP_K (rapidmoe-llama.h): the most experts per token the split handles


# The keyword arguments llama_cpp.Llama takes by name; it drops any other silently (its **kwargs), we refuse them.
_LLAMA_CPP_ARGS = frozenset(
    name for name, p in inspect.signature(llama_cpp.Llama.__init__).parameters.items()
    if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD or p.kind is inspect.Parameter.KEYWORD_ONLY) - {"self"}


FLASH_ATTN_MODES = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}


def flash_attn_type(mode: bool | str) -> int:
    """llama.cpp's flash attention type for Llama(flash_attn=...): True/False (llama_cpp.Llama's bool), or "auto",
    "on", "off" (llama.cpp's -fa values)."""
    if isinstance(mode, bool):
        return FLASH_ATTN_MODES["on" if mode else "off"]
    if isinstance(mode, str) and mode in FLASH_ATTN_MODES:
        return FLASH_ATTN_MODES[mode]
    raise RapidMoEError(f"flash_attn must be True, False, 'auto', 'on' or 'off', not {mode!r}")


class Llama(llama_cpp.Llama):
    """Drop-in for `llama_cpp.Llama` (same arguments and methods) with MoE placement knobs:

    n_cpu_moe: keep the routed experts of the first N layers in CPU memory (llama.cpp's `--n-cpu-moe`).
    override_tensor: llama.cpp `-ot` overrides, "pattern=BUFT,..." or a list of them (e.g. "exps=CPU").
    eval_callback: an object with `callback_address` and `user_data` (e.g. rapidmoe._core.ImatrixCollector)
        installed as the context's ggml eval callback; it must outlive this Llama.
    residual_path: a RESplit sidecar (.wr.gguf) made from `model_path` (a .wq.gguf): split expert routing.
    n_critical: with a sidecar, each token's r highest-weight experts run in high precision (default 2,
        clamped to top-k); change it later with `set_n_critical` without reloading.
    policy: with a sidecar, a UMIA policy (rapidmoe.umia.Policy or the path of its JSON) instead of a fixed
        n_critical; change it later with `set_policy`, read what it chose with `r_histogram`.
    skip_noncritical: the "drop" baseline: non-critical experts are not computed at all (benchmarks only).
    overlap: with a sidecar, "auto" (default): layers whose routed WQ experts are on a device (GPU, RPC) compute
        the critical residuals on a worker thread while the device runs WQ (docs/execution.md); "off": after it;
        "on": every split layer, also all-CPU (same results; for tests). Timing: `overlap_stats`.
    overlap_threads: the residual worker's CPU threads (default: n_threads).
    verify_residual: check the base's size and tensor table and both files' sampled tensor data against what the
        sidecar recorded (per file, about 4 MiB plus up to 8 KiB per tensor read; sizes, the sidecar's header and
        the pair id are always checked; `rapidmoe-cli inspect --verify` compares every byte).
    n_seq_max: sequences one context holds (llama.cpp's n_seq_max) for callers that batch several sequences
        through the low-level API; llama_cpp.Llama itself uses one.
    rpc_servers: "host:port" of llama.cpp rpc-servers (llama.cpp's `--rpc`), registered once per process before
        the model loads; their devices come first in this model's device list (n_gpu_layers offloads to them)
        and their buffer types ("RPC0[host:port]") work in override_tensor (rapidmoe.rpc, docs/execution.md).
    expert_cache: a per-expert WQ cache, rapidmoe.cache.ExpertCacheConfig(experts={MoE layer: [expert ids]},
        device=..., policy=...): the chosen experts' WQ copied to a device (e.g. "RPC0[127.0.0.1:50052]"), which
        computes them, the CPU the rest, each slot exactly as that backend alone would; the routed experts must be
        in CPU memory (override_tensor="exps=CPU"; CPU weight repacking is turned off). Policies static, rapidmoe,
        lru and moepic (docs/execution.md). The loaded cache, its counters and its current set:
        `llm.expert_cache` (rapidmoe.cache.runtime.ExpertCache; None without one).
    prefill_stream: with an expert cache on a device, ubatches of at least this many tokens compute the cached
        layers' WQ on that device from the stacked experts the scheduler copies there (stock llama.cpp's op offload
        for big batches) instead of the misses on the CPU; 0 (default) never. `rapidmoe-cli plan --machine` prints
        the threshold the latency model picks (rapidmoe.stream, docs/execution.md).
    repack: False keeps every CPU weight in the plain GGUF layout (llama.cpp's repacked CPU buffers off, as
        `--no-repack`; an expert cache implies it); the default lets llama.cpp repack for its fastest kernels.
    flash_attn: False (default, as llama_cpp.Llama), True, or "auto" ("on"/"off" also read): llama.cpp's flash
        attention mode; "auto" is llama-cli's and llama-server's default (on where every layer's device supports
        it), which `rapidmoe-cli run` and `serve` pass unless told `--flash-attn off`.
    trace: record every computed token's expert choices and router weights per MoE layer into this file
        (rapidmoe.trace: format, reader); written after each `eval`, or by `flush_trace()` for callers of
        llama_decode, and completed (renamed into place) by `close()`. Uses the eval callback, so not with
        eval_callback.
    """

    _buffer_overrides: BufferOverrides | None

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        n_cpu_moe: int = 0,
        override_tensor: str | Sequence[str] | None = None,
        eval_callback: Any = None,
        residual_path: str | os.PathLike[str] | None = None,
        n_critical: int = 2,
        policy: Policy | str | os.PathLike[str] | None = None,
        skip_noncritical: bool = False,
        overlap: str = "auto",
        overlap_threads: int | None = None,
        verify_residual: bool = True,
        n_seq_max: int = 1,
        rpc_servers: Sequence[str] | None = None,
        expert_cache: ExpertCacheConfig | None = None,
        prefill_stream: int = 0,
        trace: str | os.PathLike[str] | None = None,
        repack: bool = True,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - _LLAMA_CPP_ARGS)
        if unknown:  # llama_cpp.Llama would ignore them: a misspelt option must not run with its default
            raise TypeError(f"Llama got unexpected keyword argument(s): {', '.join(unknown)}")
        self._repack = bool(repack)
        self._flash_attn_type = flash_attn_type(kwargs.pop("flash_attn", False))
        info = read_model_info(model_path)  # a clear error for missing, truncated and non-GGUF files
        self._vocab_only_load = bool(kwargs.get("vocab_only", False))
        self._embedding_load = bool(kwargs.get("embedding", False))
        if not kwargs.get("vocab_only", False):
            problem = generation_problem(model_path, embedding=bool(kwargs.get("embedding", False)))
            if problem is not None:
                raise ModelFileError(problem)
        self._trace: TraceRecorder | None = None
        if trace is not None and eval_callback is not None:
            raise RapidMoEError("trace records through the eval callback: give trace or eval_callback, not both")
        if isinstance(rpc_servers, str):
            rpc_servers = rpc_servers.split(",")
        self.rpc_devices: list[RPCDevice] = register_rpc_servers(rpc_servers or [])  # before overrides name them
        self._devices = model_devices(self.rpc_devices)
        self._buffer_overrides = build_overrides(n_cpu_moe, override_tensor)
        self._eval_callback = eval_callback
        if n_seq_max < 1:
            raise RapidMoEError(f"n_seq_max must be >= 1, got {n_seq_max}")
        self._n_seq_max = n_seq_max
        self.residual: ResidualInfo | None = None
        self._policy_init = _as_policy(policy) if policy is not None else None
        self._skip_noncritical = skip_noncritical
        self._overlap_mode = overlap_mode(overlap)
        if overlap_threads is not None and overlap_threads < 1:
            raise RapidMoEError(f"overlap_threads must be >= 1, got {overlap_threads}")
        self._overlap_threads = overlap_threads
        self._prefill_stream = check_min_batch(prefill_stream)
        self.expert_cache_config = _cache_config(expert_cache)
        self._cache: ExpertCache | None = None
        if self.expert_cache_config is not None:
            if skip_noncritical:
                raise RapidMoEError("skip_noncritical (a CPU benchmark baseline) does not combine with expert_cache")
            self._cache = ExpertCache(self.expert_cache_config, model_path, n_layer=info.n_layer,
                                      n_expert=info.n_expert, n_expert_used=info.n_expert_used,
                                      known_devices=self._known_devices())
        if residual_path is None and (policy is not None or skip_noncritical):
            raise RapidMoEError("policy and skip_noncritical need a residual sidecar (residual_path=...)")
        if residual_path is not None:
            if n_critical < 0:
                raise RapidMoEError(f"n_critical must be >= 0, got {n_critical}")
            self.residual = load_residual_info(model_path, residual_path, verify=verify_residual)
            if get_codec(self.residual.codec).cpu_experts and self._cache is not None:
                raise RapidMoEError(f"the {self.residual.codec} sidecar computes its critical experts on the CPU from "
                                    "the model's own WQ experts: it does not combine with expert_cache")
            self._n_critical_init = min(n_critical, info.n_expert_used)
        if trace is not None:
            layers = moe_layers_of(model_path)
            self._trace = TraceRecorder(trace, moe_layers=layers, n_expert=info.n_expert, k=info.n_expert_used,
                                        meta={"model": os.fspath(model_path), "arch": info.architecture,
                                              "n_layer": info.n_layer},
                                        predictor=NextLayerPredictor(model_path, layers, info.n_expert_used))
            self._eval_callback = self._trace.callback
        try:
            super().__init__(os.fspath(model_path), **kwargs)
        except BaseException:
            if self._trace is not None:
                self._trace.abort()
                self._trace = None
            raise
        if self.residual is not None:
            # the context's reserved graphs are built: each sidecar layer must have met the split hook there
            unhooked = _core.residual_unhooked(self._model.model)
            if unhooked:
                self.close()
                raise ModelFileError(
                    f"{info.architecture}: split routing cannot apply to MoE layer(s) "
                    f"{', '.join(map(str, unhooked))}: llama.cpp's graph does not reach them through its shared MoE "
                    "builder (build_moe_ffn) with this sidecar's expert tensors, or routes more than "
                    f"{RAPIDMOE_MAX_TOP_K} experts per token there; run the .wq.gguf without --residual")

    # llama_cpp.Llama.__init__ assigns self.model_params and loads the model right after; intercepting the
    # assignment is how the override array reaches llama_model_load_from_file without copying that method.
    @property
    def model_params(self) -> llama_cpp.llama_model_params:
        return self._model_params

    @model_params.setter
    def model_params(self, params: llama_cpp.llama_model_params) -> None:
        overrides = getattr(self, "_buffer_overrides", None)
        if overrides is not None:
            params.tensor_buft_overrides = overrides.address
        devices = getattr(self, "_devices", None)
        if devices is not None:
            params.devices = ctypes.addressof(devices)  # type: ignore[assignment]  # ctypes takes the address
        if getattr(self, "_cache", None) is not None or not getattr(self, "_repack", True):
            # the CPU computes the misses from the stacked experts with a masked matmul, and the cache copies their
            # slices: both need the plain layout, which repacked CPU buffers do not keep
            params.use_extra_bufts = False
        self._model_params = params

    @property
    def context_params(self) -> llama_cpp.llama_context_params:
        # llama_cpp.Llama.__init__ writes its bool's flash attention type into these params after assigning them and
        # before it makes the context from them: ours (which can be "auto") is applied on each read
        self._context_params.flash_attn_type = getattr(self, "_flash_attn_type",
                                                       llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        return self._context_params

    @context_params.setter
    def context_params(self, params: llama_cpp.llama_context_params) -> None:
        params.n_seq_max = getattr(self, "_n_seq_max", 1)
        cb = getattr(self, "_eval_callback", None)
        if cb is not None:
            params.cb_eval = llama_cpp.ggml_backend_sched_eval_callback(cb.callback_address)
            params.cb_eval_user_data = ctypes.c_void_p(cb.user_data)
        self._context_params = params

    # llama_cpp.Llama.__init__ assigns self._model after loading it and before creating the context: attaching
    # the sidecar here makes even the context's reserved (worst-case) graphs include the split.
    @property
    def _model(self) -> Any:
        return self.__dict__["_model"]

    @_model.setter
    def _model(self, model: Any) -> None:
        self.__dict__["_model"] = model
        try:
            self._check_loaded(model)
            self._attach_extensions(model)
        except BaseException:
            # llama_cpp already holds the model in its exit stack; free it now, not at garbage collection, which
            # may come after the devices it uses are gone (freeing an RPC buffer then hangs or aborts)
            self.close()
            raise

    def _check_loaded(self, model: Any) -> None:
        """What only the loaded model tells (llama.cpp's own classification), before a context is made for it."""
        if getattr(self, "_vocab_only_load", False):
            return
        if llama_cpp.llama_model_is_diffusion(model.model):
            raise ModelFileError(f"{self.model_path} is a diffusion model: llama.cpp generates with it through its "
                                 "diffusion sampler (llama-diffusion-cli), not token by token as RapidMoE runs")
        if not llama_cpp.llama_model_has_decoder(model.model) and not getattr(self, "_embedding_load", False):
            raise ModelFileError(f"{self.model_path} is an encoder-only model: it gives embeddings (embedding=True), "
                                 "not generated text")

    def _attach_extensions(self, model: Any) -> None:
        """The sidecar (with its policy and overlap settings) and the expert cache, right after the model loads."""
        residual = getattr(self, "residual", None)
        if residual is not None:
            try:
                _core.attach_residual(model.model, str(residual.path))
            except ValueError as e:
                raise ModelFileError(f"cannot attach {residual.path}: {e}") from e
            _core.set_n_critical(model.model, self._n_critical_init)
            self._policy = Policy.fixed(self._n_critical_init)
            if self._policy_init is not None:
                self._write_policy(model.model, self._policy_init)
            if self._skip_noncritical:
                _core.set_skip_noncritical(model.model, True)
            threads = self._overlap_threads or max(1, int(getattr(self, "n_threads", 1) or 1))
            _core.set_overlap(model.model, self._overlap_mode, threads)
        cache = getattr(self, "_cache", None)
        # always written (read at graph builds): a model freed earlier at this address may have left its threshold
        set_stream_min_batch(model.model, self._prefill_stream if cache is not None else 0)
        if cache is not None:
            cache.attach(model)

    def _known_devices(self) -> list[str]:
        names = [n for d in self.rpc_devices for n in (d.name, d.buffer_type)]
        names += [d[0] for d in _core.devices()] + [b[0] for b in _core.buffer_types()]
        return list(dict.fromkeys(names))

    def set_n_critical(self, n_critical: int) -> int:
        """Fixed r for the next calls: each token's r highest-weight experts run WQ+WR (0 <= r <= top-k)."""
        if self.residual is None:
            raise RapidMoEError("no residual sidecar attached (pass residual_path=...)")
        k = self.residual.n_expert_used
        if not 0 <= n_critical <= k:
            raise RapidMoEError(f"n_critical must be in 0..{k} (top-k of this model), got {n_critical}")
        r = int(_core.set_n_critical(self._model.model, n_critical))
        self._policy = Policy.fixed(r)
        return r

    def set_policy(self, policy: Policy | str | os.PathLike[str]) -> Policy:
        """Use a UMIA policy (or the path of its JSON) from the next call on; nothing is rebuilt or reloaded."""
        if self.residual is None:
            raise RapidMoEError("no residual sidecar attached (pass residual_path=...)")
        p = _as_policy(policy)
        self._write_policy(self._model.model, p)
        return p

    @property
    def policy(self) -> Policy | None:
        """The policy last set (a fixed-r one after `set_n_critical`); None without a sidecar."""
        return getattr(self, "_policy", None)

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the layers with routed experts (those the policy and the histogram cover)."""
        return sorted(self.residual.wq_bytes_per_expert) if self.residual is not None else []

    def _write_policy(self, model: Any, policy: Policy) -> None:
        assert self.residual is not None
        n_layer = _core.get_policy(model).shape[0] - 1
        arr = policy.to_array(n_layer, sorted(self.residual.wq_bytes_per_expert), self.residual.n_expert_used)
        _core.set_policy(model, arr)
        self._policy = policy

    def r_histogram(self, reset: bool = False) -> RHistogram:
        """How many tokens got each r, per MoE layer and phase, since the last reset (shared with moe_counters)."""
        if self.residual is None:
            raise RapidMoEError("no residual sidecar attached (pass residual_path=...)")
        raw = _core.r_histogram(self._model.model, reset)
        return RHistogram.from_raw(raw, self.moe_layers, self.residual.n_expert_used)

    def moe_counters(self, reset: bool = False) -> list[MoELayerCounters]:
        """Per MoE layer since the last reset: tokens, expert slots, critical slots, estimated weight bytes read."""
        if self.residual is None:
            return []
        raw = _core.moe_counters(self._model.model, reset)
        return self.residual.counters(raw)

    def overlap_stats(self, reset: bool = False) -> OverlapStats:
        """Per stage (gate/up, down) since the last reset: begin/join pairs and the time of the worker's residual
        matmuls, of the device's work meanwhile, of join's wait and of the whole stage (all zero without overlap)."""
        if self.residual is None:
            raise RapidMoEError("no residual sidecar attached (pass residual_path=...)")
        return OverlapStats.from_raw(_core.overlap_stats(self._model.model, reset))

    @property
    def expert_cache(self) -> ExpertCache | None:
        """The per-expert WQ cache of this model (its counters, current set, policy's statistics); None without
        one. What asked for it: `expert_cache_config`."""
        return getattr(self, "_cache", None)

    def tensor_buffer(self, name: str) -> str:
        """The buffer (device memory) holding the model's, the sidecar's or the expert cache's tensor `name`
        ("blk.N.ffn_up_exps.cache"): "CPU", "CPU_REPACK", "CUDA0", "RPC0[127.0.0.1:50052]", ...; '' when there is
        no such tensor."""
        return str(_core.tensor_buffer(self._model.model, name))

    # llama.cpp's handles, for code that calls its C API itself (the server): the model's is llama_cpp.Llama's
    # `model`; these name what llama_cpp keeps private (`_model`).
    @property
    def vocab(self) -> Any:
        """The model's vocabulary handle (llama_vocab_p), which llama.cpp's llama_vocab_* functions take."""
        return self._model.vocab

    def n_embd_out(self) -> int:
        """Width of the model's output embeddings (llama_model_n_embd_out: n_embd unless the model projects)."""
        return int(llama_cpp.llama_model_n_embd_out(self.model))

    def eval(self, tokens: Sequence[int]) -> None:
        super().eval(tokens)
        self.raise_worker_error()
        self.after_decode(len(tokens))

    def raise_worker_error(self) -> None:
        """RapidMoEError if the residual worker failed since the last check (the join it reached wrote NaN: those
        steps' results are not to be used). `eval` calls it; callers of llama_decode call it after a step."""
        model = self.__dict__.get("_model")
        if getattr(self, "residual", None) is None or model is None or model.model is None:
            return
        err = _core.take_worker_error(model.model)
        if err is not None:
            raise RapidMoEError(f"the residual worker failed: {err}")

    def after_decode(self, n_tokens: int) -> None:
        """What follows a decode step: the trace's batches are written, the rapidmoe cache policy refreshes the
        expert cache. `eval` calls it; callers of llama_decode (the server) call it after each step."""
        self.flush_trace()
        cache = getattr(self, "_cache", None)
        if cache is not None:
            cache.after_decode(n_tokens)

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """llama_cpp.Llama.tokenize on a stack that fits the text: llama.cpp's std::regex pre-tokenizer recurses
        once per character of a line, so a long one would overflow the thread's stack and kill the process
        (rapidmoe.tokenize_stack); a text too long even for that raises TextTooLongError."""
        return run_with_stack_for(text, lambda: self._tokenize_now(text, add_bos, special))

    def _tokenize_now(self, text: bytes, add_bos: bool, special: bool) -> list[int]:
        """llama_tokenize into a buffer sized by the text (a token per byte at most, and BOS and EOS), where
        llama_cpp sizes it by the model's training context: a damaged context_length made that a negative or a
        many-GiB array per call (fuzzing: model seed 100 #2943)."""
        vocab = self._model.vocab
        n = len(text) + 2
        for _ in range(2):
            buf = (llama_cpp.llama_token * n)()
            got = int(llama_cpp.llama_cpp.llama_tokenize(vocab, text, len(text), buf, n, add_bos, special))
            if got >= 0:
                return list(buf[:got])
            if got == -(1 << 31):  # llama.cpp's answer when the count overflows int32
                raise RapidMoEError(f"tokenizing {len(text)} bytes gives more than 2^31 tokens")
            n = -got  # the count it needs
        raise RuntimeError(f"llama_tokenize asked for {n} tokens twice for {len(text)} bytes")

    def flush_trace(self) -> int:
        """With trace=...: write the batches computed since the last flush (call after llama_decode when not using
        `eval`); returns how many were written (0 without a trace)."""
        tr = getattr(self, "_trace", None)
        return tr.flush() if tr is not None else 0

    def close(self) -> None:
        tr = getattr(self, "_trace", None)
        if tr is not None:
            self._trace = None
            tr.close()
        if not hasattr(self, "_stack"):  # __init__ refused its arguments before llama_cpp set anything up
            return
        model = self.__dict__.get("_model")
        if self.residual is not None and model is not None and model.model is not None:
            _core.detach_residual(model.model)  # before llama.cpp frees the model
        cache = getattr(self, "_cache", None)
        if cache is not None and model is not None and model.model is not None:
            cache.close()
        super().close()

    def reset_timings(self) -> None:
        llama_cpp.llama_perf_context_reset(self.ctx)

    def timings(self) -> Timings:
        d = llama_cpp.llama_perf_context(self.ctx)
        return Timings(prompt_tokens=int(d.n_p_eval), prompt_ms=float(d.t_p_eval_ms),
                       decode_tokens=int(d.n_eval), decode_ms=float(d.t_eval_ms))


def _as_policy(policy: Policy | str | os.PathLike[str]) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, (str, os.PathLike)):
        return load_policy(policy)
    raise PolicyError(f"policy must be a rapidmoe.umia.Policy or a JSON file path, got {type(policy).__name__}")


def _cache_config(expert_cache: ExpertCacheConfig | None) -> ExpertCacheConfig | None:
    if expert_cache is not None and not isinstance(expert_cache, ExpertCacheConfig):
        raise TypeError("Llama's expert_cache takes a rapidmoe.cache.ExpertCacheConfig(experts=..., device=...), "
                        f"got {type(expert_cache).__name__}")
    return expert_cache
