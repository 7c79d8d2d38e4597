"""OpenAI's Responses API (`/v1/responses`) with the official `openai` client against a `serve` process: the tiny
model carrying Qwen3's real chat template (Hermes tool calls, `<think>`).

References, independent of the Responses code: the raw greedy text of `/completion` on the tokens of the prompt
`/apply-template` renders for the equivalent chat messages, `/tokenize` of that prompt (usage), the tools' JSON
schemas (jsonschema) for forced calls, and exact strings forced with a grammar for reasoning/message/function_call
splitting.
"""
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

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

TEMPLATES = ROOT / "vendor" / "llama.cpp" / "models" / "templates"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"]}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
OAI_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
QUESTION = "What is the weather in Paris?"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def qwen3(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    d = tmp_path_factory.mktemp("responses")
    path = d / "qwen3.gguf"
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(tiny_qwen), str(path),
                    "--chat-template", (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(), "--force"], check=True,
                   capture_output=True)
    s = ServerProc(path, "--parallel", "2", "-c", "4096", "-t", "1", log_path=d / "qwen3.log")
    yield s
    s.stop()


def client(s: ServerProc):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)


def forced(text: str) -> dict[str, Any]:
    return {"grammar": "root ::= " + json.dumps(text, ensure_ascii=False)}


def prompt_tokens(s: ServerProc, oai_body: dict[str, Any]) -> list[int]:
    status, r = s.request("POST", "/apply-template", oai_body)
    assert status == 200, r
    status, t = s.request("POST", "/tokenize", {"content": r["prompt"], "add_special": True})
    assert status == 200, t
    return list(t["tokens"])


def items(resp: Any) -> list[tuple[str, Any]]:
    """(type, payload) of each output item, without the random ids."""
    out: list[tuple[str, Any]] = []
    for it in resp.output:
        if it.type == "reasoning":
            out.append(("reasoning", "".join(c.text for c in it.content)))
        elif it.type == "message":
            out.append(("message", "".join(c.text for c in it.content)))
        else:
            out.append((it.type, (it.name, json.loads(it.arguments))))
    return out


def test_plain_answer_and_usage(qwen3: ServerProc) -> None:
    toks = prompt_tokens(qwen3, {"messages": [{"role": "system", "content": "Be terse."},
                                              {"role": "user", "content": QUESTION}]})
    status, ref = qwen3.request("POST", "/completion", {"prompt": toks, "n_predict": 12, **GREEDY})
    assert status == 200, ref
    r = client(qwen3).responses.create(model="tiny", input=QUESTION, instructions="Be terse.", max_output_tokens=12,
                                       **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    raw = ref["content"]
    assert "<think>" not in raw
    assert items(r) == ([("message", raw.strip())] if raw.strip() else [])
    assert r.output_text == raw.strip()
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(toks), 12)
    assert r.usage.total_tokens == len(toks) + 12
    # the same conversation as items
    r2 = client(qwen3).responses.create(model="tiny", max_output_tokens=12, **GREEDY, input=[
        {"role": "system", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert items(r2) == items(r) and r2.usage.input_tokens == len(toks)


def test_stream_events_and_accumulation(qwen3: ServerProc) -> None:
    kw: dict[str, Any] = {"model": "tiny", "input": QUESTION, "max_output_tokens": 16, **GREEDY}
    whole = client(qwen3).responses.create(**kw)
    events = list(client(qwen3).responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    if text:
        done = [e for e in events if e.type == "response.output_text.done"]
        assert len(done) == 1 and done[0].text == text
    final = events[-1].response
    assert items(final) == items(whole) and final.usage.output_tokens == 16
    with client(qwen3).responses.stream(**kw) as stream:  # the client's accumulating helper (its final response
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")  # needs "completed")
    assert deltas == text


FORCED = ('<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n'
          '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n'
          '{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>')
FORCED_ITEMS = [("reasoning", "The user wants the weather."), ("message", "Let me check."),
                ("function_call", ("get_weather", {"city": "Paris", "unit": "c"})),
                ("function_call", ("get_time", {"zone": 1}))]


def test_reasoning_message_and_function_calls(qwen3: ServerProc) -> None:
    kw: dict[str, Any] = {"model": "tiny", "input": QUESTION, "tools": TOOLS, "max_output_tokens": 200,
                          "extra_body": forced(FORCED)}
    r = client(qwen3).responses.create(**kw)
    assert r.status == "completed" and items(r) == FORCED_ITEMS
    calls = [it for it in r.output if it.type == "function_call"]
    assert len({c.call_id for c in calls}) == 2 and all(c.id.startswith("fc_") for c in calls)
    events = list(client(qwen3).responses.create(stream=True, **kw))
    assert events[-1].type == "response.completed" and items(events[-1].response) == FORCED_ITEMS
    args = [(e.name, e.arguments) for e in events if e.type == "response.function_call_arguments.done"]
    assert [(n, json.loads(a)) for n, a in args] == [p for t, p in FORCED_ITEMS if t == "function_call"]
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == "The user wants the weather."
    with client(qwen3).responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert items(final) == FORCED_ITEMS


def test_required_and_named_tools_follow_the_schemas(qwen3: ServerProc) -> None:
    c = client(qwen3)
    for seed in range(2):
        r = c.responses.create(model="tiny", input=QUESTION, tools=TOOLS, tool_choice="required",
                               max_output_tokens=300, temperature=1.0, extra_body={"seed": seed})
        calls = [it for it in r.output if it.type == "function_call"]
        assert r.status == "completed" and calls
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    strict_time = {**TIME, "strict": True}
    events = list(c.responses.create(model="tiny", input=QUESTION, tools=[WEATHER, strict_time], stream=True,
                                     tool_choice={"type": "function", "name": "get_time"}, parallel_tool_calls=False,
                                     max_output_tokens=300, temperature=1.0, extra_body={"seed": 3}))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [d.name for d in done] == ["get_time"]
    jsonschema.validate(json.loads(done[0].arguments), SCHEMAS["get_time"])


def test_tool_history_renders_as_chat(qwen3: ServerProc) -> None:
    """function_call / function_call_output / reasoning items replayed in `input` render the prompt the chat route
    renders for the same conversation."""
    history = [
        {"role": "user", "content": QUESTION},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris", "unit": "c"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    chat = [{"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "Use the tool.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
            {"role": "user", "content": "And tomorrow?"}]
    toks = prompt_tokens(qwen3, {"messages": chat, "tools": OAI_TOOLS})
    r = client(qwen3).responses.create(model="tiny", input=history, tools=TOOLS, max_output_tokens=2, **GREEDY)
    assert r.usage.input_tokens == len(toks)
    n = client(qwen3).responses.input_tokens.count(model="tiny", input=history, tools=TOOLS)
    assert (n.object, n.input_tokens) == ("response.input_tokens", len(toks))
    status, err = qwen3.request("POST", "/v1/responses/input_tokens", {"input": history, "max_output_tokens": 2})
    assert status == 400 and "\"max_output_tokens\"" in err["error"]["message"], err  # not a count field


REFUSED = [
    ({"previous_response_id": "resp_1"}, "\"previous_response_id\""),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "\"reasoning.summary\""),
    ({"prompt_cache_key": "k"}, "\"prompt_cache_key\""),
    ({"store": True}, "\"store\""),
    ({"truncation": "auto"}, "\"truncation\""),
    ({"include": ["reasoning.encrypted_content"]}, "\"include\""),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type\": \"web_search\""),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type\": \"input_image\""),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type\": \"item_reference\""),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "abc"}]}, "input[0].encrypted_content"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice.type\": \"allowed_tools\""),
    ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text.verbosity"),
    ({"max_output_tokens": 0}, "\"max_output_tokens\""),
    ({"input": None}, "\"input\" is required"),
]


@pytest.mark.parametrize("extra,needle", REFUSED, ids=[r[1][:40] for r in REFUSED])
def test_refused_by_name(qwen3: ServerProc, extra: dict[str, Any], needle: str) -> None:
    body = {"model": "tiny", "input": QUESTION, "max_output_tokens": 4, **extra}
    if body["input"] is None:
        del body["input"]
    status, r = qwen3.request("POST", "/v1/responses", body)
    assert status == 400 and r["error"]["type"] == "invalid_request_error", r
    assert needle in r["error"]["message"], r


def test_refusal_through_the_client(qwen3: ServerProc) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(qwen3).responses.create(model="tiny", input=QUESTION, previous_response_id="resp_x")
    assert "previous_response_id" in str(e.value)


def test_json_schema_text_format(qwen3: ServerProc) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = client(qwen3).responses.create(model="tiny", input="A number?", max_output_tokens=60, temperature=1.0,
                                       extra_body={"seed": 1, "chat_template_kwargs": {"enable_thinking": False}},
                                       text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
