"""Option declarations shared by several commands, spelled like llama.cpp's flags."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

ModelArg = Annotated[Optional[Path], typer.Argument(
    help="GGUF model file (MoE). Default: the tiny synthetic model, made once and cached.",
    show_default=False)]
Threads = Annotated[Optional[int], typer.Option("--threads", "-t", help="CPU threads (default: llama.cpp's).",
                                                min=1)]
CtxSize = Annotated[int, typer.Option("--ctx-size", "-c", help="Context size in tokens.", min=1)]
GpuLayers = Annotated[int, typer.Option("--n-gpu-layers", "-ngl",
                                        help="Layers to offload to the GPU (-1: all).", min=-1)]
NCpuMoe = Annotated[int, typer.Option("--n-cpu-moe", "-ncmoe",
                                      help="Keep the routed experts of the first N layers on the CPU.", min=0)]
OverrideTensor = Annotated[Optional[list[str]], typer.Option(
    "--override-tensor", "-ot", help="<tensor name pattern>=<buffer type>,... (repeatable), as in llama.cpp.")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's own log output.")]
PolicyOpt = Annotated[Optional[Path], typer.Option(
    "--policy", help="With --residual: a UMIA policy JSON (from `rapidmoe-cli calibrate`) instead of a fixed -r.")]
