"""`rapidmoe-cli calibrate-latency` (this machine's latency model) and `rapidmoe-cli calibrate` (UMIA frontier
search on calibration text, writing the chosen policy)."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import ModelFileError, RapidMoEError
from . import options

WqArg = Annotated[Path, typer.Argument(help="The RESplit base model (.wq.gguf).", show_default=False)]
ResidualOpt = Annotated[Path, typer.Option("--residual", help="Its RESplit sidecar (.wr.gguf).", show_default=False)]


def _ints(text: Optional[str], name: str) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise RapidMoEError(f"{name} takes comma-separated integers, got {text!r}") from None


def _floats(text: Optional[str], name: str) -> Optional[tuple[float, ...]]:
    if text is None:
        return None
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise RapidMoEError(f"{name} takes comma-separated numbers, got {text!r}") from None


def _check_files(*paths: Optional[Path]) -> None:
    for p in paths:
        if p is not None and not p.is_file():
            raise ModelFileError(f"{p} does not exist or is not a file")


def calibrate_latency(
    model: WqArg,
    residual: ResidualOpt,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Latency model JSON (default: beside MODEL, NAME.latency.json).")] = None,
    threads: options.Threads = None,
    r_values: Annotated[Optional[str], typer.Option("--r", help="Fixed r values to measure on the WQ path, e.g. 0,1,2,4 (default: 0..k, spread above 8).")] = None,
    drop_r: Annotated[Optional[str], typer.Option("--drop-r", help="r values to measure with non-critical experts dropped (separates WQ cost from the rest).")] = None,
    decode_tokens: Annotated[int, typer.Option("--decode-tokens", help="Decode steps per measurement.", min=2)] = 16,
    prefill_batch: Annotated[int, typer.Option("--prefill-batch", help="Prefill batch size (tokens).", min=2)] = 64,
    repeats: Annotated[int, typer.Option("--repeats", help="Measurements per point (median kept).", min=1)] = 3,
    machine: Annotated[Optional[str], typer.Option("--machine", help="Price the device terms from a machine profile (24gb, 48gb or a JSON file of GPU memory/bandwidth, PCIe and CPU bandwidth, FLOP/s, cores) instead of measuring: the planner's cache for its GPU memory gives the hit rate.")] = None,
    device: Annotated[Optional[str], typer.Option("--device", help="Measure the device terms on this device (e.g. CUDA0, or an RPC buffer type with --rpc): a per-expert cache of --cache-fractions of each layer's experts, serial and concurrent.")] = None,
    rpc: Annotated[Optional[str], typer.Option("--rpc", help="llama.cpp rpc-servers host:port,... whose devices --device may name.")] = None,
    cache_fractions: Annotated[str, typer.Option("--cache-fractions", help="With --device: shares of each layer's experts to cache.")] = "0.5,1",
    preset: Annotated[str, typer.Option("--preset", help="With --machine: the RESplit preset the pair was made with (sizes WQ and the sidecar).")] = "paper",
) -> None:
    """Measure this machine's per-token cost of the WQ and WR paths (decode and prefill) and fit the latency
    model R that `calibrate` uses; print measured vs predicted time for every fixed-r run. With --machine or
    --device, R gets the device terms instead (umia/device.py): cached experts on the device, misses and
    residuals on the CPU, the max of the overlapped stages per layer."""
    from ..calibration.measure import calibrate_latency as measure  # noqa: PLC0415  (lazy: keeps --help fast)

    _check_files(model, residual)
    if machine is not None or device is not None:
        from ..calibration.measure import device_latency_model  # noqa: PLC0415  (lazy: keeps --help fast)

        if machine is not None and device is not None:
            raise typer.BadParameter("give --machine (priced) or --device (measured), not both")
        lm = device_latency_model(model, residual, machine=machine, device=device,
                                  rpc_servers=rpc.split(",") if rpc else [], threads=threads,
                                  cache_fractions=_floats(cache_fractions, "--cache-fractions") or (0.5, 1.0),
                                  preset_name=preset, repeats=repeats, decode_tokens=decode_tokens,
                                  prefill_batch=prefill_batch, progress=sys.stderr.isatty())
        out = output or model.with_name(model.name.removesuffix(".gguf").removesuffix(".wq") + ".latency.json")
        lm.save(out)
        assert lm.device is not None
        print(f"device terms ({lm.device.source}; hit rate {lm.device.hit_rate:.1%}; "
              f"{'concurrent' if lm.device.overlap else 'serial'}):")
        for ph, c in (("decode", lm.device.decode), ("prefill", lm.device.prefill)):
            if c is not None:
                print(f"  {ph:7s} " + ", ".join(f"{k} {v:.4g}" for k, v in c.to_dict().items() if v is not None))
        if lm.device.points:
            from ..umia.device import points_table  # noqa: PLC0415  (lazy: keeps --help fast)

            print(points_table(lm.device.points))
        for r in (0, 1, 2):
            rl = [float(r)] * lm.n_moe_layers
            print(f"r = {r}: decode {lm.predict_layers_ms(rl, [float(r > 0)] * lm.n_moe_layers):.3f} ms/token")
        if lm.model.get("stream_threshold") is not None:
            thr = lm.model["stream_threshold"]
            print(f"prefill streaming (r = 2): from {thr} tokens per ubatch" if thr else
                  "prefill streaming (r = 2): never pays on this machine")
        print(f"wrote {out}")
        return
    lm = measure(model, residual, threads=threads, r_values=_ints(r_values, "--r"),
                 drop_r_values=_ints(drop_r, "--drop-r"), decode_tokens=decode_tokens,
                 prefill_batch=prefill_batch, repeats=repeats, progress=sys.stderr.isatty())
    out = output or model.with_name(model.name.removesuffix(".gguf").removesuffix(".wq") + ".latency.json")
    lm.save(out)
    d, p = lm.decode, lm.prefill
    print(lm.table())
    print(f"\ndecode : R(c, a) = {d.fixed_ms:.3f} + {lm.n_moe_layers}*{lm.k}*{d.wq_ms:.4f} + c*{d.wr_ms:.4f} "
          f"+ a*{d.active_ms:.4f} ms/token  (c: critical slots per token over the {lm.n_moe_layers} MoE layers, "
          f"a: layers with any)")
    if p is not None:
        print(f"prefill: R(c, a) = {p.fixed_ms:.3f} + {lm.n_moe_layers}*{lm.k}*{p.wq_ms:.4f} + c*{p.wr_ms:.4f} "
              f"+ a*{p.active_ms:.4f} ms/token at batch {lm.prefill_batch}")
    print(f"machine: {lm.machine.get('cpu')}, {lm.machine.get('threads') or 'default'} threads; "
          f"measured in {lm.model.get('measure_seconds')} s\nwrote {out}")


def calibrate(
    model: WqArg,
    residual: ResidualOpt,
    text: Annotated[Path, typer.Option("--text", help="Calibration text file (UTF-8).", show_default=False)],
    latency: Annotated[Optional[Path], typer.Option("--latency", help="Latency model from calibrate-latency (default: NAME.latency.json beside MODEL, measured now if missing).")] = None,
    reference: Annotated[Optional[Path], typer.Option("--reference", help="Full-precision model to compare against (default: the pair with every slot critical, r = k).")] = None,
    latency_budget: Annotated[Optional[float], typer.Option("--latency-budget", help="Decode budget in ms/token: choose the lowest KL within it (default: the frontier's knee).", min=0.0)] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output folder: policy.json, frontier.json/.md/.png.")] = None,
    tokens: Annotated[int, typer.Option("--tokens", help="Calibration tokens (in chunks).", min=8)] = 1024,
    chunk: Annotated[int, typer.Option("--chunk", help="Tokens per chunk (context of each evaluation).", min=8)] = 256,
    seed: Annotated[int, typer.Option("--seed", help="Chooses the chunks of the text.")] = 0,
    alphas: Annotated[Optional[str], typer.Option("--alphas", help="Layer modulations to search, e.g. 0,0.25,0.5,1.")] = None,
    levels: Annotated[Optional[str], typer.Option("--levels", help="Target mean r per layer of the UMIA candidates, e.g. 0.5,1,1.5,2.")] = None,
    beta: Annotated[float, typer.Option("--beta", help="Prefill modulation when no beta is searched (--betas '') or the choice is a fixed r.", min=0.0, max=10.0)] = 0.25,
    betas: Annotated[Optional[str], typer.Option("--betas", help="Prefill modulations to search for the chosen policy, scored by prompt-phase KL (default 0,0.25,0.5,1,2; '' for none).")] = None,
    prefill_budget: Annotated[Optional[float], typer.Option("--prefill-budget", help="Prefill budget in ms/token for the beta choice (default: the knee).", min=0.0)] = None,
    threads: options.Threads = None,
) -> None:
    """Search UMIA policies on calibration text: KL to the reference vs latency predicted by the measured
    latency model; print and save the Pareto frontier (table + PNG) and write the chosen policy."""
    from ..calibration.measure import calibrate_latency as measure  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..calibration.umia import calibrate as search  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..umia.latency import load_latency_model  # noqa: PLC0415  (lazy: keeps --help fast)

    _check_files(model, residual, text, reference, latency)
    lat_path = latency or model.with_name(model.name.removesuffix(".gguf").removesuffix(".wq") + ".latency.json")
    if lat_path.exists():
        lm = load_latency_model(lat_path)
    else:
        typer.echo(f"no latency model at {lat_path}: measuring one now", err=True)
        lm = measure(model, residual, threads=threads, progress=sys.stderr.isatty())
        lm.save(lat_path)
    res = search(model, residual, text, lm, reference=reference, budget_ms=latency_budget, n_tokens=tokens,
                 chunk=chunk, seed=seed, alphas=_floats(alphas, "--alphas") or (0.0, 0.25, 0.5, 1.0),
                 levels=_floats(levels, "--levels"), beta=beta, threads=threads, progress=sys.stderr.isatty(),
                 betas=_floats(betas, "--betas") if betas is not None else (0.0, 0.25, 0.5, 1.0, 2.0),
                 prefill_budget_ms=prefill_budget,
                 command="rapidmoe-cli calibrate " + " ".join(shlex.quote(a) for a in sys.argv[2:]))
    out = output or model.with_name(model.name.removesuffix(".gguf").removesuffix(".wq") + ".umia")
    paths = res.save(out)
    print(res.table())
    e = res.evaluations[res.chosen]
    print(f"\nchosen: {e.label}: {e.policy.describe()}  KL {e.kl_mean:.5f}  predicted {e.predicted_ms:.2f} ms/token")
    if res.settings.get("beta_choice"):
        print(f"prefill: {res.settings['beta_choice']}")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
