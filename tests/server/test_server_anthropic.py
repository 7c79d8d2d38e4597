"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) with the official `anthropic` client
against a `serve` process: the tiny model carrying Qwen3's real chat template (Hermes tool calls, `<think>`) and,
as made, DeepSeek-R1's (its generation prompt opens `<think>`).

References, independent of the Messages code: the raw greedy text of `/completion` on the tokens of the prompt
`/apply-template` renders for the equivalent OpenAI messages (what the answer's blocks must split into),
`/tokenize` of that prompt (count_tokens and usage), the tools' JSON schemas (jsonschema) for forced calls, and
exact strings forced with a grammar for thinking/text/tool_use splitting.
"""
# ruff: noqa: RUF001 - DeepSeek's special tokens really are written with U+FF5C (fullwidth vertical bar)
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc
from testkit import ROOT

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

TEMPLATES = ROOT / "vendor" / "llama.cpp" / "models" / "templates"
WEATHER = {"name": "get_weather", "description": "Weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {
    "zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"]}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
OAI_TOOLS = [{"type": "function", "function": {"parameters" if k == "input_schema" else k: v for k, v in t.items()}}
             for t in TOOLS]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY_FIELDS = {"temperature": 0.0}
# This client's `messages.create` has no sampling arguments any more; the API's fields travel in extra_body
GREEDY: dict[str, Any] = {"extra_body": GREEDY_FIELDS}


def _with_template(model: Path, template: str, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(model), str(out),
                    "--chat-template", (TEMPLATES / template).read_text(), "--force"], check=True,
                   capture_output=True)
    return out


@pytest.fixture(scope="module")
def qwen3(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    d = tmp_path_factory.mktemp("anthropic")
    path = _with_template(tiny_qwen, "Qwen-Qwen3-0.6B.jinja", d / "qwen3.gguf")
    s = ServerProc(path, "--parallel", "2", "-c", "4096", "-t", "1", log_path=d / "qwen3.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def r1(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    d = tmp_path_factory.mktemp("anthropic")
    s = ServerProc(tiny_qwen, "--parallel", "2", "-c", "4096", "-t", "1", "--strict-model", log_path=d / "r1.log")
    yield s
    s.stop()


def client(s: ServerProc):  # type: ignore[no-untyped-def]
    return anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0, timeout=120)


def forced(text: str) -> dict[str, Any]:
    """Make the model write exactly `text` (then end): the llama.cpp `grammar` extension."""
    return {"grammar": "root ::= " + json.dumps(text, ensure_ascii=False)}


def prompt_tokens(s: ServerProc, oai_body: dict[str, Any]) -> list[int]:
    """The tokens of the prompt the chat template renders for an OpenAI chat body (the reference)."""
    status, r = s.request("POST", "/apply-template", oai_body)
    assert status == 200, r
    status, t = s.request("POST", "/tokenize", {"content": r["prompt"], "add_special": True})
    assert status == 200, t
    return list(t["tokens"])


def raw_greedy(s: ServerProc, toks: list[int], n: int, **extra: Any) -> str:
    status, r = s.request("POST", "/completion", {"prompt": toks, "n_predict": n, **GREEDY_FIELDS, **extra})
    assert status == 200, r
    return str(r["content"])


def blocks(msg: Any) -> list[tuple[str, Any]]:
    """(type, payload) of each content block, without the random tool_use ids."""
    out: list[tuple[str, Any]] = []
    for b in msg.content:
        out.append((b.type, b.thinking if b.type == "thinking" else b.text if b.type == "text" else
                    (b.name, b.input)))
    return out


# ---- bad input ----

def test_non_boolean_stream_is_refused_before_it_is_queued(qwen3: ServerProc) -> None:
    """`stream` that is not a boolean answers 400 on both routes mapped onto the chat path, and no generation runs
    for the request (the check came after queueing: a 1500-token answer then ran for nobody)."""
    for path, body in (("/v1/messages", {"model": "tiny", "max_tokens": 1500, "messages": MSGS, "stream": "yes"}),
                       ("/v1/responses", {"model": "tiny", "max_output_tokens": 1500, "input": "hi", "stream": 1})):
        status, r = qwen3.request("POST", path, body)
        assert status == 400 and "stream" in json.dumps(r), (path, r)
        status, slots = qwen3.request("GET", "/slots")
        assert status == 200 and not any(x["is_processing"] for x in slots), (path, slots)


# ---- plain answers ----

def test_messages_greedy_answer_and_usage(qwen3: ServerProc) -> None:
    system = "You are terse."
    ref_toks = prompt_tokens(qwen3, {"messages": [{"role": "system", "content": system}, *MSGS]})
    raw = raw_greedy(qwen3, ref_toks, 12)
    msg = client(qwen3).messages.create(model="tiny", max_tokens=12, system=system, messages=MSGS, **GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
    assert msg.id.startswith("msg_")
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    # Qwen3's template thinks: the answer goes through the chat route's parser (stripped; <think> split off)
    assert "<think>" not in raw
    assert blocks(msg) == ([("text", raw.strip())] if raw.strip() else [])
    u = msg.usage
    assert u.output_tokens == 12
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == len(ref_toks)
    # system as text blocks renders the same prompt (block texts joined by newlines, as chat content parts)
    msg2 = client(qwen3).messages.create(model="tiny", max_tokens=12, messages=MSGS, **GREEDY,
                                         system=[{"type": "text", "text": "You are"},
                                                 {"type": "text", "text": "terse.", "cache_control":
                                                  {"type": "ephemeral"}}])
    joined = prompt_tokens(qwen3, {"messages": [{"role": "system", "content": "You are\nterse."}, *MSGS]})
    assert msg2.usage.input_tokens + (msg2.usage.cache_read_input_tokens or 0) == len(joined)


def test_messages_stream_equals_whole(qwen3: ServerProc) -> None:
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 16, "messages": MSGS, **GREEDY}
    whole = client(qwen3).messages.create(**kw)
    with client(qwen3).messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert blocks(final) == blocks(whole)
    assert text == "".join(b.text for b in whole.content if b.type == "text")
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 16)
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == \
        whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


def test_stream_event_order(qwen3: ServerProc) -> None:
    """The raw SSE: `event:` lines naming each event, in Anthropic's order, every data's type its event's name."""
    import http.client  # noqa: PLC0415 - only this test reads the raw stream

    from rapidmoe.server import sse  # noqa: PLC0415

    conn = http.client.HTTPConnection("127.0.0.1", qwen3.port, timeout=60)
    body = {"model": "tiny", "max_tokens": 200, "messages": MSGS, "stream": True,
            **forced('<think>\nHmm.\n</think>\n\nFine.\n<tool_call>\n{"name": "get_time", "arguments": '
                     '{"zone": 2}}\n</tool_call>'), "tools": TOOLS}
    conn.request("POST", "/v1/messages", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type", "").startswith("text/event-stream")
    names, data = [], []
    for ev in sse.read_events(r):
        head, payload = ev.split(b"\n", 1)
        assert head.startswith(b"event: ") and payload.startswith(b"data: ")
        names.append(head[len(b"event: "):].decode())
        data.append(json.loads(payload[len(b"data: "):]))
        assert data[-1]["type"] == names[-1]
    conn.close()
    collapsed = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1] or n != "content_block_delta"]
    assert collapsed == ["message_start", "ping",
                         "content_block_start", "content_block_delta", "content_block_stop",  # thinking (+signature)
                         "content_block_start", "content_block_delta", "content_block_stop",  # text
                         "content_block_start", "content_block_delta", "content_block_stop",  # tool_use
                         "message_delta", "message_stop"]
    starts = [d for d in data if d["type"] == "content_block_start"]
    assert [(d["index"], d["content_block"]["type"]) for d in starts] == [(0, "thinking"), (1, "text"),
                                                                          (2, "tool_use")]
    deltas = [d["delta"] for d in data if d["type"] == "content_block_delta"]
    assert {"type": "signature_delta", "signature": ""} in deltas
    assert {"type": "input_json_delta", "partial_json": '{"zone": 2}'} in deltas
    end = next(d for d in data if d["type"] == "message_delta")
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert data[0]["message"]["content"] == [] and data[0]["message"]["stop_reason"] is None


def test_stop_sequences(qwen3: ServerProc) -> None:
    toks = prompt_tokens(qwen3, {"messages": MSGS})
    raw = raw_greedy(qwen3, toks, 24)
    cut = raw.strip()[6:9]
    assert len(cut) == 3 and cut.strip() == cut, raw  # three characters of the greedy answer, no edge whitespace
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 24, "messages": MSGS, "stop_sequences": [cut], **GREEDY}
    want = raw[:raw.find(cut)].strip()
    for stream in (False, True):
        if stream:
            with client(qwen3).messages.stream(**kw) as s:
                msg = s.get_final_message()
        else:
            msg = client(qwen3).messages.create(**kw)
        assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", cut)
        assert blocks(msg) == ([("text", want)] if want else [])


# ---- thinking, text and tool_use blocks ----

QWEN_ANSWER = ('<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n'
               '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>')
QWEN_BLOCKS = [("thinking", "The user wants the weather."), ("text", "Let me check."),
               ("tool_use", ("get_weather", {"city": "Paris", "unit": "c"})), ("tool_use", ("get_time", {"zone": 1}))]


def test_thinking_text_and_tool_use_blocks(qwen3: ServerProc) -> None:
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 200, "messages": MSGS, "tools": TOOLS,
                          "extra_body": forced(QWEN_ANSWER)}
    msg = client(qwen3).messages.create(**kw)
    assert blocks(msg) == QWEN_BLOCKS and msg.stop_reason == "tool_use"
    ids = [b.id for b in msg.content if b.type == "tool_use"]
    assert len(set(ids)) == 2 and all(i.startswith("toolu_") for i in ids)
    assert msg.content[0].signature == ""
    with client(qwen3).messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert blocks(final) == QWEN_BLOCKS and final.stop_reason == "tool_use"
    # without tools the tool-call text stays text; the thinking still goes to its block
    plain = client(qwen3).messages.create(model="tiny", max_tokens=200, messages=MSGS,
                                          extra_body=forced("<think>\nTwo plus two.\n</think>\n\nIt is 4."))
    assert blocks(plain) == [("thinking", "Two plus two."), ("text", "It is 4.")]
    assert plain.stop_reason == "end_turn"


def test_r1_open_think_is_a_thinking_block(r1: ServerProc) -> None:
    answer = ("I need the weather tool.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
              "<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Rome\", \"unit\": \"f\"}\n```<｜tool▁call▁end｜>"
              "<｜tool▁calls▁end｜>")
    kw: dict[str, Any] = {"model": r1.request("GET", "/v1/models")[1]["data"][0]["id"], "max_tokens": 300,
                          "messages": MSGS, "tools": TOOLS, "extra_body": forced(answer)}
    want = [("thinking", "I need the weather tool."), ("tool_use", ("get_weather", {"city": "Rome", "unit": "f"}))]
    assert blocks(client(r1).messages.create(**kw)) == want
    with client(r1).messages.stream(**kw) as stream:
        assert blocks(stream.get_final_message()) == want


@pytest.mark.parametrize("server", ["qwen3", "r1"])
def test_tool_choice_any_and_tool_follow_the_schemas(server: str, request: pytest.FixtureRequest) -> None:
    s: ServerProc = request.getfixturevalue(server)
    model = s.request("GET", "/v1/models")[1]["data"][0]["id"]
    c = client(s)
    for seed in range(2):
        msg = c.messages.create(model=model, max_tokens=300, messages=MSGS, tools=TOOLS, tool_choice={"type": "any"},
                                extra_body={"temperature": 1.0, "seed": seed})
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and uses
        for b in uses:
            jsonschema.validate(b.input, SCHEMAS[b.name])
    named = {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}
    with c.messages.stream(model=model, max_tokens=300, messages=MSGS, tools=TOOLS, tool_choice=named,
                           extra_body={"temperature": 1.0, "seed": 7}) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and [b.name for b in uses] == ["get_time"]
    jsonschema.validate(uses[0].input, SCHEMAS["get_time"])


# ---- history with tool_use / tool_result / thinking, and count_tokens ----

HISTORY: list[dict[str, Any]] = [
    *MSGS,
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 degrees"}]},
        {"type": "text", "text": "And tomorrow?"}]},
]
OAI_HISTORY = [
    *MSGS,
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "18 degrees"},
    {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
]


def test_count_tokens_equals_the_rendered_prompt(qwen3: ServerProc) -> None:
    oai = {"messages": [{"role": "system", "content": "Be brief."}, *OAI_HISTORY], "tools": OAI_TOOLS}
    status, r = qwen3.request("POST", "/apply-template", oai)
    assert status == 200, r
    assert "<tool_response>\n18 degrees\n</tool_response>" in r["prompt"] and "get_time" in r["prompt"]
    ref = prompt_tokens(qwen3, oai)
    n = client(qwen3).messages.count_tokens(model="tiny", system="Be brief.", messages=HISTORY, tools=TOOLS)
    assert n.input_tokens == len(ref)
    msg = client(qwen3).messages.create(model="tiny", max_tokens=4, system="Be brief.", messages=HISTORY,
                                        tools=TOOLS, **GREEDY)
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == len(ref)
    # asked twice, the second answer reads the prompt from the slot's cache
    again = client(qwen3).messages.create(model="tiny", max_tokens=4, system="Be brief.", messages=HISTORY,
                                          tools=TOOLS, **GREEDY)
    assert (again.usage.cache_read_input_tokens or 0) > 0
    assert again.usage.input_tokens + (again.usage.cache_read_input_tokens or 0) == len(ref)
    assert blocks(again) == blocks(msg)
    # a tool_result with is_error: the tool message reads "Error: ..." (templates have no error flag)
    failed: list[dict[str, Any]] = [*HISTORY[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "City not found", "is_error": True}]}]
    oai_failed = [*OAI_HISTORY[:2], {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: City not found"}]
    n = client(qwen3).messages.count_tokens(model="tiny", messages=failed, tools=TOOLS)
    assert n.input_tokens == len(prompt_tokens(qwen3, {"messages": oai_failed, "tools": OAI_TOOLS}))
    # that assistant turn follows the last user query, so Qwen3's template renders its thinking block
    unthought = [failed[0], {**failed[1], "content": failed[1]["content"][1:]}, failed[2]]
    assert n.input_tokens > client(qwen3).messages.count_tokens(model="tiny", messages=unthought,
                                                                tools=TOOLS).input_tokens
    plain = client(qwen3).messages.count_tokens(model="tiny", messages=MSGS)
    assert plain.input_tokens == len(prompt_tokens(qwen3, {"messages": MSGS}))


# ---- refusals ----

IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
REFUSED = [
    ({"container": "c1"}, "\"container\""),
    ({"thinking": {"type": "adaptive"}}, "\"thinking.type\": \"adaptive\""),
    ({"thinking": {"type": "enabled", "budget_tokens": -1}}, "\"thinking.budget_tokens\""),
    ({"service_tier": "auto"}, "\"service_tier\""),
    ({"frequency_penalty": 0.5}, "\"frequency_penalty\""),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, "messages[0].content[0].type\": \"image\""),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages[0].name"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [*MSGS, {"role": "assistant", "content": "The weather is"}]},
     "messages[1].role\": \"assistant\" is not"),
    ({"messages": [*MSGS, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]},
     "messages[1].content[0].type\": \"redacted_thinking\""),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "citations": [{"x": 1}]}]}]},
     "messages[0].content[0].citations"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type\": \"web_search_20250305\""),
    ({"tools": [{**TIME, "strict": True}]}, "tools[0].strict"),
    ({"tools": TOOLS, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
     "tool_choice.disable_parallel_tool_use"),
    ({"system": [IMAGE]}, "system[0].type\": \"image\""),
    ({"max_tokens": None}, "\"max_tokens\" is required"),
    ({"max_tokens": 0}, "\"max_tokens\" must be"),
    ({"temperature": 1.5}, "\"temperature\""),
    ({"stop_sequences": "END"}, "\"stop_sequences\""),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
]


@pytest.mark.parametrize("extra,needle", REFUSED, ids=[r[1][:40] for r in REFUSED])
def test_refused_with_anthropic_error(qwen3: ServerProc, extra: dict[str, Any], needle: str) -> None:
    body = {"model": "tiny", "max_tokens": 4, "messages": MSGS, **extra}
    status, r = qwen3.request("POST", "/v1/messages", body)
    assert status == 400, r
    assert r["type"] == "error" and r["error"]["type"] == "invalid_request_error", r
    assert set(r) == {"type", "error"} and set(r["error"]) == {"type", "message"}
    assert needle in r["error"]["message"], r


def test_metadata_is_accepted(qwen3: ServerProc) -> None:
    """Claude Code sends metadata.user_id with every request: it identifies the user and changes nothing."""
    with_meta = client(qwen3).messages.create(model="tiny", max_tokens=3, messages=MSGS, metadata={"user_id": "u"},
                                              extra_body={"temperature": 0.0})
    plain = client(qwen3).messages.create(model="tiny", max_tokens=3, messages=MSGS, extra_body={"temperature": 0.0})
    assert with_meta.content == plain.content and with_meta.usage.output_tokens == plain.usage.output_tokens


def test_refusals_through_the_client(qwen3: ServerProc) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        client(qwen3).messages.create(model="tiny", max_tokens=4, messages=MSGS, service_tier="auto")
    assert "\"service_tier\"" in e.value.message and e.value.body["error"]["type"] == "invalid_request_error"
    # `thinking` changes how the answer is sampled, not the prompt: the count is the same with it
    counted = client(qwen3).messages.count_tokens(model="tiny", messages=MSGS,
                                                  thinking={"type": "enabled", "budget_tokens": 2048})
    assert counted.input_tokens == client(qwen3).messages.count_tokens(model="tiny", messages=MSGS).input_tokens
    status, r = qwen3.request("POST", "/v1/messages/count_tokens", {"model": "tiny", "messages": MSGS,
                                                                    "max_tokens": 3})
    assert status == 400 and "\"max_tokens\"" in r["error"]["message"]  # not a count_tokens field


def test_http_layer_errors_in_anthropic_shape(qwen3: ServerProc, r1: ServerProc) -> None:
    status, r = qwen3.request("GET", "/v1/messages")
    assert status == 405 and r["type"] == "error" and r["error"]["type"] == "invalid_request_error", r
    status, r = qwen3.request("POST", "/v1/messages", raw=b"{not json")
    assert status == 400 and r["type"] == "error", r
    with pytest.raises(anthropic.NotFoundError) as e:  # r1 runs with --strict-model
        client(r1).messages.create(model="no-such-model", max_tokens=4, messages=MSGS)
    assert e.value.body["error"]["type"] == "not_found_error"
    status, r = qwen3.request("POST", "/v1/messages", {"model": "tiny", "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "word " * 3000}]})
    assert status == 400 and r["type"] == "error" and "context" in r["error"]["message"], r


def test_api_key_as_x_api_key(tiny_qwen: Path, tmp_path: Path) -> None:
    """The client sends its key as `x-api-key`; a wrong one is a 401 in Anthropic's shape."""
    s = ServerProc(tiny_qwen, "-t", "1", "-c", "1024", "--api-key", "sekret", log_path=tmp_path / "key.log")
    try:
        good = anthropic.Anthropic(base_url=s.url, api_key="sekret", max_retries=0, timeout=60)
        model = s.request("GET", "/v1/models", headers={"X-Api-Key": "sekret"})[1]["data"][0]["id"]
        assert good.messages.count_tokens(model=model, messages=MSGS).input_tokens > 0
        bad = anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model=model, max_tokens=2, messages=MSGS)
        assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                           "message": "Invalid API Key"}}
    finally:
        s.stop()
