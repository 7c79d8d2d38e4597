"""`rapidmoe-cli inspect`: a GGUF's MoE structure and, for RESplit files, the WQ/WR pairing and bits."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..moe_tensors import REFINE, SIDECAR_FORMS, WEIGHT, parse_expert

# the forms listed: a model's weights and every sidecar form (residual, down's copy, the refine codec's bit planes)
LISTED_FORMS = (WEIGHT, *SIDECAR_FORMS)
# model weights one tensor element holds: the refine codec's I8 .rf packs one bit of each of 8 weights
WEIGHTS_PER_ELEMENT = {REFINE: 8}


def inspect(
    model: Annotated[Path, typer.Argument(help="A GGUF: a model, a RESplit .wq.gguf or a .wr.gguf sidecar.")],
    residual: Annotated[Optional[Path], typer.Option("--residual", help="Check this sidecar against MODEL.")] = None,
    verify: Annotated[bool, typer.Option("--verify", help="With --residual: also check every byte of MODEL and of "
                                         "the sidecar's tensor data against the sha256s the sidecar recorded (reads "
                                         "both files whole; without it, sizes, headers and samples of the tensor "
                                         "data are checked).")] = False,
) -> None:
    """Show the MoE structure (layers, experts, top-k, expert tensor types and bits) and RESplit pairing."""
    from ..ggufio import GGUFFile  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..modelfile import generation_problem, read_model_info  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..resplit.sidecar import SIDECAR_ARCH, check_pair  # noqa: PLC0415  (lazy: keeps --help fast)

    info = read_model_info(model)
    r = GGUFFile(model)
    is_sidecar = info.architecture == SIDECAR_ARCH
    parts = f" in {len(r.shards)} parts (llama.cpp's gguf-split)" if len(r.shards) > 1 else ""
    typer.echo(f"{model}: {info.file_size / 1e6:.1f} MB{parts}, {info.n_tensors} tensors, architecture "
               f"{info.architecture}")
    if is_sidecar:
        for k, f in r.fields.items():
            if k.startswith("rapidmoe.residual.") and k != "rapidmoe.residual.type_fallbacks":
                typer.echo(f"  {k[len('rapidmoe.residual.'):]}: {_shown(k, f.value)}")
    elif info.is_moe:
        typer.echo(f"  MoE: {info.n_layer} layers, {info.n_expert} experts, top-{info.n_expert_used}")
    else:
        typer.echo("  dense model (no routed experts)")
    if not is_sidecar:
        problem = generation_problem(r)
        if problem is not None:
            typer.echo(f"  not runnable: {problem}")
    kinds: Counter[tuple[str, str, str]] = Counter()
    n_bytes: Counter[tuple[str, str, str]] = Counter()
    n_elems: Counter[tuple[str, str, str]] = Counter()
    for t in r.tensors:
        e = parse_expert(t.name, LISTED_FORMS)
        if e is not None:
            key = (e.role, e.suffix, t.tensor_type.name)
            kinds[key] += 1
            n_bytes[key] += int(t.n_bytes)
            n_elems[key] += int(t.n_elements) * WEIGHTS_PER_ELEMENT.get(e.suffix, 1)
    if kinds:
        typer.echo("  expert tensors (role, form, type): layers, MB, bits/weight")
        for key in sorted(kinds):
            typer.echo(f"    {key[0]:8s} {key[1]:6s} {key[2]:8s} {kinds[key]:4d}  {n_bytes[key] / 1e6:9.2f}  "
                       f"{8 * n_bytes[key] / n_elems[key]:.3f}")
    fallbacks = r.get("rapidmoe.residual.type_fallbacks" if is_sidecar else "rapidmoe.resplit.type_fallbacks") or []
    if fallbacks:
        typer.echo(f"  type fallbacks (rows not a multiple of the preset type's block; llama-quantize's choice): "
                   f"{len(fallbacks)}")
        for line in fallbacks:
            typer.echo(f"    {line}")
    elif r.get("rapidmoe.resplit.pair_id") is not None or is_sidecar:
        typer.echo("  type fallbacks: none (every expert tensor has the preset's types)")
    pair = r.get("rapidmoe.resplit.pair_id")
    if pair is not None:
        typer.echo(f"  RESplit base (WQ): preset {r.get('rapidmoe.resplit.preset')}, pair id {pair}")
    if verify and residual is None:
        raise typer.BadParameter("--verify checks a sidecar's base: give --residual too", param_hint="--verify")
    if residual is not None:
        meta = check_pair(model, residual, verify_data=verify)
        typer.echo(f"  sidecar {residual} belongs to this base (pair id {meta['pair_id']}; checked: "
                   f"{', '.join(meta['checked'])})")


def _shown(key: str, value: object) -> object:
    """A sidecar field as printed: the per-tensor sample digests summarized."""
    from ..resplit.fingerprint import DIGEST_CHARS  # noqa: PLC0415  (lazy: keeps --help fast)

    if key.endswith(("base_samples", "data_samples")) and isinstance(value, str):
        return f"{len(value) // DIGEST_CHARS} tensors, {DIGEST_CHARS} hex digits each"
    return value
