"""OpenAI's completion routes: /v1/completions and /v1/chat/completions (with their input-token counts).

Chat requests take the chat path (chat_path.py); the answers' JSON and chunks are server/responses.py's.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import responses, sse, toolcalls
from ..engine import Chunk, Event, Finished, Ticket
from ..params import GenerationParams, Output, get_n, oai_output, refuse_unsupported
from . import serving
from .chat_path import chat_setup, prompt_tokens
from .serving import AppState, Job, Reply, Request, Stream, json_reply


def oai_completions(st: AppState, req: Request) -> Reply | Stream:
    """POST /v1/completions: one choice per prompt and per `n`, prompt-major."""
    body = req.json()
    c = serving.completion_request(st, body, route="oai")
    opts = oai_output(body)
    meta = _oai_meta(st, opts, c.model, c.params)
    ts = serving.submit(st, c.jobs)
    if not opts.stream:
        return _merged(st, ts, req, lambda i, text, fin: responses.oai_cmpl_final(meta, fin, text, index=i))

    def fmt(i: int, ev: Event, first: bool) -> list[bytes]:
        if isinstance(ev, Chunk):
            return [sse.event(responses.oai_cmpl_partial(meta, ev, i))]
        assert isinstance(ev, Finished)
        tail = Chunk(ev.text, [], ev.n_decoded, probs=ev.tail_probs)
        out = [sse.event(responses.oai_cmpl_partial(meta, tail, i))] if ev.text else []
        return [*out, sse.event(responses.oai_cmpl_final(meta, ev, "", stream=True, index=i))]

    return serving.streamed_answer(st, ts, req, fmt, done=True, end=_usage_end(meta, "text_completion"))


def _oai_meta(st: AppState, opts: Output, model: str, params: GenerationParams) -> responses.Meta:
    """The OpenAI routes' Meta, with `stream_options.include_usage` (both routes honour it)."""
    return responses.Meta.new(model, st.fingerprint, include_usage=opts.include_usage,
                              timings_per_token=opts.timings_per_token, logprobs=params.n_probs >= 0)


def _merged(st: AppState, ts: list[Ticket], req: Request,
            answer: Callable[[int, str, Finished], dict[str, Any]]) -> Reply:
    """A non-streamed OpenAI answer: `answer(index, text, Finished)` of each choice, merged into one object (every
    choice, the usage summed)."""
    return serving.whole_answer(st, ts, req, lambda got: responses.merged(
        [answer(i, text, fin) for i, (text, fin) in enumerate(got)], [fin for _, fin in got]))


def _usage_end(meta: responses.Meta, obj: str) -> Callable[[list[Finished]], list[bytes]]:
    def end(fins: list[Finished]) -> list[bytes]:
        chunk = responses.usage_chunk(meta, fins, obj)
        return [sse.event(chunk)] if chunk else []
    return end


# Fields of UNSUPPORTED (params.py) that the chat routes implement: thinking budgets and effort (reasoning.py)
CHAT_FIELDS = frozenset({"reasoning_budget_tokens", "thinking_budget_tokens", "reasoning_budget_message",
                         "reasoning_effort"})


def chat_completions(st: AppState, req: Request) -> Reply | Stream:
    """POST /v1/chat/completions: the GGUF's chat template, then generation as for completions (`n` choices of the
    one conversation); with tools or a thinking template, each answer is split into reasoning, content and tool
    calls (toolcalls.py)."""
    body = req.json()
    model = st.check_model(body)
    refuse_unsupported(body, skip=CHAT_FIELDS)
    cs = chat_setup(st, body)
    jobs = serving.jobs_for([(cs.toks, cs.prompt)], cs.params, get_n(body))
    opts = oai_output(body)
    if cs.parses:
        return _chat_parsed(st, req, opts, model, jobs, [cs.parser() for _ in jobs])
    meta = _oai_meta(st, opts, model, cs.params)
    ts = serving.submit(st, jobs)
    if not opts.stream:
        return _merged(st, ts, req, lambda i, text, fin: responses.chat_final(meta, fin, text, index=i))

    def fmt(i: int, ev: Event, first: bool) -> list[bytes]:
        if isinstance(ev, Chunk):
            return [sse.event(responses.chat_partial(meta, ev, first, i))]
        assert isinstance(ev, Finished)
        head = [responses.chat_role_chunk(meta, i)] if first else []
        return [sse.event([*head, *responses.chat_stream_final(meta, ev, ev.text, index=i)])]

    return serving.streamed_answer(st, ts, req, fmt, done=True, end=_usage_end(meta, "chat.completion.chunk"))


def _chat_parsed(st: AppState, req: Request, opts: Output, model: str, jobs: list[Job],
                 parsers: list[toolcalls.OutputParser]) -> Reply | Stream:
    """Chat answers each split by its own parser into reasoning_content, content and tool_calls."""
    meta = _oai_meta(st, opts, model, jobs[0].params)
    ts = serving.submit(st, jobs)
    if not opts.stream:
        def final(i: int, text: str, fin: Finished) -> dict[str, Any]:
            p = parsers[i]
            p.feed(text)
            p.finish()
            return responses.chat_final(meta, fin, p.final_content, reasoning=p.final_reasoning, calls=p.calls,
                                        index=i)
        return _merged(st, ts, req, final)

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

    return serving.streamed_answer(st, ts, req, fmt, done=True, end=_usage_end(meta, "chat.completion.chunk"))


def chat_input_tokens(st: AppState, req: Request) -> Reply:
    """POST /v1/chat/completions/input_tokens (and /chat/completions/input_tokens), as llama-server: the token
    count of the prompt /v1/chat/completions would evaluate for the same body (template, messages and tools)."""
    body = req.json()
    st.check_model(body)
    return json_reply({"input_tokens": prompt_tokens(st, body)})
