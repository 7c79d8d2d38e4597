"""Option declarations shared by several commands, spelled like llama.cpp's flags."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..placement.cache.config import (
    CachePolicy as CachePolicy,  # re-exported: run and serve default --cache-policy with it
)

ModelArg = Annotated[Optional[Path], typer.Argument(
    help="GGUF model file (MoE). Default: the tiny synthetic model, made once and cached.",
    show_default=False)]
Threads = Annotated[Optional[int], typer.Option("--threads", "-t", help="CPU threads (default: llama.cpp's).",
                                                min=1)]
CtxSize = Annotated[int, typer.Option("--ctx-size", "-c", help="Context size in tokens.", min=1)]
GpuLayers = Annotated[int, typer.Option("--n-gpu-layers", "-ngl",
                                        help="Layers to offload to the GPU (-1: all). Not with --gpu-mem.", min=-1)]
NCpuMoe = Annotated[int, typer.Option("--n-cpu-moe", "-ncmoe",
                                      help="Keep the routed experts of the first N layers on the CPU. Not with "
                                      "--gpu-mem.", min=0)]
OverrideTensor = Annotated[Optional[list[str]], typer.Option(
    "--override-tensor", "-ot", help="<tensor name pattern>=<buffer type>,... (repeatable), as in llama.cpp. "
    "Not with --gpu-mem.")]

Rpc = Annotated[Optional[str], typer.Option(
    "--rpc", metavar="SERVERS", envvar="LLAMA_ARG_RPC",
    help="Comma-separated list of RPC servers (host:port), as llama.cpp's --rpc: each server's devices (started "
    "with `rapidmoe-cli rpc-server` on that host) join this process's device list ahead of local GPUs; -ngl splits "
    "layers across them, and -ot names them by buffer type RPC<n>[host:port]. docs/execution.md.")]

TensorSplit = Annotated[Optional[str], typer.Option(
    "--tensor-split", "-ts", metavar="N0,N1,...",
    help="Fraction of the offloaded layers per device, in device order (RPC servers first, as given to --rpc), "
    "e.g. 3,1; as llama.cpp's -ts (default: by each device's free memory).")]


def tensor_split(value: str | None) -> list[float] | None:
    """-ts "3,1" -> [3.0, 1.0]; a usage error for anything but non-negative numbers with a positive sum."""
    if value is None:
        return None
    try:
        out = [float(v) for v in value.replace("/", ",").split(",")]
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a comma-separated list of numbers", param_hint="-ts") from None
    if any(v < 0 for v in out) or sum(out) <= 0:
        raise typer.BadParameter(f"{value!r}: proportions must be >= 0 with a positive sum", param_hint="-ts")
    return out


class OverlapMode(str, Enum):
    auto = "auto"
    off = "off"
    on = "on"


OverlapOpt = Annotated[OverlapMode, typer.Option(
    "--overlap",
    help="With --residual: run the critical experts' residual work on a worker thread while the device computes "
    "WQ (auto: where the routed WQ experts are on a GPU or RPC device; on: also all-CPU, for tests; off: after "
    "the device's work). docs/execution.md.")]


class FlashAttnMode(str, Enum):
    auto = "auto"
    on = "on"
    off = "off"


FlashAttnOpt = Annotated[FlashAttnMode, typer.Option(
    "--flash-attn", "-fa",
    help="Flash attention, as llama.cpp's -fa (auto: on where every layer's device supports it, llama-cli's and "
    "llama-server's default).")]


def _size(value: str) -> int:
    """A memory size read with the planner's unit parser; a bad one is a usage error naming the option."""
    from ..placement.units import SizeError, parse_size  # noqa: PLC0415  (lazy: keeps --help fast)

    try:
        return parse_size(value)
    except SizeError as e:
        raise typer.BadParameter(str(e)) from None


GpuMem = Annotated[Optional[int], typer.Option(
    "--gpu-mem", parser=_size, show_default=False, metavar="SIZE",
    help="GPU memory budget (e.g. 24GiB, 80GB, 0): place the model with the planner (as `rapidmoe-cli plan`: "
    "every routed expert on the GPU if all fit, else the deepest whole layers' experts that fit, else CPU-only) instead of -ngl/--n-cpu-moe/-ot, "
    "and log the plan. With no GPU device llama.cpp runs every layer on the CPU, as with -ngl.")]
Reserve = Annotated[Optional[int], typer.Option(
    "--reserve", parser=_size, show_default=False, metavar="SIZE",
    help="With --gpu-mem: GPU memory kept free for compute buffers (default 1GiB).")]
Freq = Annotated[Optional[Path], typer.Option(
    "--freq", help="With --gpu-mem: expert frequencies, .npy/.json counts [layers, experts] or a GGUF imatrix "
    "(default: uniform).")]
CachePolicyOpt = Annotated[CachePolicy, typer.Option(
    "--cache-policy",
    help="With a per-expert WQ cache (--gpu-mem on a machine with a GPU): static keeps the planned experts; rapidmoe "
    "refreshes the set from running routing counts after every step (a few expert copies per step); lru "
    "copies each step's missing experts into the least recently used slots before the layer computes; moepic "
    "spends the same device memory on MoEpic's split experts (tops resident, the rest fetched per step, the next "
    "layer's predicted experts ahead; split and tops from its fixed point on the 24gb profile). rapidmoe-cli plan "
    "--machine compares all of them.")]
TraceOpt = Annotated[Optional[Path], typer.Option(
    "--trace", metavar="FILE", help="Record every computed token's expert choices and router weights per MoE layer "
    "into FILE (binary; rapidmoe.trace reads it; bench/bench_cache.py replays it).")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's own log output.")]
Residual = Annotated[Optional[Path], typer.Option(
    "--residual", help="RESplit sidecar (.wr.gguf) made from MODEL: split expert routing.")]
NCritical = Annotated[int, typer.Option(
    "--n-critical", "-r", help="With --residual: each token's r highest-weight experts run in high precision.", min=0)]
PolicyOpt = Annotated[Optional[Path], typer.Option(
    "--policy", help="With --residual: a UMIA policy JSON (from `rapidmoe-cli calibrate`) instead of a fixed -r.")]


@dataclass(frozen=True)
class EngineOptions:
    """The engine's options that `run` and `serve` share, declared once: placement by hand (-ngl, --n-cpu-moe, -ot,
    --rpc, -ts) or by the planner (--gpu-mem, --reserve, --freq), the RESplit split (--residual, -r, --policy,
    --overlap) and the attention kernel (-fa). `engine_options` puts them into a command's signature; the command
    gets them as one value."""

    n_gpu_layers: GpuLayers = 0
    n_cpu_moe: NCpuMoe = 0
    override_tensor: OverrideTensor = None
    rpc: Rpc = None
    tensor_split: TensorSplit = None
    gpu_mem: GpuMem = None
    reserve: Reserve = None
    freq: Freq = None
    residual: Residual = None
    n_critical: NCritical = 2
    policy: PolicyOpt = None
    overlap: OverlapOpt = OverlapMode.auto
    flash_attn: FlashAttnOpt = FlashAttnMode.auto


DEFAULT_ENGINE = EngineOptions()  # the options as the command line leaves them


def engine_options(command: Callable[..., None]) -> Callable[..., None]:
    """`command` with its parameter `engine: EngineOptions` replaced, in its place, by EngineOptions' fields as
    typer options (each field's name, option and default); called, it receives them as `engine`."""
    hints = typing.get_type_hints(EngineOptions, include_extras=True)
    fields = [f.name for f in dataclasses.fields(EngineOptions)]
    shared = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hints[name],
                                default=getattr(DEFAULT_ENGINE, name)) for name in fields]
    signature = inspect.signature(command, eval_str=True)
    if "engine" not in signature.parameters:
        raise TypeError(f"{command.__name__} has no parameter engine: EngineOptions")
    params = [q for p in signature.parameters.values() for q in (shared if p.name == "engine" else [p])]

    @functools.wraps(command)
    def with_engine(*args: Any, **kwargs: Any) -> None:
        command(*args, engine=EngineOptions(**{name: kwargs.pop(name) for name in fields}), **kwargs)

    # what typer reads: the signature, and the annotations as objects (command's are strings of its own module)
    with_engine.__dict__["__signature__"] = signature.replace(parameters=params)
    with_engine.__annotations__ = {p.name: p.annotation for p in params} | {"return": signature.return_annotation}
    return with_engine
