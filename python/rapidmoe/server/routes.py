"""The endpoints: request JSON -> prompt tokens + GenerationParams -> engine ticket -> llama-server response.

Each handler gets the app state and a parsed Request and returns a Reply (whole body) or a Stream (SSE bytes).
Sockets, auth, limits and logging are the HTTP layer's (app.py).
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import __version__
from .._runtime import llama_cpp as lc
from ..tokenize_stack import TextTooLongError
from . import anthropic, embeddings, metrics, responses, responses_api, sse, toolcalls
from . import infill as fill
from .chat import ChatTemplate, check_messages
from .config import ServerConfig
from .engine import Chunk, Embedded, Engine, Event, Failed, Finished, QueueFull, Ticket
from .errors import ApiError, exceed_context, invalid_request, not_found, unavailable
from .params import (
    MAX_CHOICES,
    SEED_RANDOM,
    GenerationParams,
    SamplingParams,
    check_utf8,
    choice_seed,
    generation_from,
    get_bool,
    get_int,
    get_n,
    get_str,
    refuse_unsupported,
    refused,
)
from .reasoning import BudgetSpec, think_first
from .structured import check_grammar, grammar_from
from .trigger import TriggerSpec


@dataclass
class Request:
    method: str
    path: str
    body: bytes
    gone: Callable[[], bool]  # True once the client has closed the connection
    checked: float = 0.0  # monotonic time `gone` was last asked
    _json: Any = None

    def json(self) -> dict[str, Any]:
        if self._json is None:
            if not self.body:
                raise invalid_request("request body is empty, expected a JSON object")
            try:
                self._json = json.loads(self.body.decode("utf-8"))
            except UnicodeDecodeError:
                raise invalid_request("request body is not valid UTF-8") from None
            except RecursionError:
                raise invalid_request(f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
            except ValueError as e:
                raise invalid_request(f"request body is not valid JSON: {e}") from None
            if not isinstance(self._json, dict):
                raise invalid_request("request body must be a JSON object")
            if json_depth(self._json) > MAX_JSON_DEPTH:
                raise invalid_request(f"request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
        return self._json


MAX_JSON_DEPTH = 64  # objects and arrays inside each other; deeper bodies are refused before anything walks them


def json_depth(obj: Any) -> int:
    """Nesting depth of parsed JSON, without recursion (a body may be nested as deep as the parser allowed)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in x.values())
        elif isinstance(x, list):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in x)
    return deepest


@dataclass
class Reply:
    status: int
    body: bytes
    content_type: str = "application/json; charset=utf-8"
    n_tokens: int = 0  # generated tokens, for the request log
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Stream:
    chunks: Iterator[bytes]
    on_abort: Callable[[], None]  # the client went away mid-stream
    n_tokens: list[int] = field(default_factory=lambda: [0])


def json_reply(obj: Any, status: int = 200, n_tokens: int = 0) -> Reply:
    return Reply(status, json.dumps(obj, ensure_ascii=False).encode(), n_tokens=n_tokens)


@dataclass
class AppState:
    config: ServerConfig
    requests: metrics.RequestCounters = field(default_factory=metrics.RequestCounters)
    engine: Engine | None = None  # None while the model loads
    template: ChatTemplate | None = None
    model_meta: dict[str, Any] = field(default_factory=dict)
    add_bos: bool = True
    fingerprint: str = f"rapidmoe-{__version__}"
    started: float = field(default_factory=time.time)
    closing: bool = False  # shutting down: new requests get 503

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def check_model(self, body: dict[str, Any]) -> str:
        """The id answered in responses: the request's `model`, whatever it names (llama-server's rule with one
        model); with --strict-model an unknown name is a 404."""
        name = body.get("model")
        if name is None:
            return self.config.model_id
        if not isinstance(name, str):
            raise invalid_request("\"model\" must be a string")
        if not self.config.strict_model or name in self.config.model_names:
            return name
        raise not_found(f"model '{name}' not found; this server serves '{self.config.model_id}' (it was started "
                        "with --strict-model; without it any name is served)")


# ---- prompts ----

def _tokenize(st: AppState, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
    assert st.engine is not None
    try:
        return st.engine.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
    except TextTooLongError as e:  # a line llama.cpp's regex pre-tokenizer cannot split (rapidmoe.tokenize_stack)
        raise invalid_request(str(e)) from e


def _check_ids(st: AppState, toks: list[Any], name: str) -> list[int]:
    assert st.engine is not None
    n_vocab = st.engine.n_vocab
    for t in toks:
        if isinstance(t, bool) or not isinstance(t, int):
            raise invalid_request(f"\"{name}\" must contain token ids (integers) and strings")
        if not 0 <= t < n_vocab:
            raise invalid_request(f"\"{name}\": token id {t} out of range [0, {n_vocab})")
    return toks


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _one_prompt(st: AppState, p: Any, name: str) -> list[int]:
    """One prompt: a string, token ids, ids mixed with strings (BOS first when it starts with text), or
    llama-server's `{"prompt_string": ...}` object (its `multimodal_data` is refused)."""
    if isinstance(p, dict):
        if p.get("multimodal_data") not in (None, []):
            raise refused(f"{name}.multimodal_data", "multimodal input")
        if "prompt_string" not in p:
            raise invalid_request(f"\"{name}\": a prompt object needs \"prompt_string\"")
        p, name = p["prompt_string"], f"{name}.prompt_string"
    if isinstance(p, str):
        return _tokenize(st, check_utf8(p, name), st.add_bos)
    if isinstance(p, list) and p and all(isinstance(x, str) or _is_id(x) for x in p):
        out: list[int] = []
        for i, x in enumerate(p):
            if isinstance(x, str):
                out += _tokenize(st, check_utf8(x, name), st.add_bos and i == 0)
            else:
                out += _check_ids(st, [x], name)
        return out
    raise invalid_request(f"\"{name}\" must be a string, a list of tokens, or a list of mixed strings & tokens")


def prompt_list(st: AppState, prompt: Any) -> list[tuple[list[int], Any]]:
    """(tokens, the prompt as given) for each prompt of a request, by llama-server's rule
    (`tokenize_input_prompts`), which covers OpenAI's: an array holding any integer is ONE prompt (token ids,
    maybe mixed with strings); any other array is several prompts, each a string, token ids, mixed, or a
    `{"prompt_string"}` object."""
    if isinstance(prompt, list) and not any(_is_id(x) for x in prompt):
        if not prompt:
            raise invalid_request("\"prompt\" must not be empty")
        return [(_one_prompt(st, p, f"prompt[{i}]"), p) for i, p in enumerate(prompt)]
    return [(_one_prompt(st, prompt, "prompt"), prompt)]


def _gen_params(st: AppState, body: dict[str, Any], route: str,
                think: Callable[[str, str], str] | None = None) -> GenerationParams:
    """The request's generation parameters; `think`: structured.grammar_from's (a thinking chat template)."""
    assert st.engine is not None
    c = st.config
    p = generation_from(body, n_vocab=st.engine.n_vocab, default_n_predict=c.n_predict, default_seed=c.seed,
                        default_temp=c.temperature, route=route, eog=st.engine.eog,
                        tokenize=lambda text: _tokenize(st, text, add_special=False, parse_special=False))
    grammar = grammar_from(body, st.engine.llm._model.vocab, think)
    return dataclasses.replace(p, grammar=grammar) if grammar is not None else p


@dataclass(frozen=True)
class Job:
    """One choice to generate; a request's jobs are prompt-major (choice index = prompt_i * n + j, OpenAI's)."""

    toks: list[int]
    params: GenerationParams
    prompt: Any = None  # the prompt as the request gave it (the native route answers it)


def jobs_for(prompts: list[tuple[list[int], Any]], params: GenerationParams, n: int) -> list[Job]:
    """n jobs per prompt; with a fixed seed, completion j of a prompt samples with seed + j (choice_seed)."""
    if len(prompts) * n > MAX_CHOICES:
        raise invalid_request(f"{len(prompts)} prompts x \"n\" {n} = {len(prompts) * n} completions; at most "
                              f"{MAX_CHOICES} per request")
    seeded = [params if j == 0 else dataclasses.replace(params, sampling=dataclasses.replace(
        params.sampling, seed=choice_seed(params.sampling.seed, j))) for j in range(n)]
    return [Job(toks, seeded[j], given) for toks, given in prompts for j in range(n)]


def _submit(st: AppState, jobs: list[Job]) -> list[Ticket]:
    """Check every job, then queue them all (or none: 503 when the queue cannot take them)."""
    e = st.engine
    assert e is not None
    for job in jobs:
        if not job.toks:
            raise invalid_request("\"prompt\" must not be empty")
        if len(job.toks) >= e.n_ctx_slot:
            raise exceed_context(len(job.toks), e.n_ctx_slot)
        if job.params.id_slot >= e.n_parallel:
            raise invalid_request(f"\"id_slot\" {job.params.id_slot} does not exist ({e.n_parallel} slots)")
    cap = e.capacity
    if cap is not None and len(jobs) > cap:
        raise invalid_request(f"the request asks for {len(jobs)} completions; this server holds at most {cap} "
                              f"at once (--parallel {e.n_parallel} + --queue-size {e.queue_size})")
    try:
        return e.submit_many([(job.toks, job.params) for job in jobs])
    except QueueFull as err:
        raise unavailable(f"server busy: {err}") from None


def _cancel(st: AppState, ts: list[Ticket]) -> None:
    assert st.engine is not None
    for t in ts:
        st.engine.cancel(t)


def _next(st: AppState, ts: list[Ticket], req: Request) -> tuple[int, Event] | None:
    """The next (choice index, event) of a request's tickets; None (and the tickets cancelled) if the client went
    away meanwhile. The socket is looked at every 250 ms even while events keep coming (a non-streaming
    request)."""
    events = ts[0].events  # shared by all of them
    while True:
        try:
            got: tuple[int, Event] | None = events.get(timeout=0.25)
        except queue.Empty:
            got = None
        now = time.monotonic()
        if got is None or now - req.checked > 0.25:
            req.checked = now
            if req.gone():
                _cancel(st, ts)
                return None
        if got is not None:
            return got


def _raise_failed(st: AppState, ts: list[Ticket], ev: Failed) -> None:
    """One choice failed: the others are cancelled and the request answers the error (llama-server's rule)."""
    _cancel(st, ts)
    raise ApiError(ev.status, ev.type, ev.message)


def _collect(st: AppState, ts: list[Ticket], req: Request) -> list[tuple[str, Finished]] | None:
    """Every choice's whole text and Finished event, in index order; None when the client left first."""
    parts: list[list[str]] = [[] for _ in ts]
    done: dict[int, Finished] = {}
    while len(done) < len(ts):
        got = _next(st, ts, req)
        if got is None:
            return None
        i, ev = got
        if isinstance(ev, Failed):
            _raise_failed(st, ts, ev)
        elif isinstance(ev, Chunk):
            parts[i].append(ev.text)
        else:
            assert isinstance(ev, Finished)
            parts[i].append(ev.text)
            done[i] = ev
    return [("".join(parts[i]), done[i]) for i in range(len(ts))]


def _whole(st: AppState, ts: list[Ticket], req: Request,
           final: Callable[[list[tuple[str, Finished]]], Any]) -> Reply:
    """A non-streamed answer: every choice's text, shaped by `final`; 499 when the client left first."""
    got = _collect(st, ts, req)
    if got is None:
        return Reply(499, b"")
    return json_reply(final(got), n_tokens=sum(fin.n_decoded for _, fin in got))


def _llama_error_event(e: ApiError) -> bytes:
    return sse.error_event(e.body())


def _stream(st: AppState, ts: list[Ticket], req: Request, fmt: Callable[[int, Event, bool], list[bytes]],
            done: bool, end: Callable[[list[Finished]], list[bytes]] | None = None,
            error_event: Callable[[ApiError], bytes] = _llama_error_event) -> Reply | Stream:
    """SSE of all choices, interleaved as their tokens come (`fmt(index, event, first of this choice)`), then
    `end(every Finished)` and `[DONE]`. The first event is waited for here, so an error before any output is a
    plain error reply; one after it is an error event (`error_event`, llama-server's by default) that ends the
    stream (the other choices cancelled)."""
    first = _next(st, ts, req)
    if first is None:
        return Reply(499, b"")
    if isinstance(first[1], Failed):
        _raise_failed(st, ts, first[1])
    out = Stream(iter(()), lambda: _cancel(st, ts))

    def chunks() -> Iterator[bytes]:
        got: tuple[int, Event] | None = first
        finished: dict[int, Finished] = {}
        started: set[int] = set()
        decoded = [0] * len(ts)
        while got is not None:
            i, ev = got
            if isinstance(ev, Failed):
                _cancel(st, ts)
                yield error_event(ApiError(ev.status, ev.type, ev.message))
                return
            assert isinstance(ev, (Chunk, Finished))
            decoded[i] = ev.n_decoded
            out.n_tokens[0] = sum(decoded)
            yield from fmt(i, ev, i not in started)
            started.add(i)
            if isinstance(ev, Finished):
                finished[i] = ev
                if len(finished) == len(ts):
                    break
            got = _next(st, ts, req)
        if got is None:
            return  # the client left: nothing more to send
        if end is not None:
            yield from end([finished[i] for i in range(len(ts))])
        if done:
            yield sse.DONE

    out.chunks = chunks()
    return out


# ---- handlers ----

def health(st: AppState, req: Request) -> Reply:
    return json_reply({"status": "ok"})


def models(st: AppState, req: Request) -> Reply:
    c = st.config
    data = {"id": c.model_id, "aliases": sorted(set(c.aliases)), "tags": list(c.tags), "object": "model",
            "created": int(time.time()), "owned_by": "llamacpp", "meta": st.model_meta}
    return json_reply({"models": [{"name": c.model_id, "model": c.model_id, "modified_at": "", "size": "",
                                   "digest": "", "type": "model", "description": "", "tags": [""],
                                   "capabilities": ["completion"], "parameters": "",
                                   "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                                               "parameter_size": "", "quantization_level": ""}}],
                       "object": "list", "data": [data]})


def _settings(st: AppState, p: GenerationParams, n_ctx: int, model: str, stream: bool) -> dict[str, Any]:
    return {"n_predict": p.n_predict, "max_tokens": p.n_predict, "stop": list(p.stop), "ignore_eos": p.ignore_eos,
            "stream": stream, "n_ctx": n_ctx, "model": model, **p.sampling.to_json()}


def _response_fields(body: dict[str, Any]) -> list[str]:
    v = body.get("response_fields")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise invalid_request("\"response_fields\" must be an array of strings")
    return v


def completion(st: AppState, req: Request) -> Reply | Stream:
    """POST /completion: llama-server's native endpoint. Several prompts (or `n` > 1) answer a list of results,
    one per choice, each with its `index`; one answers the object itself."""
    return _native(st, req, req.json())


def _native(st: AppState, req: Request, body: dict[str, Any]) -> Reply | Stream:
    assert st.engine is not None
    engine = st.engine
    model = st.check_model(body)
    if "prompt" not in body:
        raise invalid_request("\"prompt\" is required")
    refuse_unsupported(body)
    params = _gen_params(st, body, route="native")
    jobs = jobs_for(prompt_list(st, body["prompt"]), params, get_n(body))
    stream = get_bool(body, "stream", False)
    fields = _response_fields(body)
    meta = responses.Meta.new(model, st.fingerprint, return_tokens=get_bool(body, "return_tokens", False),
                              timings_per_token=get_bool(body, "timings_per_token", False),
                              logprobs=params.n_probs >= 0)

    def prompt_text(job: Job) -> str:
        if isinstance(job.prompt, str):
            return job.prompt
        return engine.llm.detokenize(job.toks, special=True).decode("utf-8", "replace")  # as llama-server shows it

    def final(i: int, fin: Finished, text: str, streamed: bool) -> dict[str, Any]:
        settings = _settings(st, jobs[i].params, engine.n_ctx_slot, model, streamed)
        return responses.native_final(meta, fin, text, prompt_text(jobs[i]), settings, streamed, i)

    ts = _submit(st, jobs)
    if not stream:
        def whole(got: list[tuple[str, Finished]]) -> Any:
            out = [responses.pick_fields(final(i, fin, text, False), fields) for i, (text, fin) in enumerate(got)]
            return out[0] if len(out) == 1 else out
        return _whole(st, ts, req, whole)

    def fmt(i: int, ev: Event, first: bool) -> list[bytes]:
        n_prompt = len(jobs[i].toks)
        if isinstance(ev, Chunk):
            return [sse.event(responses.native_partial(meta, ev, n_prompt, -1, i))]
        assert isinstance(ev, Finished)
        out = []
        if ev.text:
            out.append(sse.event(responses.native_partial(meta, Chunk(ev.text, [], ev.n_decoded,
                                                                      probs=ev.tail_probs), n_prompt, ev.id_slot, i)))
        out.append(sse.event(final(i, ev, "", True)))
        return out

    return _stream(st, ts, req, fmt, done=False)


def oai_completions(st: AppState, req: Request) -> Reply | Stream:
    """POST /v1/completions: one choice per prompt and per `n`, prompt-major."""
    body = req.json()
    model = st.check_model(body)
    if "prompt" not in body:
        raise invalid_request("\"prompt\" is required")
    refuse_unsupported(body)
    params = _gen_params(st, body, route="oai")
    jobs = jobs_for(prompt_list(st, body["prompt"]), params, get_n(body))
    stream = get_bool(body, "stream", False)
    meta = _oai_meta(st, body, model, params)
    ts = _submit(st, jobs)
    if not stream:
        return _whole(st, ts, req, lambda got: responses.merged(
            [responses.oai_cmpl_final(meta, fin, text, index=i) for i, (text, fin) in enumerate(got)],
            [fin for _, fin in got]))

    def fmt(i: int, ev: Event, first: bool) -> list[bytes]:
        if isinstance(ev, Chunk):
            return [sse.event(responses.oai_cmpl_partial(meta, ev, i))]
        assert isinstance(ev, Finished)
        tail = Chunk(ev.text, [], ev.n_decoded, probs=ev.tail_probs)
        out = [sse.event(responses.oai_cmpl_partial(meta, tail, i))] if ev.text else []
        return [*out, sse.event(responses.oai_cmpl_final(meta, ev, "", stream=True, index=i))]

    return _stream(st, ts, req, fmt, done=True, end=_usage_end(meta, "text_completion"))


def _chat_prompt(st: AppState, body: dict[str, Any],
                 add_generation_prompt: bool = True) -> tuple[str, toolcalls.ToolRequest | None]:
    assert st.template is not None
    if not st.template.jinja:  # llama-server's legacy path has neither tools nor a tool choice
        if isinstance(body.get("tools"), list) and body["tools"]:
            raise invalid_request("tools param requires --jinja flag")
        if isinstance(body.get("tool_choice"), str) and body["tool_choice"] != "auto":
            raise invalid_request("tool_choice param requires --jinja flag")
        return st.template.render(check_messages(body), body, None, add_generation_prompt), None
    treq = toolcalls.tools_from(body, st.template.source)
    tools = toolcalls.template_tools(body["tools"]) if treq else None
    return st.template.render(check_messages(body), body, tools, add_generation_prompt), treq


def _oai_meta(st: AppState, body: dict[str, Any], model: str, params: GenerationParams) -> responses.Meta:
    """The OpenAI routes' Meta, with `stream_options.include_usage` (both routes honour it)."""
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise invalid_request("\"stream_options\" must be an object")
    return responses.Meta.new(model, st.fingerprint, include_usage=get_bool(opts, "include_usage", False),
                              timings_per_token=get_bool(body, "timings_per_token", False),
                              logprobs=params.n_probs >= 0)


def _usage_end(meta: responses.Meta, obj: str) -> Callable[[list[Finished]], list[bytes]]:
    def end(fins: list[Finished]) -> list[bytes]:
        chunk = responses.usage_chunk(meta, fins, obj)
        return [sse.event(chunk)] if chunk else []
    return end


@dataclass(frozen=True)
class ChatSetup:
    """A chat request made ready for the engine: the rendered prompt, its tokens, the generation parameters (with
    the tool grammar of `tool_choice` required/named) and how to split the answer. Shared by
    /v1/chat/completions and the routes that map onto it (Anthropic Messages, OpenAI Responses), so templating,
    sampling and tool parsing have one implementation."""

    prompt: str
    toks: list[int]
    params: GenerationParams
    treq: toolcalls.ToolRequest | None
    open_think: bool  # the prompt ends inside `<think>` (DeepSeek-R1): the answer starts as reasoning
    reasoning: bool  # split `<think>` reasoning off the answer
    think: tuple[str, str] = (toolcalls.THINK_OPEN, toolcalls.THINK_CLOSE)  # the template's reasoning markers

    @property
    def parses(self) -> bool:
        return (self.treq is not None and self.treq.parse) or self.reasoning

    def parser(self) -> toolcalls.OutputParser:
        """A fresh parser for one answer (with nothing to split, it passes the text through, stripped)."""
        return toolcalls.OutputParser(family=self.treq.family if self.treq else None,
                                      parse_tools=self.treq is not None and self.treq.parse,
                                      reasoning=self.reasoning, starts_in_thinking=self.open_think,
                                      think=self.think)


# Fields of UNSUPPORTED (params.py) that the chat routes implement: thinking budgets and effort (reasoning.py)
CHAT_FIELDS = frozenset({"reasoning_budget_tokens", "thinking_budget_tokens", "reasoning_budget_message",
                         "reasoning_effort"})


def chat_setup(st: AppState, body: dict[str, Any]) -> ChatSetup:
    """Render, tokenize and read the generation parameters of an OpenAI chat body (messages, tools, sampling)."""
    assert st.template is not None and st.engine is not None
    prompt, treq = _chat_prompt(st, body)
    toks = _tokenize(st, prompt, add_special=True)
    thinks = st.template.jinja and toolcalls.template_thinks(st.template.source)
    tags = toolcalls.think_tags(st.template.source)
    open_think = st.template.jinja and prompt.rstrip().endswith(tags[0])
    # no reasoning split without Jinja: llama-server's legacy path parses the whole answer as content
    reasoning = thinks and get_str(body, "reasoning_format", st.config.reasoning_format) != "none"
    # a JSON answer may think first, unless the prompt closed the thinking block already (thinking switched off:
    # Qwen3's `<think>\n\n</think>`), as llama.cpp's grammar, fed the generation prompt, allows
    closed = prompt.rstrip().endswith(tags[1])
    think = ((lambda rule, g: think_first(rule, g, tags, open_think)) if reasoning and not closed else None)
    params = _gen_params(st, body, route="chat", think=think)
    if treq is not None and treq.choice in ("required", "named"):
        if params.grammar is not None:
            raise invalid_request("Cannot use custom grammar constraints with tool_choice required or a named tool")
        g = toolcalls.tool_grammar(treq, open_think)
        check_grammar(st.engine.llm._model.vocab, g, "tools")
        params = dataclasses.replace(params, grammar=g)
    elif treq is not None and treq.strict:
        if params.grammar is not None:
            raise invalid_request("Cannot use custom grammar constraints with strict tools")
        trigger = _strict_trigger(st, treq, tags[1] if open_think else "")
        g = toolcalls.tool_grammar(treq, open_think)
        check_grammar(st.engine.llm._model.vocab, g, "tools")
        params = dataclasses.replace(params, grammar=g, grammar_trigger=trigger)
    budget = _reasoning_budget(st, body, tags, prompt, open_think) if thinks else None
    if budget is not None:
        params = dataclasses.replace(params, reasoning_budget=budget)
    return ChatSetup(prompt, toks, params, treq, open_think, reasoning, tags)


def _strict_trigger(st: AppState, treq: toolcalls.ToolRequest, after: str) -> TriggerSpec:
    """Where the grammar of strict tools under tool_choice "auto" starts (toolcalls.strict_trigger, trigger.py);
    a 400 naming the first strict tool where no grammar can start at the template's tool calls (Llama 3.x: bare
    JSON), rather than an answer whose arguments nothing checked."""
    assert st.engine is not None
    opener = toolcalls.strict_trigger(treq.family)
    toks = _tokenize(st, opener, add_special=False) if opener else []
    if not toks or b"".join(st.engine.piece(t, special=True) for t in toks) != opener.encode():
        i = next(i for i, t in enumerate(treq.tools) if t.strict)
        raise refused(f"tools[{i}].function.strict", "with tool_choice \"auto\" on this chat template: its tool "
                      "calls have no opener for a grammar to start at; use tool_choice \"required\" or a named "
                      "function (whose grammar enforces the schema), or drop \"strict\"")
    return TriggerSpec(opener.encode(), tuple(toks), after.encode())


def _reasoning_budget(st: AppState, body: dict[str, Any], tags: tuple[str, str], prompt: str,
                      open_think: bool) -> BudgetSpec | None:
    """The thinking budget of a chat request on a thinking template, as llama-server reads it:
    `reasoning_budget_tokens`, else `thinking_budget_tokens`, else --reasoning-budget; -1 is none. The forced end:
    `reasoning_budget_message` (else --reasoning-budget-message), then the end tag. Where the prompt opened the
    block, what it holds after the start tag (DeepSeek-R1's newline) counts, as llama.cpp counts it."""
    name = "reasoning_budget_tokens" if body.get("reasoning_budget_tokens") is not None else "thinking_budget_tokens"
    n = get_int(body, name, -1, lo=-1)
    if n == -1:
        n = st.config.reasoning_budget
    message = get_str(body, "reasoning_budget_message", st.config.reasoning_budget_message) or ""
    if n < 0:
        return None
    start, end = (_tokenize(st, t, add_special=False) for t in tags)
    forced = (_tokenize(st, message, add_special=False) if message else []) + end
    tail = prompt[prompt.rindex(tags[0]) + len(tags[0]):] if open_think else ""
    spent = len(_tokenize(st, tail, add_special=False)) if tail else 0
    return BudgetSpec(n, tuple(start), (tuple(end),), tuple(forced), counting=open_think, spent=spent)


def chat_completions(st: AppState, req: Request) -> Reply | Stream:
    """POST /v1/chat/completions: the GGUF's chat template, then generation as for completions (`n` choices of the
    one conversation); with tools or a thinking template, each answer is split into reasoning, content and tool
    calls (toolcalls.py)."""
    body = req.json()
    model = st.check_model(body)
    refuse_unsupported(body, skip=CHAT_FIELDS)
    cs = chat_setup(st, body)
    jobs = jobs_for([(cs.toks, cs.prompt)], cs.params, get_n(body))
    if cs.parses:
        return _chat_parsed(st, req, body, model, jobs, [cs.parser() for _ in jobs])
    stream = get_bool(body, "stream", False)
    meta = _oai_meta(st, body, model, cs.params)
    ts = _submit(st, jobs)
    if not stream:
        return _whole(st, ts, req, lambda got: responses.merged(
            [responses.chat_final(meta, fin, text, index=i) for i, (text, fin) in enumerate(got)],
            [fin for _, fin in got]))

    def fmt(i: int, ev: Event, first: bool) -> list[bytes]:
        if isinstance(ev, Chunk):
            return [sse.event(responses.chat_partial(meta, ev, first, i))]
        assert isinstance(ev, Finished)
        head = [responses.chat_role_chunk(meta, i)] if first else []
        return [sse.event([*head, *responses.chat_stream_final(meta, ev, ev.text, index=i)])]

    return _stream(st, ts, req, fmt, done=True, end=_usage_end(meta, "chat.completion.chunk"))


def _chat_parsed(st: AppState, req: Request, body: dict[str, Any], model: str, jobs: list[Job],
                 parsers: list[toolcalls.OutputParser]) -> Reply | Stream:
    """Chat answers each split by its own parser into reasoning_content, content and tool_calls."""
    stream = get_bool(body, "stream", False)
    meta = _oai_meta(st, body, model, jobs[0].params)
    ts = _submit(st, jobs)
    if not stream:
        def final(got: list[tuple[str, Finished]]) -> dict[str, Any]:
            answers = []
            for i, (text, fin) in enumerate(got):
                p = parsers[i]
                p.feed(text)
                p.finish()
                answers.append(responses.chat_final(meta, fin, p.final_content, reasoning=p.final_reasoning,
                                                    calls=p.calls, index=i))
            return responses.merged(answers, [fin for _, fin in got])
        return _whole(st, ts, req, final)

    def fmt(i: int, ev: Event, first: bool) -> list[bytes]:
        parser = parsers[i]
        out = [responses.chat_role_chunk(meta, i)] if first else []
        if isinstance(ev, Chunk):
            out += responses.chat_delta_chunks(meta, parser.feed(ev.text), ev.probs, ev, i)
            return [sse.event(out)] if out else []
        assert isinstance(ev, Finished)
        d = parser.feed(ev.text)
        d2 = parser.finish()
        d.reasoning, d.content, d.calls = d.reasoning + d2.reasoning, d.content + d2.content, d.calls + d2.calls
        out += responses.chat_delta_chunks(meta, d, ev.tail_probs, None, i)
        out += responses.chat_stream_final(meta, ev, "", tool_calls=bool(parser.calls), index=i)
        return [sse.event(out)]

    return _stream(st, ts, req, fmt, done=True, end=_usage_end(meta, "chat.completion.chunk"))


def _answer_deltas(cs: ChatSetup) -> Callable[[str, bool], toolcalls.Delta]:
    """`feed(text, last)` -> the answer's parsed delta: through the chat route's parser when the request has tools
    or the template thinks, else the text as it is (as the chat route answers it)."""
    if not cs.parses:
        return lambda text, last: toolcalls.Delta(content=text)
    parser = cs.parser()

    def feed(text: str, last: bool) -> toolcalls.Delta:
        d = parser.feed(text)
        if last:
            d2 = parser.finish()
            d.reasoning, d.content, d.calls = d.reasoning + d2.reasoning, d.content + d2.content, d.calls + d2.calls
        return d
    return feed


def anthropic_messages(st: AppState, req: Request) -> Reply | Stream:
    """POST /v1/messages: Anthropic's Messages API on the chat path (anthropic.py maps the request and shapes the
    answer; errors are answered in Anthropic's shape by the HTTP layer, see ANTHROPIC_PATHS)."""
    body = req.json()
    chat = anthropic.to_chat(body)
    model = st.check_model(chat)
    cs = chat_setup(st, chat)
    feed = _answer_deltas(cs)
    msg_id = anthropic.message_id()
    ts = _submit(st, jobs_for([(cs.toks, cs.prompt)], cs.params, 1))
    if not get_bool(chat, "stream", False):
        def final(got: list[tuple[str, Finished]]) -> dict[str, Any]:
            text, fin = got[0]
            blocks = anthropic.Blocks()
            blocks.add(feed(text, True))
            return anthropic.message(msg_id, model, blocks.blocks, fin)
        return _whole(st, ts, req, final)

    blocks = anthropic.Blocks()

    def fmt(i: int, ev: Event, first: bool) -> list[bytes]:
        assert isinstance(ev, (Chunk, Finished))
        out = []
        if first:
            cached = ev.timings.cache_n if ev.timings is not None else 0
            out += anthropic.message_start(msg_id, model, len(cs.toks), cached)
        out += blocks.add(feed(ev.text, isinstance(ev, Finished)))
        if isinstance(ev, Finished):
            out += anthropic.message_end(blocks, ev)
        return out

    return _stream(st, ts, req, fmt, done=False, error_event=anthropic.error_event)


def anthropic_count_tokens(st: AppState, req: Request) -> Reply:
    """POST /v1/messages/count_tokens: the tokens of the prompt /v1/messages would evaluate (the chat template's
    rendering of system, messages and tools, tokenized as the chat route does)."""
    chat = anthropic.to_chat(req.json(), count_only=True)
    st.check_model(chat)
    prompt, _ = _chat_prompt(st, chat)
    return json_reply({"input_tokens": len(_tokenize(st, prompt, add_special=True))})


def oai_responses(st: AppState, req: Request) -> Reply | Stream:
    """POST /v1/responses: OpenAI's Responses API on the chat path (responses_api.py maps the request and shapes
    the output items and stream events)."""
    body = req.json()
    chat = responses_api.to_chat(body)
    model = st.check_model(chat)
    cs = chat_setup(st, chat)
    feed = _answer_deltas(cs)
    head = responses_api.Head(model, body)
    items = responses_api.Items()
    ts = _submit(st, jobs_for([(cs.toks, cs.prompt)], cs.params, 1))
    if not get_bool(chat, "stream", False):
        def final(got: list[tuple[str, Finished]]) -> dict[str, Any]:
            text, fin = got[0]
            items.add(feed(text, True))
            status = "incomplete" if responses_api.incomplete(fin) else "completed"
            items.close(status)
            return head.response(status, items.output, fin)
        return _whole(st, ts, req, final)

    def fmt(i: int, ev: Event, first: bool) -> list[bytes]:
        assert isinstance(ev, (Chunk, Finished))
        out = items.start(head) if first else []
        out += items.add(feed(ev.text, isinstance(ev, Finished)))
        if isinstance(ev, Finished):
            out += items.finish(head, ev)
        return out

    return _stream(st, ts, req, fmt, done=False, error_event=responses_api.error_event)


def oai_responses_input_tokens(st: AppState, req: Request) -> Reply:
    """POST /v1/responses/input_tokens: the tokens of the prompt /v1/responses would evaluate."""
    chat = responses_api.to_chat(req.json(), count_only=True)
    st.check_model(chat)
    prompt, _ = _chat_prompt(st, chat)
    return json_reply({"object": "response.input_tokens", "input_tokens": len(_tokenize(st, prompt, True))})


def chat_input_tokens(st: AppState, req: Request) -> Reply:
    """POST /v1/chat/completions/input_tokens (and /chat/completions/input_tokens), as llama-server: the token
    count of the prompt /v1/chat/completions would evaluate for the same body (template, messages and tools)."""
    body = req.json()
    st.check_model(body)
    prompt, _ = _chat_prompt(st, body)
    return json_reply({"input_tokens": len(_tokenize(st, prompt, add_special=True))})


def _embedding_tokens(st: AppState, entry: Any, name: str) -> list[int]:
    if isinstance(entry, dict) and "content" in entry:
        return _tokenize(st, check_utf8(embeddings.content_text(entry["content"], f"{name}.content"), name),
                         st.add_bos)
    return _one_prompt(st, entry, name)


def _embeddings(st: AppState, req: Request, oai_route: bool) -> Reply:
    """POST /v1/embeddings and /embedding(s): one embedding ticket per prompt, answered when all are done."""
    e = st.engine
    assert e is not None
    if not e.embeddings:
        raise embeddings.not_enabled()
    body = req.json()
    model = st.check_model(body)
    er = embeddings.parse(body, oai_route=oai_route, pooling=e.pooling, default_normalize=st.config.embd_normalize)
    prompts = [_embedding_tokens(st, x, f"{er.name}[{i}]" if er.several else er.name)
               for i, x in enumerate(er.entries)]
    for toks in prompts:
        embeddings.check_fits(len(toks), pooling=e.pooling, n_ubatch=e.n_ubatch, n_ctx_slot=e.n_ctx_slot)
    if e.capacity is not None and len(prompts) > e.capacity:
        raise invalid_request(f"the request has {len(prompts)} inputs; this server holds at most {e.capacity} at "
                              f"once (--parallel {e.n_parallel} + --queue-size {e.queue_size})")
    try:
        ts = e.submit_embeddings(prompts, er.normalize)
    except QueueFull as err:
        raise unavailable(f"server busy: {err}") from None
    done: dict[int, Embedded] = {}
    while len(done) < len(ts):
        got = _next(st, ts, req)
        if got is None:
            return Reply(499, b"")
        i, ev = got
        if isinstance(ev, Failed):
            _raise_failed(st, ts, ev)
        assert isinstance(ev, Embedded)
        done[i] = ev
    vectors = [done[i].vectors for i in range(len(ts))]
    if er.oai:
        return json_reply(embeddings.oai_answer(model, vectors, [done[i].n_prompt for i in range(len(ts))],
                                                er.use_base64))
    return json_reply(embeddings.native_answer(vectors))


def embeddings_native(st: AppState, req: Request) -> Reply:
    """POST /embedding, /embeddings: llama-server's shape (a list of {index, embedding: [vectors]})."""
    return _embeddings(st, req, oai_route=False)


def embeddings_oai(st: AppState, req: Request) -> Reply:
    """POST /v1/embeddings: OpenAI's shape (with `content` instead of `input`, the native one, as llama-server)."""
    return _embeddings(st, req, oai_route=True)


def rerank(st: AppState, req: Request) -> Reply:
    """POST /rerank (and llama-server's other names for it): not implemented, refused with llama-server's status
    for a server without --reranking (501)."""
    raise embeddings.rerank_refused()


def _feature_disabled(feature: str) -> Callable[[AppState, Request], Reply]:
    """llama-server's answer on a route whose feature its flags leave off (403 "feature_disabled"): here the feature
    is not implemented, and its flag is refused."""
    def refuse(st: AppState, req: Request) -> Reply:
        raise ApiError(403, "feature_disabled", f"this feature is disabled: {feature} is not supported by this server")
    return refuse


def resumable_stream(st: AppState, req: Request) -> Reply:
    """GET /v1/stream: llama-server's resumable streams are not implemented (501, named)."""
    raise ApiError(501, "not_supported_error", "resumable streams (the X-Conversation-Id header, /v1/stream) are "
                   "not supported by this server")


def infill(st: AppState, req: Request) -> Reply | Stream:
    """POST /infill: fill-in-the-middle as llama-server does it (infill.py lays out the prompt), then generation and
    answer as /completion; a model without FIM tokens answers 501, as llama-server."""
    assert st.engine is not None
    vocab = st.engine.llm._model.vocab
    fim = fill.FimTokens(*(int(f(vocab)) for f in (lc.llama_vocab_fim_pre, lc.llama_vocab_fim_suf,
                                                    lc.llama_vocab_fim_mid, lc.llama_vocab_fim_rep,
                                                    lc.llama_vocab_fim_sep)))
    if fim.missing():
        raise ApiError(501, "not_supported_error", f"Infill is not supported by this model: {fim.missing()}")
    body = req.json()
    extra = fill.check_fields(body)
    add_bos = bool(lc.llama_vocab_get_add_bos(vocab))
    toks = fill.infill_prompt(fim, lambda text, special: _tokenize(st, text, False, special), body, extra,
                              n_batch=st.config.n_batch, n_predict=st.config.n_predict, n_ctx=st.engine.n_ctx_slot,
                              bos=int(lc.llama_vocab_bos(vocab)) if add_bos else None)
    rest = {k: v for k, v in body.items() if k not in ("input_prefix", "input_suffix", "input_extra")}
    return _native(st, req, {**rest, "prompt": toks})


def apply_template(st: AppState, req: Request) -> Reply:
    """POST /apply-template: the rendered prompt; `add_generation_prompt` false leaves the assistant's header off
    (as llama-server; the chat route refuses it, since it cannot continue a turn)."""
    body = req.json()
    return json_reply({"prompt": _chat_prompt(st, body, get_bool(body, "add_generation_prompt", True))[0]})


def tokenize(st: AppState, req: Request) -> Reply:
    body = req.json()
    content = body.get("content")
    if not isinstance(content, str):
        raise invalid_request("\"content\" (a string) is required")
    check_utf8(content, "content")
    toks = _tokenize(st, content, get_bool(body, "add_special", False), get_bool(body, "parse_special", True))
    if not get_bool(body, "with_pieces", False):
        return json_reply({"tokens": toks})
    assert st.engine is not None
    out = []
    for tok in toks:
        raw = st.engine.llm.detokenize([tok], special=True)
        try:
            piece: Any = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        out.append({"id": tok, "piece": piece})
    return json_reply({"tokens": out})


def detokenize(st: AppState, req: Request) -> Reply:
    body = req.json()
    toks = body.get("tokens", [])
    if not isinstance(toks, list):
        raise invalid_request("\"tokens\" must be an array of token ids")
    assert st.engine is not None
    text = st.engine.llm.detokenize(_check_ids(st, toks, "tokens"), special=True) if toks else b""
    return json_reply({"content": text.decode("utf-8", "replace")})


def props(st: AppState, req: Request) -> Reply:
    assert st.engine is not None
    c = st.config
    default = GenerationParams(n_predict=c.n_predict, sampling=SamplingParams(
        temperature=c.temperature, seed=SEED_RANDOM if c.seed == -1 else c.seed))
    settings = st.engine.slot_state(st.engine.slots[0])
    settings["params"] = _settings(st, default, st.engine.n_ctx_slot, c.model_id, False)
    settings["params"].pop("n_ctx")
    settings["params"].pop("model")
    return json_reply({
        "default_generation_settings": settings,
        "total_slots": st.engine.n_parallel,
        "model_alias": c.model_id,
        "model_path": str(c.model),
        "chat_template": st.template.source if st.template else "",
        "chat_template_caps": {},
        "modalities": {"vision": False, "audio": False},
        "build_info": st.fingerprint,
        "is_sleeping": False,
        "rapidmoe": {"residual": str(c.residual) if c.residual else None, "n_critical": c.n_critical,
                     "policy": str(c.policy) if c.policy else None},
    })


def slots(st: AppState, req: Request) -> Reply:
    if not st.config.slots:
        raise ApiError(501, "not_supported_error", "This server does not support slots endpoint.")
    assert st.engine is not None
    states = [st.engine.slot_state(s) for s in st.engine.slots]
    if "fail_on_no_slot=1" in req.path and all(s["is_processing"] for s in states):
        raise unavailable("no slot available")
    return json_reply(states)


def get_metrics(st: AppState, req: Request) -> Reply:
    if not st.config.metrics:
        raise ApiError(501, "not_supported_error", "This server does not support metrics endpoint.")
    e = st.engine
    assert e is not None
    snap = e.call(lambda: metrics.snapshot(e.llm))
    text = metrics.render(e.stats, snap, st.requests.snapshot(), e.n_busy, e.n_waiting,
                          getattr(e.llm, "residual", None) is not None)
    return Reply(200, text.encode(), "text/plain; version=0.0.4",
                 headers={"Process-Start-Time-Unix": str(int(st.started))})


WEB_FILES = {"/": ("index.html", "text/html; charset=utf-8"), "/index.html": ("index.html", "text/html; charset=utf-8"),
             "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
             "/static/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
             "/static/style.css": ("style.css", "text/css; charset=utf-8")}


def web_file(st: AppState, req: Request) -> Reply:
    """The chat page (server/web/, shipped in the wheel as package data; no build step)."""
    if not st.config.ui:
        raise not_found("File Not Found")  # --no-ui, as llama-server
    name, content_type = WEB_FILES[req.path.split("?", 1)[0]]
    data = (importlib.resources.files("rapidmoe.server") / "web" / name).read_bytes()
    return Reply(200, data, content_type, headers={"Cache-Control": "no-cache"})


def stats(st: AppState, req: Request) -> Reply:
    """GET /rapidmoe/stats, for the page: the model, generation counters and, for a RESplit model, the share of
    critical expert slots and the per-layer r histogram (both phases) since start."""
    e = st.engine
    assert e is not None
    llm = e.llm
    out: dict[str, Any] = {"model": st.config.model_id, "slots": e.n_parallel, "busy": e.n_busy,
                           "tokens_predicted": e.stats.predicted_tokens,
                           "predicted_tokens_seconds": (e.stats.predicted_tokens / e.stats.predicted_seconds
                                                        if e.stats.predicted_seconds else 0.0),
                           "split": getattr(llm, "residual", None) is not None}
    if out["split"]:
        hist, snap = e.call(lambda: (llm.r_histogram(), metrics.snapshot(llm)))
        counts = hist.counts.sum(axis=1)
        out.update({"k": hist.k, "expert_slots": snap.moe_slots, "critical_slots": snap.moe_critical_slots,
                    "critical_fraction": snap.moe_critical_slots / snap.moe_slots if snap.moe_slots else 0.0,
                    "layers": [{"layer": il, "counts": [int(x) for x in counts[m]], "mean_r": float(r)}
                               for m, (il, r) in enumerate(zip(hist.layers, hist.mean_r(), strict=True))]})
    return json_reply(out)


GET = {**dict.fromkeys(WEB_FILES, web_file), "/rapidmoe/stats": stats,
       "/health": health, "/v1/health": health, "/models": models, "/v1/models": models, "/props": props,
       "/slots": slots, "/metrics": get_metrics,
       "/tools": _feature_disabled("server tools and MCP servers (--tools, --mcp-servers-*)"),
       "/cors-proxy": _feature_disabled("the web UI's MCP CORS proxy (--ui-mcp-proxy)"),
       "/v1/stream": resumable_stream}
POST = {"/completion": completion, "/completions": completion, "/v1/completions": oai_completions,
        "/chat/completions": chat_completions, "/v1/chat/completions": chat_completions,
        "/chat/completions/input_tokens": chat_input_tokens, "/v1/chat/completions/input_tokens": chat_input_tokens,
        "/tokenize": tokenize, "/detokenize": detokenize, "/apply-template": apply_template,
        "/v1/messages": anthropic_messages, "/v1/messages/count_tokens": anthropic_count_tokens,
        "/v1/responses": oai_responses, "/responses": oai_responses,
        "/v1/responses/input_tokens": oai_responses_input_tokens, "/responses/input_tokens": oai_responses_input_tokens,
        "/embedding": embeddings_native, "/embeddings": embeddings_native, "/v1/embeddings": embeddings_oai,
        **dict.fromkeys(("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"), rerank), "/infill": infill,
        "/tools": GET["/tools"], "/cors-proxy": GET["/cors-proxy"]}
# Routes whose errors (also those of the HTTP layer: auth, limits, loading) are answered in Anthropic's shape.
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


def model_meta(llm: Any, path: str) -> dict[str, Any]:
    """/v1/models `meta`, from the loaded model."""
    m = llm._model.model
    return {"vocab_type": int(lc.llama_vocab_type(llm._model.vocab)), "n_vocab": int(llm.n_vocab()),
            "n_ctx_train": int(lc.llama_model_n_ctx_train(m)), "n_embd": int(lc.llama_model_n_embd(m)),
            "n_params": int(lc.llama_model_n_params(m)), "size": os.path.getsize(path)}
