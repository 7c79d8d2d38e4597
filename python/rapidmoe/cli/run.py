"""`rapidmoe-cli run`: generate text from a prompt with streaming output, then report prefill/decode speed."""
from __future__ import annotations

import sys
import time
from typing import Annotated

import typer

from ..errors import ModelFileError, RapidMoEError
from . import options
from .budget import cache_placement, placement


@options.engine_options
def run(
    ctx: typer.Context,
    model: options.ModelArg = None,
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Prompt text.")] = "Once upon a time",
    n_predict: Annotated[int, typer.Option("--n-predict", "-n", help="Tokens to generate.", min=0)] = 64,
    ctx_size: options.CtxSize = 2048,
    threads: options.Threads = None,
    temp: Annotated[float, typer.Option("--temp", help="Temperature; 0 is greedy.", min=0.0)] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", min=0)] = 40,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0)] = 0.95,
    repeat_penalty: Annotated[float, typer.Option("--repeat-penalty", min=0.0)] = 1.0,
    seed: Annotated[int, typer.Option("--seed", "-s", help="Sampling seed.")] = 0,
    engine: options.EngineOptions = options.DEFAULT_ENGINE,  # -ngl ... --overlap (run --help lists them)
    stats: Annotated[bool, typer.Option("--stats", help="With --residual: print the r chosen per layer and phase (histogram), and the overlap timing when layers overlapped.")] = False,
    trace: options.TraceOpt = None,
    cache_policy: options.CachePolicyOpt = options.CachePolicy.static,
    verbose: options.Verbose = False,
) -> None:
    """Generate text from PROMPT with MODEL, streaming tokens as they come, then print prefill and decode speed.

    Placement: -ngl/--n-cpu-moe/-ot by hand, or --gpu-mem BUDGET to let the planner choose them (logged)."""
    from ..default_model import ensure_default_model  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..llama import Llama  # noqa: PLC0415  (lazy: keeps --help fast; loads the compiled part)
    from ..modelfile import require_moe  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..rpc import parse_servers  # noqa: PLC0415  (lazy: keeps --help fast)

    rpc_servers = parse_servers(engine.rpc)
    path = model if model is not None else ensure_default_model()
    info = require_moe(path)
    if n_predict + 8 > ctx_size:
        raise ModelFileError(f"--n-predict {n_predict} does not fit in --ctx-size {ctx_size}")
    place = placement(ctx, model=path, residual=engine.residual, ctx_size=ctx_size, gpu_mem=engine.gpu_mem,
                      reserve=engine.reserve, freq=engine.freq, n_gpu_layers=engine.n_gpu_layers,
                      n_cpu_moe=engine.n_cpu_moe, override_tensor=engine.override_tensor)
    place = cache_placement(path, place, cache_policy, engine.freq)
    from ..placement.resident import process_memory  # noqa: PLC0415  (lazy: keeps --help fast)

    before, t0 = process_memory(), time.perf_counter()
    try:
        llm = Llama(path, n_threads=threads, n_threads_batch=threads, seed=seed, rpc_servers=rpc_servers,
                    tensor_split=options.tensor_split(engine.tensor_split), **place,
                    residual_path=engine.residual, n_critical=engine.n_critical, policy=engine.policy,
                    overlap=engine.overlap.value, flash_attn=engine.flash_attn.value, trace=trace,
                    verbose=verbose)
    except RapidMoEError:
        raise
    except ValueError as e:  # llama_cpp reports load failures as ValueError
        raise ModelFileError(f"llama.cpp could not load {path} ({info.architecture}): {e}") from e
    loaded = _load_line(time.perf_counter() - t0, before, process_memory())
    n_prompt = len(llm.tokenize(prompt.encode(), add_bos=True, special=False))
    if n_prompt + n_predict > ctx_size:
        raise ModelFileError(f"prompt ({n_prompt} tokens) + --n-predict {n_predict} exceed --ctx-size {ctx_size}")
    llm.reset_timings()
    out = sys.stdout
    out.write(prompt)
    chunks = llm.create_completion(prompt, max_tokens=n_predict, temperature=temp, top_k=top_k, top_p=top_p,
                                   repeat_penalty=repeat_penalty, seed=seed, stream=True)
    assert not isinstance(chunks, dict)  # stream=True: an iterator of chunks
    for chunk in chunks:
        out.write(chunk["choices"][0]["text"])
        out.flush()
    out.write("\n")
    t = llm.timings()
    split = ""
    if llm.residual is not None:
        c = llm.moe_counters()
        frac = sum(x.critical_slots for x in c) / max(1, sum(x.slots for x in c))
        how = llm.policy.describe() if llm.policy is not None else f"fixed r={engine.n_critical}"
        split = f"\nsplit:   {how}, critical expert slots {100 * frac:.1f}%"
        if stats:
            split += "\n" + llm.r_histogram().table()
            ov = llm.overlap_stats()
            for name, st in (("gate/up", ov.gate_up), ("down", ov.down)):
                if st.pairs:
                    split += (f"\noverlap {name}: {st.pairs} layer steps, worker {st.cpu_ms:.1f} ms, device "
                              f"{st.device_ms:.1f} ms, wall {st.wall_ms:.1f} ms, hidden {st.hidden_ms:.1f} ms")
    print(f"\nprefill: {t.prompt_tokens} tokens in {t.prompt_ms:.1f} ms = {t.prompt_tps:.2f} tokens/s\n"
          f"decode:  {t.decode_tokens} tokens in {t.decode_ms:.1f} ms = {t.decode_tps:.2f} tokens/s\n"
          f"model:   {path} ({info.architecture}, {info.n_expert} experts, top-{info.n_expert_used}){split}"
          f"{loaded}", file=sys.stderr)
    llm.close()
    if trace is not None:
        print(f"trace:   {trace}", file=sys.stderr)


def _load_line(seconds: float, before: tuple[int, int] | None, after: tuple[int, int] | None) -> str:
    """How long the load took and the host memory it left resident (what `plan` predicts), where measurable."""
    if before is None or after is None:
        return f"\nload:    {seconds:.2f} s"
    anon, file = after[0] - before[0], after[1] - before[1]
    return (f"\nload:    {seconds:.2f} s, {(anon + file) / (1 << 30):.2f} GiB resident after load "
            f"({anon / (1 << 30):.2f} anonymous + {file / (1 << 30):.2f} file-backed)")
