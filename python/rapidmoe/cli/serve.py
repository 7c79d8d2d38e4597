"""`rapidmoe-cli serve`: llama-server's HTTP API (native and OpenAI routes) over the RapidMoE engine."""
from __future__ import annotations

import json
import logging
import os
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..errors import RapidMoEError
from . import options
from .budget import cache_placement, placement


class Pooling(str, Enum):  # llama-server's --pooling
    none = "none"
    mean = "mean"
    cls = "cls"
    last = "last"
    rank = "rank"


@options.engine_options
def serve(
    ctx: typer.Context,
    model: options.ModelArg = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port).", min=0, max=65535)] = 8080,
    alias: Annotated[Optional[str], typer.Option("--alias", "-a", help="Model names for the API, comma-separated (the alphabetically first is the id, as in llama-server).")] = None,
    tags: Annotated[Optional[str], typer.Option("--tags", help="Model tags, comma-separated (informational, in /v1/models).")] = None,
    strict_model: Annotated[bool, typer.Option("--strict-model", help="Answer 404 to a request whose \"model\" is none of this server's names (--alias, the path, the file name or its stem). Default: any name is served, as llama-server does with one model.")] = False,
    any_model: Annotated[bool, typer.Option("--any-model", hidden=True, help="Accept any \"model\" in requests: the default now (kept for old command lines).")] = False,
    parallel: Annotated[int, typer.Option("--parallel", "-np", help="Slots decoded together (continuous batching).", min=1, max=64)] = 2,
    queue_size: Annotated[int, typer.Option("--queue-size", help="Generations that may wait for a free slot (each choice of a request is one); beyond that 503 with Retry-After. -1: no limit, as llama-server.", min=-1)] = -1,
    ctx_size: options.CtxSize = 4096,
    n_batch: Annotated[int, typer.Option("--batch-size", "-b", help="Tokens per llama_decode call.", min=1)] = 512,
    n_predict: Annotated[int, typer.Option("--n-predict", "-n", help="Default tokens to generate (-1: until the context is full).", min=-1)] = -1,
    threads: Annotated[Optional[int], typer.Option("--threads", "-t", help="CPU threads (default: all cores but one, which serves HTTP).", min=1)] = None,
    engine: options.EngineOptions = options.DEFAULT_ENGINE,  # -ngl ... --overlap (serve --help lists them)
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="API keys, comma-separated; requests need 'Authorization: Bearer KEY'.", envvar="LLAMA_API_KEY")] = None,
    cors_origins: Annotated[str, typer.Option("--cors-origins", help="Allowed CORS origins, comma-separated ('*': any; 'localhost': only a localhost Origin is answered), as llama-server.", envvar="LLAMA_ARG_CORS_ORIGINS")] = "*",
    timeout: Annotated[float, typer.Option("--timeout", "-to", help="Socket write timeout while answering (a client that stops reading), seconds.", min=0.1)] = 600.0,
    queue_timeout: Annotated[float, typer.Option("--queue-timeout", help="Longest wait for a request's first choice to get a free slot before 503, seconds (once one has started, its other choices wait without limit).", min=0.0)] = 600.0,
    max_body: Annotated[int, typer.Option("--max-body", help="Largest request body, bytes (larger: 413).", min=1)] = 1 << 20,
    max_connections: Annotated[int, typer.Option("--max-connections", help="Open connections (a thread each); more get 503 at once.", min=1)] = 128,
    header_timeout: Annotated[float, typer.Option("--header-timeout", help="A request's line and headers must arrive within this, seconds (else 408).", min=0.1)] = 10.0,
    body_timeout: Annotated[float, typer.Option("--body-timeout", help="A request's body must arrive within this after its headers, seconds (else 408).", min=0.1)] = 10.0,
    keepalive_timeout: Annotated[float, typer.Option("--keepalive-timeout", help="Idle keep-alive connections are closed after this, seconds.", min=0.1)] = 5.0,
    chat_template: Annotated[Optional[str], typer.Option("--chat-template", help="Jinja chat template instead of the GGUF's.")] = None,
    chat_template_file: Annotated[Optional[Path], typer.Option("--chat-template-file", help="File with a Jinja chat template.")] = None,
    jinja: Annotated[bool, typer.Option("--jinja/--no-jinja", help="Render chat with the Jinja template (default). --no-jinja: llama.cpp's built-in format for the template's family (or a --chat-template name such as chatml, command-r), no tools, the whole answer as content, as llama-server.")] = True,
    chat_template_kwargs: Annotated[Optional[str], typer.Option("--chat-template-kwargs", help="Template arguments for every chat request, a JSON object (a request's chat_template_kwargs override them).")] = None,
    reasoning: Annotated[str, typer.Option("--reasoning", "-rea", help="Thinking in chat: on|off|auto (auto: the template's default). on/off set the template's enable_thinking.")] = "auto",
    reasoning_format: Annotated[str, typer.Option("--reasoning-format", help="Default reasoning_format of chat requests: auto|deepseek (thoughts in reasoning_content) or none (left in content).")] = "auto",
    reasoning_budget: Annotated[int, typer.Option("--reasoning-budget", help="Default thinking budget of chat requests, in tokens: after this many inside the thinking block its end tag is forced (0: at once; -1: unrestricted). A request's reasoning_budget_tokens / thinking_budget_tokens (Anthropic: thinking.budget_tokens) overrides it.", min=-1)] = -1,
    reasoning_budget_message: Annotated[str, typer.Option("--reasoning-budget-message", help="Text forced before the thinking block's end tag when the budget runs out (a request's reasoning_budget_message overrides it).")] = "",
    seed: Annotated[int, typer.Option("--seed", "-s", help="Default sampling seed (-1: random).", min=-1)] = -1,
    temp: Annotated[float, typer.Option("--temp", help="Default temperature.", min=0.0)] = 0.8,
    metrics: Annotated[bool, typer.Option("--metrics/--no-metrics", help="Serve GET /metrics.")] = True,
    slots: Annotated[bool, typer.Option("--slots/--no-slots", help="Serve GET /slots.")] = True,
    ui: Annotated[bool, typer.Option("--ui/--no-ui", help="Serve the chat page at /.")] = True,
    embedding: Annotated[bool, typer.Option("--embedding", "--embeddings", help="Serve /v1/embeddings, /embedding and /embeddings (otherwise 501, as llama-server); generation keeps working.")] = False,
    pooling: Annotated[Optional[Pooling], typer.Option("--pooling", help="Pooling of embeddings (default: the model's; a causal LM's is none, which /v1/embeddings refuses). rank (reranking) is refused.")] = None,
    embd_normalize: Annotated[int, typer.Option("--embd-normalize", help="Normalisation of pooled embeddings: -1 none, 0 max absolute (int16 range), 1 taxicab, 2 euclidean, p > 2 p-norm.", min=-1)] = 2,
    trace: options.TraceOpt = None,
    cache_policy: options.CachePolicyOpt = options.CachePolicy.static,
    verbose: options.Verbose = False,
) -> None:
    """Serve MODEL with llama-server's HTTP API: /completion, /v1/completions, /v1/chat/completions, /tokenize, ...

    Tools written for llama.cpp's llama-server or an OpenAI endpoint work unchanged. Binds to 127.0.0.1 unless
    --host says otherwise; logs one line per request. Placement: -ngl/--n-cpu-moe/-ot by hand, or --gpu-mem
    BUDGET to let the planner choose them for the whole context (-c), logged before the model loads.
    """
    from ..default_model import ensure_default_model  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..rpc import parse_servers  # noqa: PLC0415  (lazy: keeps --help fast)
    from ..server import ServerConfig, run_server  # noqa: PLC0415  (lazy: keeps --help fast)

    if os.environ.get("AIP_MODE") == "PREDICTION":  # llama-server serves Vertex AI's /predict in this mode
        raise RapidMoEError("AIP_MODE=PREDICTION (Vertex AI prediction mode) is not supported by rapidmoe-cli serve")
    if chat_template_file is not None:
        try:
            chat_template = chat_template_file.read_text(encoding="utf-8")
        except OSError as e:
            raise RapidMoEError(f"cannot read --chat-template-file {chat_template_file}: {e.strerror}") from None
    template_kwargs = _template_kwargs(chat_template_kwargs, reasoning)
    if reasoning_format not in ("auto", "deepseek", "none"):
        raise RapidMoEError(f"--reasoning-format {reasoning_format}: not supported (auto, deepseek or none; "
                            "deepseek-legacy, which keeps the thoughts in content too, is not implemented)")
    if pooling is Pooling.rank:
        raise RapidMoEError("--pooling rank: reranking's pooling (a classification head's score) is not implemented")
    if strict_model and any_model:
        raise RapidMoEError("--strict-model and --any-model contradict each other (any name is served by default)")
    rpc_servers = tuple(parse_servers(engine.rpc))
    keys = tuple(k.strip() for k in (api_key or "").split(",") if k.strip())
    path = model if model is not None else ensure_default_model()
    place = placement(ctx, model=path, residual=engine.residual, ctx_size=ctx_size, gpu_mem=engine.gpu_mem,
                      reserve=engine.reserve, freq=engine.freq, n_gpu_layers=engine.n_gpu_layers,
                      n_cpu_moe=engine.n_cpu_moe, override_tensor=engine.override_tensor)
    place = cache_placement(path, place, cache_policy, engine.freq)
    config = ServerConfig(
        model=path, host=host, port=port,
        aliases=tuple(a.strip() for a in (alias or "").split(",") if a.strip()),
        tags=tuple(a.strip() for a in (tags or "").split(",") if a.strip()), strict_model=strict_model,
        parallel=parallel, queue_size=queue_size, ctx_size=ctx_size, n_batch=n_batch, n_predict=n_predict,
        threads=threads, n_gpu_layers=place["n_gpu_layers"], n_cpu_moe=place["n_cpu_moe"],
        override_tensor=tuple(place["override_tensor"] or ()), rpc_servers=rpc_servers,
        tensor_split=tuple(options.tensor_split(engine.tensor_split) or ()),
        expert_cache=place.get("expert_cache"),
        residual=engine.residual, n_critical=engine.n_critical, policy=engine.policy, overlap=engine.overlap.value,
        flash_attn=engine.flash_attn.value,
        trace=trace, api_keys=keys, cors_origins=cors_origins, timeout=timeout,
        queue_timeout=queue_timeout, max_body=max_body, max_connections=max_connections,
        header_timeout=header_timeout, body_timeout=body_timeout, keepalive_timeout=keepalive_timeout, chat_template=chat_template, seed=seed, temperature=temp,
        jinja=jinja, chat_template_kwargs=template_kwargs, reasoning_format=reasoning_format,
        reasoning_budget=reasoning_budget, reasoning_budget_message=reasoning_budget_message,
        metrics=metrics, slots=slots, ui=ui, embeddings=embedding,
        pooling=pooling.value if pooling is not None else None, embd_normalize=embd_normalize, verbose=verbose)
    logging.getLogger("rapidmoe.server").setLevel(logging.INFO)
    run_server(config)


REASONING = {"on": True, "enabled": True, "true": True, "1": True, "off": False, "disabled": False, "false": False,
             "0": False, "auto": None, "-1": None}  # llama-server's is_truthy / is_falsey / is_autoy values


def _template_kwargs(text: str | None, reasoning: str) -> tuple[tuple[str, Any], ...]:
    """--chat-template-kwargs (a JSON object), then --reasoning on|off as `enable_thinking`."""
    kwargs: dict[str, Any] = {}
    if text is not None:
        try:
            kwargs = json.loads(text)
        except ValueError as e:
            raise RapidMoEError(f"--chat-template-kwargs is not valid JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise RapidMoEError("--chat-template-kwargs must be a JSON object")
    if reasoning.lower() not in REASONING:
        raise RapidMoEError(f"--reasoning {reasoning}: expected on, off or auto")
    think = REASONING[reasoning.lower()]
    if think is not None:
        kwargs["enable_thinking"] = think
    return tuple(kwargs.items())
