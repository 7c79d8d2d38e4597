"""What every API family's handlers share: the request, the answers, the app state, and a request's way from
its prompts to the engine's tickets and back.

A handler (api/<family>.py) gets the app state and a parsed Request and returns a Reply (whole body) or a Stream
(SSE bytes); the route table (server/routes.py) names each path's handler. Sockets, auth, limits and logging are the
HTTP layer's (app.py). Prompts here: text, token ids or both -> tokens (llama-server's rules); jobs: one per choice;
answers: every choice collected whole, or streamed as SSE as its tokens come.
"""
from __future__ import annotations

import dataclasses
import json
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ... import __version__
from ...tokenize_stack import TextTooLongError
from .. import metrics, sse
from ..chat import ChatTemplate
from ..config import ServerConfig
from ..engine import Chunk, Engine, Event, Failed, Finished, QueueFull, Ticket
from ..errors import ApiError, exceed_context, invalid_request, not_found, unavailable
from ..params import (
    MAX_CHOICES,
    GenerationParams,
    check_utf8,
    choice_seed,
    generation_from,
    get_n,
    refuse_unsupported,
    refused,
)
from ..structured import grammar_from


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


def tokenize_text(st: AppState, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
    assert st.engine is not None
    try:
        return st.engine.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
    except TextTooLongError as e:  # a line llama.cpp's regex pre-tokenizer cannot split (rapidmoe.tokenize_stack)
        raise invalid_request(str(e)) from e


def check_ids(st: AppState, toks: list[Any], name: str) -> list[int]:
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


def one_prompt(st: AppState, p: Any, name: str) -> list[int]:
    """One prompt: a string, token ids, ids mixed with strings (BOS first when it starts with text), or
    llama-server's `{"prompt_string": ...}` object (its `multimodal_data` is refused)."""
    if isinstance(p, dict):
        if p.get("multimodal_data") not in (None, []):
            raise refused(f"{name}.multimodal_data", "multimodal input")
        if "prompt_string" not in p:
            raise invalid_request(f"\"{name}\": a prompt object needs \"prompt_string\"")
        p, name = p["prompt_string"], f"{name}.prompt_string"
    if isinstance(p, str):
        return tokenize_text(st, check_utf8(p, name), st.add_bos)
    if isinstance(p, list) and p and all(isinstance(x, str) or _is_id(x) for x in p):
        out: list[int] = []
        for i, x in enumerate(p):
            if isinstance(x, str):
                out += tokenize_text(st, check_utf8(x, name), st.add_bos and i == 0)
            else:
                out += check_ids(st, [x], name)
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
        return [(one_prompt(st, p, f"prompt[{i}]"), p) for i, p in enumerate(prompt)]
    return [(one_prompt(st, prompt, "prompt"), prompt)]


def gen_params(st: AppState, body: dict[str, Any], route: str,
               think: Callable[[str, str], str] | None = None) -> GenerationParams:
    """The request's generation parameters; `think`: structured.grammar_from's (a thinking chat template)."""
    assert st.engine is not None
    c = st.config
    p = generation_from(body, n_vocab=st.engine.n_vocab, default_n_predict=c.n_predict, default_seed=c.seed,
                        default_temp=c.temperature, route=route, eog=st.engine.eog,
                        tokenize=lambda text: tokenize_text(st, text, add_special=False, parse_special=False))
    grammar = grammar_from(body, st.engine.llm.vocab, think)
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


@dataclass(frozen=True)
class CompletionRequest:
    """A completion request (/completion, /infill, /v1/completions) made ready for the engine: the model it named,
    its generation parameters and one job per prompt and choice."""

    model: str
    params: GenerationParams
    jobs: list[Job]


def completion_request(st: AppState, body: dict[str, Any], route: str) -> CompletionRequest:
    """Read a completion request's model, prompts, `n` and generation parameters (`route`: "native" or "oai",
    whose `logprobs` differ), in the order these routes have always checked them."""
    model = st.check_model(body)
    if "prompt" not in body:
        raise invalid_request("\"prompt\" is required")
    refuse_unsupported(body)
    params = gen_params(st, body, route=route)
    return CompletionRequest(model, params, jobs_for(prompt_list(st, body["prompt"]), params, get_n(body)))


# ---- tickets and answers ----

def submit(st: AppState, jobs: list[Job]) -> list[Ticket]:
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


def next_event(st: AppState, ts: list[Ticket], req: Request) -> tuple[int, Event] | None:
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


def raise_failed(st: AppState, ts: list[Ticket], ev: Failed) -> None:
    """One choice failed: the others are cancelled and the request answers the error (llama-server's rule)."""
    _cancel(st, ts)
    raise ApiError(ev.status, ev.type, ev.message)


def _collect(st: AppState, ts: list[Ticket], req: Request) -> list[tuple[str, Finished]] | None:
    """Every choice's whole text and Finished event, in index order; None when the client left first."""
    parts: list[list[str]] = [[] for _ in ts]
    done: dict[int, Finished] = {}
    while len(done) < len(ts):
        got = next_event(st, ts, req)
        if got is None:
            return None
        i, ev = got
        if isinstance(ev, Failed):
            raise_failed(st, ts, ev)
        elif isinstance(ev, Chunk):
            parts[i].append(ev.text)
        else:
            assert isinstance(ev, Finished)
            parts[i].append(ev.text)
            done[i] = ev
    return [("".join(parts[i]), done[i]) for i in range(len(ts))]


def whole_answer(st: AppState, ts: list[Ticket], req: Request,
                 final: Callable[[list[tuple[str, Finished]]], Any]) -> Reply:
    """A non-streamed answer: every choice's text, shaped by `final`; 499 when the client left first."""
    got = _collect(st, ts, req)
    if got is None:
        return Reply(499, b"")
    return json_reply(final(got), n_tokens=sum(fin.n_decoded for _, fin in got))


def _llama_error_event(e: ApiError) -> bytes:
    return sse.error_event(e.body())


def streamed_answer(st: AppState, ts: list[Ticket], req: Request, fmt: Callable[[int, Event, bool], list[bytes]],
                    done: bool, end: Callable[[list[Finished]], list[bytes]] | None = None,
                    error_event: Callable[[ApiError], bytes] = _llama_error_event) -> Reply | Stream:
    """SSE of all choices, interleaved as their tokens come (`fmt(index, event, first of this choice)`), then
    `end(every Finished)` and `[DONE]`. The first event is waited for here, so an error before any output is a
    plain error reply; one after it is an error event (`error_event`, llama-server's by default) that ends the
    stream (the other choices cancelled)."""
    first = next_event(st, ts, req)
    if first is None:
        return Reply(499, b"")
    if isinstance(first[1], Failed):
        raise_failed(st, ts, first[1])
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
            got = next_event(st, ts, req)
        if got is None:
            return  # the client left: nothing more to send
        if end is not None:
            yield from end([finished[i] for i in range(len(ts))])
        if done:
            yield sse.DONE

    out.chunks = chunks()
    return out
