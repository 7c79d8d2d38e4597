"""`rapidmoe-cli convert`: RESplit a full-precision MoE GGUF into a `.wq.gguf` base and a `.wr.gguf` sidecar."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..errors import RapidMoEError


def convert(
    model: Annotated[Path, typer.Argument(help="Full-precision MoE GGUF (F32/F16/BF16, or Q8_0).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Output folder.")] = Path("."),
    preset: Annotated[str, typer.Option("--preset", help="auto (the machine's: see above), paper, paper-residual, iq2, cpu, cpu-fast, cpu-q8, dense, refine, refine-hq or refine-q8.")] = "auto",
    wq: Annotated[Optional[str], typer.Option("--wq", help="Override the WQ type (IQ1_M IQ2_XXS IQ2_XS Q2_K IQ3_XXS Q3_K).")] = None,
    wr: Annotated[Optional[str], typer.Option("--wr", help="Override the WR type (Q2_K Q3_K Q4_K; REFINE1 only with the refine presets).")] = None,
    down: Annotated[Optional[str], typer.Option("--down", help="Override down's sidecar form: copy or residual (refine with the refine presets).")] = None,
    other: Annotated[Optional[str], typer.Option("--other-type", help="Type for every non-expert matrix, the output head and token embedding included over the preset's own types (Q8_0 F16 F32, or a llama-quantize mixture: Q4_K_M ...); routers stay F32 as in llama-quantize, and a matrix whose rows are not whole blocks of the type takes F16: the output names such tensors.")] = None,
    imatrix: Annotated[Optional[Path], typer.Option("--imatrix", help="llama.cpp importance matrix (GGUF or legacy .dat), for the routed experts' quantization.")] = None,
    calib_text: Annotated[Optional[Path], typer.Option("--calib-text", help="Text to compute an importance matrix from with our build.")] = None,
    calib_ctx: Annotated[int, typer.Option("--calib-ctx", help="Tokens per calibration chunk.", min=16)] = 512,
    calib_chunks: Annotated[int, typer.Option("--calib-chunks", help="At most this many chunks.", min=1)] = 16,
    mix: Annotated[Optional[str], typer.Option("--mix", help="Per-layer/per-role routed-expert types over the preset's: comma-separated ROLE=WQ or LAYER.ROLE=WQ entries, each optionally /HI for its sidecar type (e.g. down=Q3_K,0.down=Q4_K/Q5_K); recorded in the sidecar.")] = None,
    mix_bits: Annotated[Optional[float], typer.Option("--mix-bits", help="Choose the mix by measurement: each routed-expert tensor's KL at each --mix-types type on --mix-text, then this many mean WQ bits per routed weight spent where they save most KL.")] = None,
    mix_text: Annotated[Optional[Path], typer.Option("--mix-text", help="Calibration text for --mix-bits.")] = None,
    mix_types: Annotated[str, typer.Option("--mix-types", help="WQ types --mix-bits chooses among.")] = "Q2_K,Q3_K,Q4_K",
    mix_chunks: Annotated[int, typer.Option("--mix-chunks", help="Chunks of --calib-ctx tokens of --mix-text per measurement.", min=1)] = 4,
    name: Annotated[Optional[str], typer.Option("--name", help="Output base name (default: the input's).")] = None,
    report_experts: Annotated[int, typer.Option("--report-experts", help="Experts per tensor on which plain Q4_K/Q8_0 errors are measured (0: all).", min=0)] = 4,
    threads: Annotated[Optional[int], typer.Option("--threads", "-t", help="Worker threads (default: every core this process may use). The output is the same for any number.", min=1)] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the unfinished conversion in the output folder (its .partial files and NAME.resplit.journal, which an interrupted conversion leaves): every part it lists is read back and checked against its recorded sha256, only the others are converted. Without one it starts afresh.")] = False,
    encoder: Annotated[str, typer.Option("--encoder", help="compiled, or numpy: the one-thread reference the compiled encoder's bytes are tested against (several times slower, no --resume).")] = "compiled",
    split_max_size: Annotated[Optional[str], typer.Option("--split-max-size", help="Split each output in parts of at most this much tensor data (N bytes, NM or NG: 10^6 and 10^9, as llama.cpp's gguf-split), named as gguf-split names them (NAME.wq-00001-of-0000N.gguf): run, serve, inspect and llama.cpp take the first part.")] = None,
    force: Annotated[bool, typer.Option("--force", "-f", help="Overwrite existing outputs (and an unfinished conversion's partial files).")] = False,
) -> None:
    """Split every routed expert into WQ (low-bit, in NAME.wq.gguf, which stock llama.cpp runs) and the quantized residual WR (NAME.wr.gguf sidecar); print bits per weight and the reconstruction-error table.

    --preset auto (the default) takes refine-hq where llama.cpp sees no GPU: a Q3_K base fitted for one refinement bit per weight, Q4_K_M's other tensors and Q6_K output head (cpu where the refine codec cannot take the model: merged gate_up experts, per-expert scales, rows that are not whole Q3_K super-blocks; the output says which and why). Where it sees a GPU, auto takes paper (IQ1_M WQ, small enough for the device; needs --imatrix or --calib-text). cpu-fast (Q2_K experts with a Q2_K residual, Q4_K head) decodes fastest on a CPU at a higher KL; refine is refine-hq with a Q4_K head; cpu-q8 keeps attention and head in Q8_0. What each preset measured: docs/resplit.md (Presets).

    --mix-bits B --mix-text FILE gives each layer's gate, up and down its own WQ type (Q2_K, Q3_K or Q4_K by default), chosen by measuring on the text how much KL each tensor loses in each type and spending B mean bits per routed weight where they save most (one evaluation of the model per tensor and type: for models that run here); --mix writes such types by hand (docs/resplit.md, Per-layer and per-role types).

    The routed experts are encoded on every core (-t N; the bytes are the same for any N), the progress bar shows throughput and time left, and memory stays about 16 MiB of source per thread whatever the model's size. A conversion that stops (Ctrl-C, a signal, a full disk, a crash) leaves NAME.wq.gguf.partial, NAME.wr.gguf.partial and NAME.resplit.journal, never an incomplete output: --resume continues it, checking every part it kept against its recorded hash (docs/resplit.md, Conversion).
    """
    from ..atomic import make_dir  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..calibration.imatrix import collect_imatrix  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..resplit import convert as run_convert  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..resplit import get_preset, read_imatrix, write_imatrix  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..resplit.codecs import DEFAULT, codec_of  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..resplit.convert import codec_obstacle  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..resplit.parallel import Interrupted  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..resplit.presets import CPU_FALLBACK, default_preset  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..resplit.report import flag_exceptions, format_table  # noqa: PLC0415  (lazy: keeps --help fast)
    from .budget import gpu_devices  # noqa: PLC0415  (lazy: keeps --help fast)

    if preset == "auto":
        gpus = gpu_devices()
        preset = default_preset(bool(gpus))
        typer.echo(f"preset auto: {preset} ({'GPU: ' + ', '.join(gpus) if gpus else 'no GPU found'})")
        # the residual codec takes every model RESplit splits (its types fall back as llama-quantize's do); another may
        # refuse one. codec_obstacle checks the file as the conversion would first: an unusable one is refused in
        # one line
        codec = codec_of(get_preset(preset))
        if codec.name != DEFAULT and (why := codec_obstacle(model, preset)) is not None:
            preset = CPU_FALLBACK
            typer.echo(f"preset auto: {preset} instead, as {codec.title} cannot take this model ({why})")
    try:
        given = {"wq": wq, "wr": wr, "down_mode": down, "other": other, "mix": mix}
        p = get_preset(preset, **{k: v for k, v in given.items() if v is not None})
    except ValueError as e:
        raise RapidMoEError(str(e)) from e
    if imatrix is not None and calib_text is not None:
        raise RapidMoEError("give either --imatrix or --calib-text, not both")
    if mix_bits is not None:  # checked before the measurement, which takes many evaluations of the model
        _check_outputs(model, output, name, force)
        p = _measured_mix(model, output, name, p, mix, mix_bits, mix_text, mix_types, calib_ctx, mix_chunks)
    elif mix_text is not None:
        raise RapidMoEError("--mix-text is the calibration text of --mix-bits: give --mix-bits too")
    im = read_imatrix(imatrix) if imatrix is not None else None
    if calib_text is not None:
        im = collect_imatrix(model, _read_text(calib_text, "calibration text"), n_ctx=calib_ctx,
                             max_chunks=calib_chunks, dataset=calib_text.name)
        saved = write_imatrix(im, make_dir(output) / f"{name or model.name.removesuffix('.gguf')}.imatrix.gguf")
        typer.echo(f"importance matrix: {saved}")
    try:
        res = run_convert(model, output, p, imatrix=im, name=name, force=force,
                          report_experts=None if report_experts == 0 else report_experts, threads=threads,
                          resume=resume, encoder=encoder, split_max_size=_size(split_max_size))
    except Interrupted as e:  # Ctrl-C: what was kept and how to continue, then the shell's status for SIGINT
        typer.echo(f"rapidmoe-cli: {e.message}", err=True)
        raise typer.Exit(130) from None
    report: dict[str, Any] = res.report
    b = report["bits"]
    if p.mix:
        typer.echo(f"mix: {p.mix}")
    wq_t, wr_t, hi_t = ("mixed", "mixed", "mixed") if p.mix else (p.wq, p.wr, p.down_hi)  # a mix: the table's
    typer.echo(f"preset {p.name}: WQ {wq_t} {b['wq']:.3f} bpw | sidecar gate/up {wr_t} {b['wr_gate_up']:.3f} bpw, "
               f"down {hi_t} {p.down_mode} {b['down_sidecar']:.3f} bpw | critical path {b['critical']:.3f} bpw | "
               f"total stored {b['total_stored']:.3f} bpw (routed experts)")
    typer.echo(format_table(res.report))
    for line in flag_exceptions(res.report, {"--wq": wq, "--wr": wr, "--other-type": other}):
        typer.echo(line)
    f = report["files"]
    on = f" on {report['threads']} threads" if "threads" in report else ""
    typer.echo(f"wrote {res.wq_path} ({f['wq_bytes'] / 1e6:.1f} MB), {res.wr_path} ({f['wr_bytes'] / 1e6:.1f} MB), "
               f"{res.report_path} in {res.seconds:.1f} s{on}")


def _size(text: Optional[str]) -> int:
    """--split-max-size as bytes (gguf-split's spelling: N, NM or NG with M = 10^6, G = 10^9); 0 when not given."""
    if text is None:
        return 0
    scale = {"M": 1000**2, "G": 1000**3}.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) <= 0:
        raise typer.BadParameter(f"{text!r} is not a size (N bytes, NM or NG)", param_hint="--split-max-size")
    return int(digits) * scale


def _check_outputs(model: Path, output: Path, name: Optional[str], force: bool) -> None:
    """Refuse, before any work, outputs that exist without --force (the pair, its report, the mix's measurements)."""
    from ..resplit.convert import check_outputs, output_paths  # noqa: PLC0415  (lazy: keeps --help fast)

    if not model.is_file():
        raise RapidMoEError(f"model not found: {model}")
    base = name or model.name.removesuffix(".gguf")
    check_outputs([*output_paths(output, base), output / f"{base}.mix.json"], force)


def _measured_mix(model: Path, output: Path, name: Optional[str], p: Any, mix: Optional[str], mix_bits: float,
                  mix_text: Optional[Path], mix_types: str, n_ctx: int, chunks: int) -> Any:
    """The preset with a mix chosen on --mix-text (calibration/mix.py); the measurements saved next to the outputs."""
    import dataclasses  # noqa: PLC0415
    import json  # noqa: PLC0415

    from ..atomic import make_dir, write_text  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..calibration.mix import choose_mix  # noqa: PLC0415  (lazy: keeps --help fast)

    if mix is not None:
        raise RapidMoEError("give either --mix (the types) or --mix-bits (measure and choose them), not both")
    if mix_text is None:
        raise RapidMoEError("--mix-bits needs --mix-text FILE: the calibration text the mix is measured on")
    types = [t for t in mix_types.split(",") if t]
    mixed, sens = choose_mix(model, _read_text(mix_text, "mix calibration text"), p, mix_bits, types, n_ctx=n_ctx,
                             chunks=chunks)
    path = make_dir(output) / f"{name or model.name.removesuffix('.gguf')}.mix.json"
    write_text(path, json.dumps({"mix": mixed.mix, "budget_bits": mix_bits, "text": str(mix_text),
                                        "sensitivity": [dataclasses.asdict(x) for x in sens]}, indent=1))
    typer.echo(f"mix measurements: {path}")
    return mixed


def _read_text(path: Path, what: str) -> str:
    """A text input, or one error line saying why it cannot be read."""
    if not path.is_file():
        raise RapidMoEError(f"{what} not found: {path}")
    try:
        return path.read_text(errors="replace")
    except OSError as e:
        raise RapidMoEError(f"cannot read the {what} {path}: {e.strerror or e}") from e
