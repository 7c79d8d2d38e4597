"""`rapidmoe-cli make-model`: write a deterministic synthetic MoE GGUF of a chosen architecture and size."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import RapidMoEError


def make_model(
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output GGUF (default: ./synthetic-ARCH-SIZE.gguf).")] = None,
    arch: Annotated[str, typer.Option("--arch", help="qwen3moe or deepseek2.")] = "qwen3moe",
    size: Annotated[str, typer.Option("--size", help="Named size: tiny, small or bench.")] = "tiny",
    seed: Annotated[int, typer.Option("--seed", help="Weights seed; same arguments give identical files.")] = 0,
    n_layer: Annotated[Optional[int], typer.Option("--n-layer", help="Override: number of layers.")] = None,
    n_embd: Annotated[Optional[int], typer.Option("--n-embd", help="Override: hidden size.")] = None,
    n_expert: Annotated[Optional[int], typer.Option("--n-expert", help="Override: routed experts per layer.")] = None,
    n_expert_used: Annotated[Optional[int], typer.Option("--n-expert-used", help="Override: experts per token (top-k).")] = None,
    n_ff_exp: Annotated[Optional[int], typer.Option("--n-ff-exp", help="Override: expert FFN width.")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Matrix type: f16 or f32.")] = None,
    vocab: Annotated[Optional[str], typer.Option("--vocab", help="Tokenizer: qwen2, deepseek-llm or gpt-2.")] = None,
    chat_template: Annotated[str, typer.Option("--chat-template", help="Chat template in tokenizer.chat_template: auto (Qwen3's for the qwen2 vocab, llama.cpp's DeepSeek-R1 one for the deepseek vocabs, none for others), none, or the NAME of llama.cpp's models/templates/NAME.jinja.")] = "auto",
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite an existing output file.")] = False,
) -> None:
    """Write a synthetic MoE model (realistic weight statistics, skewed router, real tokenizer) as GGUF."""
    from ..paths import vocab_dir  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..synthetic import describe, spec_for, write_model  # noqa: PLC0415  (lazy: keeps --help fast)

    given = {"n_layer": n_layer, "n_embd": n_embd, "n_expert": n_expert, "n_expert_used": n_expert_used,
             "n_ff_exp": n_ff_exp, "dtype": dtype, "vocab": vocab, "chat_template": chat_template}
    overrides = {k: v for k, v in given.items() if v is not None}
    try:
        spec = spec_for(arch, size, seed=seed, **overrides)
    except (ValueError, KeyError, TypeError) as e:
        raise RapidMoEError(f"invalid model spec: {e}") from e
    out = output if output is not None else Path(f"synthetic-{arch}-{size}.gguf")
    if out.exists() and not force:
        raise RapidMoEError(f"{out} exists; pass --force to overwrite it")
    if not out.parent.exists():
        raise RapidMoEError(f"output folder {out.parent} does not exist")
    try:
        write_model(spec, out, vocab_dir(), progress=True)
    except FileNotFoundError as e:
        raise RapidMoEError(str(e)) from e
    typer.echo(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
    typer.echo(json.dumps(describe(spec), indent=1, default=str))
