"""`rapidmoe-cli make-model`: write a deterministic synthetic MoE GGUF of a chosen architecture and size."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import RapidMoEError


def make_model(
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output GGUF (default: ./synthetic-ARCH-SIZE.gguf, or ./synthetic-SHAPE-DTYPE.gguf).")] = None,
    arch: Annotated[Optional[str], typer.Option("--arch", help="qwen3moe (default) or deepseek2.")] = None,
    size: Annotated[str, typer.Option("--size", help="Named size: tiny, small or bench.")] = "tiny",
    shape: Annotated[Optional[str], typer.Option("--shape", help="A real model's exact shape instead of a named size: qwen3-30b-a3b (48 layers, 128 experts top-8 of 768, n_embd 2048, GQA 32/4, 151936-token vocabulary; 30.5 B weights, 32.5 GB in Q8_0, 61 GB in BF16) or deepseek-v3 (a slice of DeepSeek-V3's layers: n_embd 7168, MLA, its 3 dense layers of 18432 and 2 MoE layers of 256 experts of 2048, top-8; 26 B weights, 28 GB in Q8_0; --n-layer sets how many layers, the MoE layers after the 3 dense).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="Weights seed; same arguments give identical files.")] = 0,
    n_layer: Annotated[Optional[int], typer.Option("--n-layer", help="Override: number of layers.")] = None,
    n_embd: Annotated[Optional[int], typer.Option("--n-embd", help="Override: hidden size.")] = None,
    n_expert: Annotated[Optional[int], typer.Option("--n-expert", help="Override: routed experts per layer.")] = None,
    n_expert_used: Annotated[Optional[int], typer.Option("--n-expert-used", help="Override: experts per token (top-k).")] = None,
    n_ff_exp: Annotated[Optional[int], typer.Option("--n-ff-exp", help="Override: expert FFN width.")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Matrix type: f16, f32, bf16 or q8_0 (norms and router stay F32).")] = None,
    vocab: Annotated[Optional[str], typer.Option("--vocab", help="Tokenizer: qwen2, deepseek-llm or gpt-2.")] = None,
    chat_template: Annotated[str, typer.Option("--chat-template", help="Chat template in tokenizer.chat_template: auto (Qwen3's for the qwen2 vocab, llama.cpp's DeepSeek-R1 one for the deepseek vocabs, none for others), none, or the NAME of llama.cpp's models/templates/NAME.jinja.")] = "auto",
    threads: Annotated[Optional[int], typer.Option("--threads", "-t", help="Threads drawing tensors (default: every core this process may use); the file is the same for any number.", min=1)] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite an existing output file.")] = False,
) -> None:
    """Write a synthetic MoE model (realistic weight statistics, skewed router, real tokenizer) as GGUF.

    Tensors are drawn a piece at a time (an expert, or a block of rows) and written in place, so memory stays about one piece per thread (up to a few hundred MB for DeepSeek-V3's experts) whatever the model's size.
    """
    from ..paths import vocab_dir  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..synthetic import describe, spec_for, spec_for_shape, write_model  # noqa: PLC0415  (lazy: keeps --help fast)

    given = {"n_layer": n_layer, "n_embd": n_embd, "n_expert": n_expert, "n_expert_used": n_expert_used,
             "n_ff_exp": n_ff_exp, "dtype": dtype, "vocab": vocab, "chat_template": chat_template}
    overrides = {k: v for k, v in given.items() if v is not None}
    try:
        if shape is not None:
            spec = spec_for_shape(shape, seed=seed, **({"arch": arch} if arch is not None else {}), **overrides)
        else:
            spec = spec_for(arch or "qwen3moe", size, seed=seed, **overrides)
    except (ValueError, KeyError, TypeError) as e:
        raise RapidMoEError(f"invalid model spec: {e}") from e
    default = f"synthetic-{shape}-{spec.dtype}.gguf" if shape is not None else f"synthetic-{spec.arch}-{size}.gguf"
    out = output if output is not None else Path(default)
    if out.exists() and not force:
        raise RapidMoEError(f"{out} exists; pass --force to overwrite it")
    if not out.parent.exists():
        raise RapidMoEError(f"output folder {out.parent} does not exist")
    try:
        write_model(spec, out, vocab_dir(), progress=True, threads=threads)
    except ValueError as e:
        raise RapidMoEError(f"invalid model spec: {e}") from e
    except FileNotFoundError as e:
        raise RapidMoEError(str(e)) from e
    typer.echo(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    typer.echo(json.dumps(describe(spec), indent=1, default=str))
