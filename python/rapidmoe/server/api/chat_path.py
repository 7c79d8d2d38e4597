"""The chat path: a chat body -> the chat template's prompt, its tokens and generation parameters (tool grammar,
thinking budget) -> the answer split into reasoning, content and tool calls. Shared by /v1/chat/completions
(openai.py) and the routes mapped onto it (Anthropic Messages, OpenAI Responses), so templating, sampling and tool
parsing have one implementation.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import toolcalls
from ..chat import check_messages
from ..engine import Chunk, Event, Finished
from ..errors import ApiError, invalid_request
from ..params import GenerationParams, get_bool, get_int, get_str, refused
from ..reasoning import BudgetSpec, think_first
from ..structured import check_grammar
from ..trigger import TriggerSpec
from .serving import (
    AppState,
    Reply,
    Request,
    Stream,
    gen_params,
    jobs_for,
    streamed_answer,
    submit,
    tokenize_text,
    whole_answer,
)


def chat_prompt(st: AppState, body: dict[str, Any],
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


def prompt_tokens(st: AppState, body: dict[str, Any]) -> int:
    """How many tokens the prompt of this chat body has (the template's rendering of its messages and tools,
    tokenized as the chat route does): the routes' input-token counts."""
    prompt, _ = chat_prompt(st, body)
    return len(tokenize_text(st, prompt, add_special=True))


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


def chat_setup(st: AppState, body: dict[str, Any]) -> ChatSetup:
    """Render, tokenize and read the generation parameters of an OpenAI chat body (messages, tools, sampling)."""
    assert st.template is not None and st.engine is not None
    prompt, treq = chat_prompt(st, body)
    toks = tokenize_text(st, prompt, add_special=True)
    thinks = st.template.jinja and toolcalls.template_thinks(st.template.source)
    tags = toolcalls.think_tags(st.template.source)
    open_think = st.template.jinja and prompt.rstrip().endswith(tags[0])
    # no reasoning split without Jinja: llama-server's legacy path parses the whole answer as content
    reasoning = thinks and get_str(body, "reasoning_format", st.config.reasoning_format) != "none"
    # a JSON answer may think first, unless the prompt closed the thinking block already (thinking switched off:
    # Qwen3's `<think>\n\n</think>`), as llama.cpp's grammar, fed the generation prompt, allows
    closed = prompt.rstrip().endswith(tags[1])
    think = ((lambda rule, g: think_first(rule, g, tags, open_think)) if reasoning and not closed else None)
    params = gen_params(st, body, route="chat", think=think)
    if treq is not None and treq.choice in ("required", "named"):
        if params.grammar is not None:
            raise invalid_request("Cannot use custom grammar constraints with tool_choice required or a named tool")
        g = toolcalls.tool_grammar(treq, open_think)
        check_grammar(st.engine.llm.vocab, g, "tools")
        params = dataclasses.replace(params, grammar=g)
    elif treq is not None and treq.strict:
        if params.grammar is not None:
            raise invalid_request("Cannot use custom grammar constraints with strict tools")
        trigger = _strict_trigger(st, treq, tags[1] if open_think else "")
        g = toolcalls.tool_grammar(treq, open_think)
        check_grammar(st.engine.llm.vocab, g, "tools")
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
    toks = tokenize_text(st, opener, add_special=False) if opener else []
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
    start, end = (tokenize_text(st, t, add_special=False) for t in tags)
    forced = (tokenize_text(st, message, add_special=False) if message else []) + end
    tail = prompt[prompt.rindex(tags[0]) + len(tags[0]):] if open_think else ""
    spent = len(tokenize_text(st, tail, add_special=False)) if tail else 0
    return BudgetSpec(n, tuple(start), (tuple(end),), tuple(forced), counting=open_think, spent=spent)


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


def one_answer(st: AppState, req: Request, chat: dict[str, Any], cs: ChatSetup, *,
               whole: Callable[[toolcalls.Delta, Finished], dict[str, Any]],
               start: Callable[[Chunk | Finished], list[bytes]], add: Callable[[toolcalls.Delta], list[bytes]],
               end: Callable[[Finished], list[bytes]], error_event: Callable[[ApiError], bytes]) -> Reply | Stream:
    """The one answer of a route mapped onto the chat path (Anthropic Messages, OpenAI Responses), parsed as the
    chat route parses it (_answer_deltas). Whole: `whole(the answer's delta, Finished)`. Streamed (`stream` in the
    mapped body): `start(the first event)`, `add(delta)` for each piece, `end(Finished)` after the last; an error
    after the first event as `error_event`."""
    feed = _answer_deltas(cs)
    stream = get_bool(chat, "stream", False)  # a bad value is a 400 before anything is queued
    ts = submit(st, jobs_for([(cs.toks, cs.prompt)], cs.params, 1))
    if not stream:
        def final(got: list[tuple[str, Finished]]) -> dict[str, Any]:
            text, fin = got[0]
            return whole(feed(text, True), fin)
        return whole_answer(st, ts, req, final)

    def fmt(i: int, ev: Event, first: bool) -> list[bytes]:
        assert isinstance(ev, (Chunk, Finished))
        out = start(ev) if first else []
        out += add(feed(ev.text, isinstance(ev, Finished)))
        if isinstance(ev, Finished):
            out += end(ev)
        return out

    return streamed_answer(st, ts, req, fmt, done=False, error_event=error_event)
