"""Tool calls and reasoning with the `openai` SDK, on the tiny model carrying the real chat templates of Qwen3
(Hermes `<tool_call>`) and DeepSeek-R1 (llama.cpp's R1 template with tool calls, which the tiny model, like the
default model, carries as made: its tokenizer is DeepSeek's). The tiny model's own text is
random, so the answers whose parsing is checked are forced to exact strings with a grammar; `tool_choice`
"required" and named tools are enforced by the server's own grammar and checked against the tools' schemas.
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
from testkit import GREEDY, ROOT

from rapidmoe.server.toolcalls import OutputParser
from rapidmoe.synthetic import spec_for, write_model

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

TEMPLATES = ROOT / "vendor" / "llama.cpp" / "models" / "templates"
WEATHER: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def _with_template(model: Path, template: str, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(model), str(out),
                    "--chat-template", (TEMPLATES / template).read_text(), "--force"], check=True,
                   capture_output=True)
    return out


@pytest.fixture(scope="module")
def qwen3(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    d = tmp_path_factory.mktemp("tools")
    path = _with_template(tiny_qwen, "Qwen-Qwen3-0.6B.jinja", d / "qwen3.gguf")
    s = ServerProc(path, "--parallel", "2", "-c", "4096", "-t", "1", log_path=d / "qwen3.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def r1(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """The tiny model as make-model writes it (the default model's spec): tools and reasoning out of the box."""
    d = tmp_path_factory.mktemp("tools")
    s = ServerProc(tiny_qwen, "--parallel", "2", "-c", "4096", "-t", "1", log_path=d / "r1.log")
    yield s
    s.stop()


def client(s: ServerProc):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)


def forced(text: str) -> dict[str, Any]:
    """Make the model write exactly `text` (then end)."""
    return {"grammar": "root ::= " + json.dumps(text, ensure_ascii=False)}


def _stream(s: ServerProc, **kw: Any) -> tuple[str, str, list[dict[str, Any]], str]:
    """(reasoning, content, tool calls accumulated from the deltas, finish_reason) of a streamed answer."""
    reasoning, content, finish = "", "", ""
    calls: dict[int, dict[str, Any]] = {}
    for ch in client(s).chat.completions.create(model="x", stream=True, **kw):
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


# ---- Qwen3 / Hermes ----

QWEN_ANSWER = ('<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n'
               '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>')


def test_qwen3_template_renders_tools_and_tool_results(qwen3: ServerProc) -> None:
    history = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    status, r = qwen3.request("POST", "/apply-template", {"messages": history, "tools": TOOLS})
    assert status == 200, r
    p = r["prompt"]
    assert "<tools>" in p and '"name": "get_weather"' in p and '"name": "get_time"' in p
    assert "<tool_response>\n18 degrees\n</tool_response>" in p and p.endswith("<|im_start|>assistant\n")
    r2 = client(qwen3).chat.completions.create(model="x", messages=history, tools=TOOLS, max_tokens=4, **GREEDY)
    assert r2.usage.prompt_tokens > 50


def test_qwen3_auto_parses_reasoning_content_and_calls(qwen3: ServerProc) -> None:
    kw = {"messages": MSGS, "tools": TOOLS, "max_tokens": 200, "extra_body": forced(QWEN_ANSWER)}
    r = client(qwen3).chat.completions.create(model="x", **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.model_extra["reasoning_content"] == "The user wants the weather."
    assert msg.content == "Let me check."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
    assert got == [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"zone": 1})]
    assert len({c.id for c in msg.tool_calls}) == 2 and all(c.type == "function" for c in msg.tool_calls)
    reasoning, content, calls, finish = _stream(qwen3, **kw)
    assert (reasoning, content, finish) == ("The user wants the weather.", "Let me check.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == got


def test_qwen3_reasoning_without_tools_and_reasoning_format_none(qwen3: ServerProc) -> None:
    answer = "<think>\nTwo plus two.\n</think>\n\nIt is 4."
    kw = {"messages": MSGS, "max_tokens": 100, "extra_body": forced(answer)}
    msg = client(qwen3).chat.completions.create(model="x", **kw).choices[0].message
    assert msg.model_extra["reasoning_content"] == "Two plus two." and msg.content == "It is 4."
    assert _stream(qwen3, **kw)[:2] == ("Two plus two.", "It is 4.")
    raw = client(qwen3).chat.completions.create(
        model="x", messages=MSGS, max_tokens=100, extra_body={**forced(answer), "reasoning_format": "none"})
    assert raw.choices[0].message.content == answer and "reasoning_content" not in (raw.choices[0].message.model_extra
                                                                                   or {})


def test_qwen3_tool_choice_none_leaves_the_text(qwen3: ServerProc) -> None:
    text = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call>'
    r = client(qwen3).chat.completions.create(model="x", messages=MSGS, tools=TOOLS, tool_choice="none",
                                              max_tokens=100, extra_body=forced(text))
    assert r.choices[0].message.content == text and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_qwen3_required_and_named_follow_the_schemas(qwen3: ServerProc) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        r = client(qwen3).chat.completions.create(model="x", messages=MSGS, tools=TOOLS, tool_choice="required",
                                                  max_tokens=300, temperature=1.0, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    named = {"type": "function", "function": {"name": "get_time"}}
    for stream in (False, True):
        if stream:
            _, _, calls_s, finish = _stream(qwen3, messages=MSGS, tools=TOOLS, tool_choice=named, max_tokens=300,
                                            parallel_tool_calls=False, temperature=1.0, seed=5)
            got = [(c["name"], c["arguments"]) for c in calls_s]
        else:
            r = client(qwen3).chat.completions.create(model="x", messages=MSGS, tools=TOOLS, tool_choice=named,
                                                      max_tokens=300, parallel_tool_calls=False, temperature=1.0,
                                                      seed=5)
            got = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
            finish = r.choices[0].finish_reason
        assert finish == "tool_calls" and len(got) == 1 and got[0][0] == "get_time"
        jsonschema.validate(json.loads(got[0][1]), schemas["get_time"])


BAD_TOOLS = [
    ({"tool_choice": "required"}, 400, "needs \"tools\""),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "'nope'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, 400, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array", "uniqueItems": True}}}], "tool_choice": "required"}, 400, "uniqueItems"),
    ({"tools": TOOLS, "tool_choice": "required", "grammar": "root ::= \"a\""}, 400, "Cannot use custom grammar"),
]


@pytest.mark.parametrize("extra,status,msg", BAD_TOOLS, ids=[b[2][:20] for b in BAD_TOOLS])
def test_bad_tools_are_refused(qwen3: ServerProc, extra: dict, status: int, msg: str) -> None:
    got, r = qwen3.request("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, **extra})
    assert got == status and msg in r["error"]["message"], r


def test_tools_need_a_template_that_writes_them(vocab_dir: Path, tmp_path: Path) -> None:
    plain = write_model(spec_for("qwen3moe", "tiny", chat_template="none"), tmp_path / "plain.gguf", vocab_dir)
    s = ServerProc(plain, "-t", "1", "-c", "1024", log_path=tmp_path / "plain.log")
    try:
        status, r = s.request("POST", "/v1/chat/completions", {"messages": MSGS, "tools": TOOLS, "max_tokens": 2})
        assert status == 400 and '"tools"' in r["error"]["message"], r
        status, r = s.request("POST", "/v1/chat/completions", {"messages": MSGS, "tools": TOOLS, "max_tokens": 2,
                                                               "tool_choice": "none"})
        assert status == 200 and r["choices"][0]["finish_reason"] == "length", r  # rendered, nothing parsed
    finally:
        s.stop()


# ---- DeepSeek-R1 ----

R1_ANSWER = ("I need the weather tool.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
             "get_weather\n```json\n{\"city\": \"Rome\", \"unit\": \"f\"}\n```<｜tool▁call▁end｜>"
             "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{\"zone\": -3}\n```<｜tool▁call▁end｜>"
             "<｜tool▁calls▁end｜>")


def test_r1_prompt_opens_think_and_answer_is_parsed(r1: ServerProc) -> None:
    _, r = r1.request("POST", "/apply-template", {"messages": MSGS, "tools": TOOLS})
    assert r["prompt"].endswith("<｜Assistant｜><think>\n") and "get_weather" in r["prompt"]
    kw = {"messages": MSGS, "tools": TOOLS, "max_tokens": 300, "extra_body": forced(R1_ANSWER)}
    res = client(r1).chat.completions.create(model="x", **kw)
    msg = res.choices[0].message
    assert msg.model_extra["reasoning_content"] == "I need the weather tool." and not msg.content
    got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
    assert got == [("get_weather", {"city": "Rome", "unit": "f"}), ("get_time", {"zone": -3})]
    reasoning, content, calls, finish = _stream(r1, **kw)
    assert (reasoning, content, finish) == ("I need the weather tool.", "", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == got


def test_r1_required_tool_call_follows_the_schema(r1: ServerProc) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    r = client(r1).chat.completions.create(model="x", messages=MSGS, tools=TOOLS, tool_choice="required",
                                           max_tokens=300, temperature=1.0, seed=2)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls
    assert msg.model_extra.get("reasoning_content", "") == ""  # the server's grammar closed the open think
    for c in msg.tool_calls:
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


# ---- the parser on exact strings, fed in every possible split ----

@pytest.mark.parametrize("family,text,starts,expect", [
    ("hermes", QWEN_ANSWER, False, ("The user wants the weather.", "Let me check.",
                                    ["get_weather", "get_time"])),
    ("hermes", "Plain answer <tool_ca", False, ("", "Plain answer <tool_ca", [])),
    ("hermes", "<think>unfinished thought", False, ("unfinished thought", "", [])),
    ("hermes", 'A\n<tool_call>\n{"name": "f", "arguments": {}}', False, ("", "A", ["f"])),  # unclosed at EOS
    ("hermes", "<tool_call>\nnot json\n</tool_call>", False, ("", "<tool_call>\nnot json\n</tool_call>", [])),
    ("deepseek-r1", R1_ANSWER, True, ("I need the weather tool.", "", ["get_weather", "get_time"])),
    ("deepseek-v3.1", "Ok.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"zone\": 3}"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", False, ("", "Ok.", ["get_time"])),
])
def test_output_parser_streaming_equals_whole(family: str, text: str, starts: bool,
                                              expect: tuple[str, str, list[str]]) -> None:
    def run(pieces: list[str]) -> tuple[str, str, list[str]]:
        p = OutputParser(family=family, parse_tools=True, reasoning=True, starts_in_thinking=starts)
        reasoning, content, names = "", "", list[str]()
        for piece in pieces:
            d = p.feed(piece)
            reasoning, content, names = reasoning + d.reasoning, content + d.content, names + [c.name for _, c in
                                                                                                d.calls]
        d = p.finish()
        reasoning, content, names = reasoning + d.reasoning, content + d.content, names + [c.name for _, c in d.calls]
        assert (p.final_reasoning, p.final_content, [c.name for c in p.calls]) == (reasoning, content, names)
        return reasoning, content, names

    assert run([text]) == expect
    assert run(list(text)) == expect  # one character at a time
    for cut in range(1, len(text), 7):
        assert run([text[:cut], text[cut:]]) == expect
