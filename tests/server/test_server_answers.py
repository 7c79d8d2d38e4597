"""Right answers for real clients: one BOS on chat templates that write `bos_token`, structured output as content
on thinking templates, the thinking budget (and Anthropic's `thinking`), any model name, strict tools.

The tiny models as made carry DeepSeek-R1's template (it writes `{{bos_token}}` and its generation prompt opens
`<think>`) on a vocabulary that adds BOS itself. References: stock llama-server of the pin where it is built
(prompt tokens, the budget's answers), else the same server's /apply-template and /tokenize, the unconstrained
greedy answer's own tokens (what a budget of N keeps), jsonschema and the SDKs' own parsing.
"""
# ruff: noqa: RUF001, RUF002 - DeepSeek's special tokens really are written with U+FF5C (fullwidth vertical bar)
from __future__ import annotations

import ctypes
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from server_proc import ServerProc, sse_json, stock_server_bin
from testkit import ROOT

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

pytestmark = pytest.mark.native

TEMPLATES = ROOT / "vendor" / "llama.cpp" / "models" / "templates"
# the templates the package writes (synthetic.CHAT_TEMPLATES), llama-server's ChatML fallback, and one a user
# gives with --chat-template-file that starts with `{{- bos_token }}` (Llama 3.1's)
CHAT_TEMPLATES = ["llama-cpp-deepseek-r1", "Qwen-Qwen3-0.6B", "chatml", "meta-llama-Llama-3.1-8B-Instruct"]
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is two plus two?"}]
GREEDY = {"temperature": 0}
DOUBLE_BOS = "starts with 2 BOS tokens"  # llama.cpp's check_double_bos_eos warning
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"type": "boolean"}}, "required": ["n", "ok"],
          "additionalProperties": False}


def template_args(name: str) -> list[str]:
    return ["--chat-template", "chatml"] if name == "chatml" else \
        ["--chat-template-file", str(TEMPLATES / f"{name}.jinja")]


def ok(s: ServerProc, path: str, body: dict[str, Any]) -> Any:
    status, r = s.request("POST", path, body)
    assert status == 200, r
    return r


def prompt_tokens(s: ServerProc, body: dict[str, Any]) -> list[int]:
    """The tokens a server evaluates for a chat body: its /apply-template prompt through its own /tokenize."""
    prompt = ok(s, "/apply-template", body)["prompt"]
    return list(ok(s, "/tokenize", {"content": prompt, "add_special": True})["tokens"])


# ---- one BOS ----

@pytest.fixture(scope="module", params=CHAT_TEMPLATES)
def templated(request: pytest.FixtureRequest, tiny_qwen: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ServerProc]]:
    s = ServerProc(tiny_qwen, "-c", "2048", "-t", "1", "--parallel", "1", *template_args(request.param),
                   log_path=tmp_path_factory.mktemp("answers") / f"{request.param}.log")
    yield request.param, s
    s.stop()


def test_one_bos_on_every_route(templated: tuple[str, ServerProc]) -> None:
    """The vocabulary adds BOS, so the template's own is dropped (llama.cpp's common/chat.cpp rule): the prompt
    starts with one BOS on every chat route and each route counts the same tokens; llama.cpp never warns."""
    _, s = templated
    toks = prompt_tokens(s, {"messages": MSGS})
    bos = ok(s, "/tokenize", {"content": "", "add_special": True})["tokens"]
    assert len(bos) == 1 and toks[0] == bos[0] and toks[1] != bos[0], toks[:4]
    n = len(toks)
    chat = ok(s, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, **GREEDY})
    assert chat["usage"]["prompt_tokens"] == n
    assert ok(s, "/v1/chat/completions/input_tokens", {"messages": MSGS})["input_tokens"] == n
    system, *turns = MSGS
    amsgs = {"model": "m", "system": system["content"], "messages": turns}
    assert ok(s, "/v1/messages/count_tokens", amsgs)["input_tokens"] == n
    u = ok(s, "/v1/messages", {**amsgs, "max_tokens": 1, **GREEDY})["usage"]  # split into cached and not
    assert u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] == n
    rbody = {"instructions": system["content"], "input": turns}
    assert ok(s, "/v1/responses/input_tokens", rbody)["input_tokens"] == n
    assert ok(s, "/v1/responses", {**rbody, "max_output_tokens": 1, **GREEDY})["usage"]["input_tokens"] == n
    assert DOUBLE_BOS not in s.log()


@pytest.mark.stock
def test_prompt_tokens_are_stocks(templated: tuple[str, ServerProc], tiny_qwen: Path, tmp_path: Path) -> None:
    """The same messages give the tokens stock llama-server evaluates, template by template."""
    name, ours = templated
    stock = ServerProc(tiny_qwen, "-m", str(tiny_qwen), "-c", "2048", "-t", "1", "-tb", "1", "--no-ui",
                       *template_args(name), cmd=[str(stock_server_bin() / "llama-server")],
                       log_path=tmp_path / "stock.log", ready_timeout=120)
    try:
        for msgs in (MSGS, MSGS[1:2]):
            body = {"messages": msgs}
            theirs = prompt_tokens(stock, body)
            assert prompt_tokens(ours, body) == theirs
            usage = ok(stock, "/v1/chat/completions", {**body, "max_tokens": 1, **GREEDY})["usage"]
            assert usage["prompt_tokens"] == len(theirs)
    finally:
        stock.stop()


# ---- structured output on thinking templates ----

@pytest.fixture(scope="module", params=["qwen3moe", "deepseek2"])
def thinking(request: pytest.FixtureRequest, make_tiny: Callable[..., Path],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """Each made architecture, its generation prompt opening `<think>`, with a thinking budget so that the
    random-weight model gets to the JSON."""
    s = ServerProc(make_tiny(request.param), "-c", "2048", "-t", "1", "--parallel", "1", "--reasoning-budget", "6",
                   log_path=tmp_path_factory.mktemp("answers") / f"think-{request.param}.log")
    yield s
    s.stop()


def oai(s: ServerProc) -> Any:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)


FORMATS = [{"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
           {"type": "json_object", "schema": SCHEMA}]


@pytest.mark.parametrize("fmt", FORMATS, ids=["json_schema", "json_object"])
def test_structured_output_is_the_content(thinking: ServerProc, fmt: dict[str, Any]) -> None:
    """The model may think first (reasoning_content), then the JSON is the content, whole and streamed."""
    c = oai(thinking)
    msgs = [{"role": "user", "content": "A digit and a truth value, please."}]
    r = c.chat.completions.create(model="m", messages=msgs, max_tokens=80, response_format=fmt, **GREEDY)
    msg = r.choices[0].message
    jsonschema.validate(json.loads(msg.content), SCHEMA)
    assert msg.model_extra.get("reasoning_content")  # it thought (the prompt opened <think>), within the budget
    chunks = list(c.chat.completions.create(model="m", messages=msgs, max_tokens=80, response_format=fmt,
                                            stream=True, **GREEDY))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == msg.content


def test_parse_and_responses_text_format(thinking: ServerProc) -> None:
    class Answer(pydantic.BaseModel):  # type: ignore[name-defined]
        n: int
        ok: bool

    c = oai(thinking)
    msgs = [{"role": "user", "content": "A digit and a truth value, please."}]
    parsed = c.chat.completions.parse(model="m", messages=msgs, max_tokens=80, response_format=Answer, **GREEDY)
    assert isinstance(parsed.choices[0].message.parsed, Answer)
    r = c.responses.create(model="m", input="A digit and a truth value, please.", max_output_tokens=80,
                           text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}, **GREEDY)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_reasoning_format_none_keeps_the_raw_answer(thinking: ServerProc) -> None:
    """`reasoning_format: none`: nothing is split and the JSON grammar holds from the first token, as before."""
    body = {"messages": [{"role": "user", "content": "A digit?"}], "max_tokens": 80, "reasoning_format": "none",
            "response_format": FORMATS[0], **GREEDY}
    msg = ok(thinking, "/v1/chat/completions", body)["choices"][0]["message"]
    assert "reasoning_content" not in msg
    jsonschema.validate(json.loads(msg["content"]), SCHEMA)


# ---- the thinking budget ----

@pytest.fixture(scope="module")
def r1(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = ServerProc(tiny_qwen, "-c", "2048", "-t", "1", "--parallel", "1",
                   log_path=tmp_path_factory.mktemp("answers") / "r1.log")
    yield s
    s.stop()


ASK = [{"role": "user", "content": "Tell me a story"}]


def unconstrained(s: ServerProc, n: int) -> list[int]:
    """The first n tokens the model writes after the chat prompt, greedy, nothing forced."""
    toks = prompt_tokens(s, {"messages": ASK})
    r = ok(s, "/completion", {"prompt": toks, "n_predict": n, "return_tokens": True, "ignore_eos": True, **GREEDY})
    return list(r["tokens"])


def text_of(s: ServerProc, toks: list[int]) -> str:
    return str(ok(s, "/detokenize", {"tokens": toks})["content"])


@pytest.mark.parametrize("n", [0, 1, 3, 7])
def test_budget_keeps_the_first_n_thinking_tokens(r1: ServerProc, n: int) -> None:
    """With a budget of N the thinking block holds N tokens: the prompt's own `<think>\\n` newline (one token,
    counted as llama.cpp counts it) and the first N - 1 tokens the model would have written; then the end tag is
    forced. Anthropic's `thinking.budget_tokens` N maps to the same budget (llama-server's server-chat.cpp) and
    `{"type": "disabled"}` to none."""
    assert ok(r1, "/apply-template", {"messages": ASK})["prompt"].endswith("<think>\n")
    want = text_of(r1, unconstrained(r1, max(n - 1, 0))).strip()
    msg = ok(r1, "/v1/chat/completions", {"messages": ASK, "max_tokens": n + 6, "thinking_budget_tokens": n,
                                          **GREEDY})["choices"][0]["message"]
    assert msg.get("reasoning_content", "") == want and msg["content"], msg
    same = ok(r1, "/v1/chat/completions", {"messages": ASK, "max_tokens": n + 6, "reasoning_budget_tokens": n,
                                           **GREEDY})["choices"][0]["message"]
    assert same == msg
    a = anthropic.Anthropic(base_url=r1.url, api_key="none", max_retries=0, timeout=120)
    m = a.messages.create(model="claude-sonnet-4-5", max_tokens=n + 6, messages=ASK,
                          thinking={"type": "enabled", "budget_tokens": n}, extra_body=GREEDY)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == \
        ([("thinking", want)] if want else []) + [("text", msg["content"])]
    off = a.messages.create(model="claude-sonnet-4-5", max_tokens=n + 6, messages=ASK,
                            thinking={"type": "disabled"}, extra_body=GREEDY)
    free = ok(r1, "/v1/chat/completions", {"messages": ASK, "max_tokens": n + 6, **GREEDY})["choices"][0]["message"]
    assert [b.thinking for b in off.content if b.type == "thinking"] == [free["reasoning_content"]]


def test_budget_message_comes_before_the_end(r1: ServerProc) -> None:
    msg = ok(r1, "/v1/chat/completions", {"messages": ASK, "max_tokens": 12, "reasoning_budget_tokens": 3,
                                          "reasoning_budget_message": " Enough thinking.", **GREEDY})
    want = text_of(r1, unconstrained(r1, 2))  # the prompt's newline and two of the model's
    assert msg["choices"][0]["message"]["reasoning_content"] == (want + " Enough thinking.").strip()


def _messages_blocks(r: dict[str, Any]) -> list[tuple[str, str]]:
    """A Messages answer's blocks, their text stripped (llama.cpp's parser keeps the whitespace around reasoning,
    ours strips it: docs/server.md)."""
    return [(b["type"], (b.get("thinking") if b["type"] == "thinking" else b.get("text", "")).strip())
            for b in r["content"]]


@pytest.mark.stock
def test_thinking_budget_is_stocks(tiny_qwen: Path, tmp_path: Path) -> None:
    """Anthropic's `thinking` and the chat route's budget answer what stock llama-server answers. Stock's budget
    looks for `<think>` among the tokens of the generation prompt: on this vocabulary the as-made template's
    `<｜Assistant｜><think>` tokenizes as `><` `think` `>`, which stock never matches (its budget then does
    nothing), so both servers get the template with a newline before `<think>`."""
    r1 = (TEMPLATES / "llama-cpp-deepseek-r1.jinja").read_text()
    assert "<｜Assistant｜><think>\\n" in r1
    template = tmp_path / "r1-newline.jinja"
    template.write_text(r1.replace("<｜Assistant｜><think>\\n", "<｜Assistant｜>\\n<think>\\n"))
    args = ["-c", "2048", "-t", "1", "--parallel", "1", "--chat-template-file", str(template)]
    stock_bin = stock_server_bin()  # skips where stock is not built: before ours starts, or ours would be left running
    started: list[ServerProc] = []
    try:
        ours = ServerProc(tiny_qwen, *args, log_path=tmp_path / "ours.log")
        started.append(ours)
        stock = ServerProc(tiny_qwen, "-m", str(tiny_qwen), *args, "-tb", "1", "--no-ui",
                           cmd=[str(stock_bin / "llama-server")], log_path=tmp_path / "stock.log",
                           ready_timeout=120)
        started.append(stock)
        for n in (1, 4):
            body = {"model": "m", "max_tokens": 10, "messages": ASK, "thinking": {"type": "enabled",
                                                                                 "budget_tokens": n}, **GREEDY}
            a, b = ok(ours, "/v1/messages", body), ok(stock, "/v1/messages", body)
            assert _messages_blocks(a) == _messages_blocks(b) and a["stop_reason"] == b["stop_reason"]
            body = {"messages": ASK, "max_tokens": 10, "thinking_budget_tokens": n, **GREEDY}
            a, b = (ok(x, "/v1/chat/completions", body)["choices"][0]["message"] for x in (ours, stock))
            assert (a.get("reasoning_content", ""), a["content"]) == \
                (b.get("reasoning_content", "").strip(), b["content"].strip())
    finally:
        for s in started:
            s.stop()


# ---- model names ----

def test_any_model_name_is_served(r1: ServerProc) -> None:
    """As llama-server with one model: the name a client sends is answered, whatever it is."""
    r = oai(r1).chat.completions.create(model="gpt-4o-mini", messages=ASK, max_tokens=1)
    assert r.model == "gpt-4o-mini"
    a = anthropic.Anthropic(base_url=r1.url, api_key="none", max_retries=0, timeout=120)
    assert a.messages.create(model="claude-sonnet-4-5", max_tokens=1, messages=ASK).model == "claude-sonnet-4-5"


def test_strict_model_names_the_flag(tiny_qwen: Path, tmp_path: Path) -> None:
    s = ServerProc(tiny_qwen, "-c", "1024", "-t", "1", "--alias", "tiny", "--strict-model", log_path=tmp_path / "s.log")
    try:
        assert ok(s, "/v1/chat/completions", {"model": "tiny", "messages": ASK, "max_tokens": 1})["model"] == "tiny"
        with pytest.raises(openai.NotFoundError) as e:
            oai(s).chat.completions.create(model="gpt-4o-mini", messages=ASK, max_tokens=1)
        assert "--strict-model" in e.value.message
    finally:
        s.stop()


# ---- strict tools ----

WEATHER: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def qwen3(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = ServerProc(tiny_qwen, "-c", "2048", "-t", "1", "--parallel", "1", *template_args("Qwen-Qwen3-0.6B"),
                   log_path=tmp_path_factory.mktemp("answers") / "qwen3.log")
    yield s
    s.stop()


def test_strict_tools_are_accepted_on_chat_and_responses(qwen3: ServerProc) -> None:
    """The OpenAI Agents SDK sends `strict: true` with every function tool: both routes take it (the grammar starts
    at the tool call's opener, see test_strict_grammar_starts_at_the_opener)."""
    c = oai(qwen3)
    r = c.chat.completions.create(model="m", messages=ASK, max_tokens=6, tools=[WEATHER], **GREEDY)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    fn = WEATHER["function"]
    out = c.responses.create(model="m", input="Weather in Paris?", max_output_tokens=6,
                             tools=[{"type": "function", **fn}], **GREEDY)
    assert out.status in ("completed", "incomplete")


def test_strict_tools_refused_where_no_grammar_can_start(tiny_qwen: Path, tmp_path: Path) -> None:
    """Llama 3.x writes a call as bare JSON: no opener for the grammar to start at, so `strict` is refused by name
    (a 400) instead of being answered unchecked."""
    s = ServerProc(tiny_qwen, "-c", "1024", "-t", "1", *template_args("meta-llama-Llama-3.1-8B-Instruct"),
                   log_path=tmp_path / "llama3.log")
    try:
        with pytest.raises(openai.BadRequestError) as e:
            oai(s).chat.completions.create(model="m", messages=ASK, max_tokens=2, tools=[WEATHER])
        assert "tools[0].function.strict" in e.value.message
        plain = {"type": "function", "function": {**WEATHER["function"], "strict": False}}
        assert oai(s).chat.completions.create(model="m", messages=ASK, max_tokens=2, tools=[plain]).choices
    finally:
        s.stop()


def test_strict_grammar_starts_at_the_opener(tiny_qwen: Path) -> None:
    """The slot's sampler on a real context, its logits written by hand: before the opener every token is the
    model's choice (no grammar); once `<tool_call>` is complete the tool's schema holds, so a number where the
    schema wants the city's string is not taken, and a city of more than 8 characters is cut at 8."""
    from rapidmoe import Llama  # noqa: PLC0415 - the compiled parts, only for this test
    from rapidmoe._runtime import llama_cpp as lc  # noqa: PLC0415
    from rapidmoe.server import toolcalls  # noqa: PLC0415
    from rapidmoe.server.params import SamplingParams  # noqa: PLC0415
    from rapidmoe.server.sampling import SlotSampler  # noqa: PLC0415
    from rapidmoe.server.trigger import TriggerSpec, TriggerWatch  # noqa: PLC0415

    llm = Llama(str(tiny_qwen), n_ctx=64, verbose=False)
    try:
        vocab = llm.vocab
        n_vocab = int(lc.llama_vocab_n_tokens(vocab))

        def tokenize(text: bytes) -> list[int]:
            return list(llm.tokenize(text, add_bos=False, special=True))

        def piece(tok: int) -> bytes:
            buf = ctypes.create_string_buffer(64)
            n = lc.llama_token_to_piece(vocab, tok, buf, 64, 0, True)
            return buf.raw[:n]

        llm.eval(tokenize(b"Hi"))
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        treq = toolcalls.tools_from({"tools": [WEATHER]}, (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text())
        assert treq is not None and treq.strict
        opener = b"<tool_call>"
        watch = TriggerWatch(TriggerSpec(opener, tuple(tokenize(opener))), piece, tokenize)
        smp = SlotSampler(SamplingParams(temperature=0.0), vocab, n_vocab, toolcalls.tool_grammar(treq, False),
                          trigger=watch)
        try:
            def step(want: bytes) -> bytes:
                """Sample with the model's logits pointing at `want`'s first token; the token taken's text."""
                logits[:] = 0.0
                logits[tokenize(want)[0]] = 50.0
                return piece(smp.sample(llm.ctx, -1))

            text = b""
            for part in (b"Sure", b".", *[piece(t) for t in tokenize(opener + b'\n{"name": "get_weather", '
                                                                   b'"arguments": {"city": ')]):
                got = step(part)
                assert got == part  # the model's own choice while the text fits (the grammar, once started)
                text += got
            assert smp.grammar is not None  # started at the opener
            assert step(b"123") == b'"'  # not a string: refused by the schema, which opens the city's string
            city = b""
            while b'"' not in city and len(city) < 40:
                city += step(b"Amsterdam-Rotterdam")  # the model wants "Am..." for ever; maxLength 8 closes it
            assert city.endswith(b'"') and len(city) == 9 and city.startswith(b"Am"), city
        finally:
            smp.free()
    finally:
        llm.close()


def test_streamed_thinking_budget(r1: ServerProc) -> None:
    """Streamed, the budget's answer arrives as reasoning deltas, then content deltas, the same as whole."""
    body = {"messages": ASK, "max_tokens": 9, "thinking_budget_tokens": 3, **GREEDY}
    whole = ok(r1, "/v1/chat/completions", body)["choices"][0]["message"]
    events = [e for e in sse_json(r1.stream("/v1/chat/completions", {**body, "stream": True})) if e != "[DONE]"]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == whole["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == whole["content"]
