"""Our tool-call parsing and prompts against stock llama.cpp's, on the chat templates of Llama 3.3, Firefunction v2,
Command-R7B, Functionary v3.1 and Qwen3: the answers of common/chat's parser (tests/server/data/stock_toolcalls.json,
written by tools/stock_chat_parse.py from the stock build of the pin) for a set of model answers, each fed to our
parser whole and in pieces. Where stock's parser fails an answer that does not fit the format, ours answers it as
content. Ours strips the whitespace around reasoning and content, which stock keeps.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc, sse_json
from testkit import ROOT

from rapidmoe.server.chat import ChatTemplate
from rapidmoe.server.toolcalls import OutputParser, template_family, template_thinks, template_tools, think_tags

TEMPLATES = ROOT / "vendor" / "llama.cpp" / "models" / "templates"
STOCK = json.loads((ROOT / "tests" / "server" / "data" / "stock_toolcalls.json").read_text())
CASES = [(t["template"], c["answer"], c["stock"]) for t in STOCK for c in t["cases"]]
FAMILY = {"meta-llama-Llama-3.3-70B-Instruct": "llama3", "fireworks-ai-llama-3-firefunction-v2": "firefunction",
          "CohereForAI-c4ai-command-r7b-12-2024-tool_use": "command-r7b", "Qwen-Qwen3-0.6B": "hermes",
          "meetkai-functionary-medium-v3.1": "functionary-v3.1"}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}}]


def _parse(source: str, pieces: list[str]) -> tuple[str, str, list[tuple[str, Any, str]]]:
    """(reasoning, content, [(name, arguments, id)]) of the pieces fed in turn; what the deltas carry equals the
    final answer."""
    p = OutputParser(family=template_family(source), parse_tools=True, reasoning=template_thinks(source),
                     starts_in_thinking=False, think=think_tags(source))
    reasoning = content = ""
    for d in [*(p.feed(x) for x in pieces), p.finish()]:
        reasoning, content = reasoning + d.reasoning, content + d.content
    assert (reasoning, content) == (p.final_reasoning, p.final_content)
    return reasoning, content, [(c.name, json.loads(c.arguments), c.id) for c in p.calls]


@pytest.mark.parametrize("template", list(FAMILY))
def test_family_is_recognized(template: str) -> None:
    assert template_family((TEMPLATES / f"{template}.jinja").read_text()) == FAMILY[template]


@pytest.mark.parametrize("template,answer,stock", CASES, ids=[f"{t[:12]}-{i}" for i, (t, _, _) in enumerate(CASES)])
def test_answers_parse_as_stock_parses_them(template: str, answer: str, stock: dict[str, Any]) -> None:
    source = (TEMPLATES / f"{template}.jinja").read_text()
    if "error" in stock:  # stock fails the request; ours answers the text
        want: tuple[str, str, list[tuple[str, Any, str]]] = ("", answer.strip(), [])
    else:
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]), c.get("id"))
                 for c in stock.get("tool_calls", [])]
        want = (stock.get("reasoning_content", "").strip(), stock["content"].strip(), calls)
    for pieces in ([answer], list(answer), [answer[:len(answer) // 2], answer[len(answer) // 2:]]):
        got = _parse(source, pieces)
        ids = [w[2] for w in want[2]]
        # stock answers the model's own call id (Command-R7B's tool_call_id) or none, which the server makes up
        assert (got[0], got[1], [g[:2] for g in got[2]]) == (want[0], want[1], [w[:2] for w in want[2]])
        assert [g[2] for g, i in zip(got[2], ids, strict=True) if i] == [i for i in ids if i]


@pytest.mark.parametrize("entry", STOCK, ids=[t["template"][:24] for t in STOCK])
def test_prompts_are_stocks(entry: dict[str, Any]) -> None:
    """The prompt with the tools is the one llama-server renders (the date as llama.cpp gives it)."""
    t = ChatTemplate((TEMPLATES / f"{entry['template']}.jinja").read_text(), "<s>", "</s>")
    now = datetime.now()
    got = t.render([{"role": "user", "content": "What is the weather in Paris?"}], {}, template_tools(TOOLS))
    got = got.replace(now.strftime("%b %d %Y"), "<DATETIME>").replace(now.strftime("%d %b %Y"), "<DATE_STRING>")
    assert got == entry["prompt"]


# ---- through the server: the tiny model given each template (--chat-template-file), its answers forced ----

FORCED = {  # template -> (answer, reasoning, content, calls)
    "meta-llama-Llama-3.3-70B-Instruct": ('Let me look. {"name": "get_time", "parameters": {"zone": 2}}', "",
                                          "Let me look.", [("get_time", {"zone": 2})]),
    "fireworks-ai-llama-3-firefunction-v2": (' functools[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                                             '{"name": "get_time", "arguments": {"zone": 1}}]', "", "",
                                             [("get_weather", {"city": "Rome"}), ("get_time", {"zone": 1})]),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": (
        '<|START_THINKING|>Weather.<|END_THINKING|><|START_ACTION|>[{"tool_call_id": "0", "tool_name": '
        '"get_weather", "parameters": {"city": "Oslo"}}]<|END_ACTION|>', "Weather.", "",
        [("get_weather", {"city": "Oslo"})]),
    "meetkai-functionary-medium-v3.1": ('Checking. <function=get_time>{"zone": 4}</function>', "", "Checking.",
                                        [("get_time", {"zone": 4})]),
}


@pytest.fixture(scope="module", params=list(FORCED))
def served(request: pytest.FixtureRequest, tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, ServerProc]]:
    d = tmp_path_factory.mktemp("formats")
    s = ServerProc(tiny_qwen, "--chat-template-file", str(TEMPLATES / f"{request.param}.jinja"), "-c", "4096", "-t",
                   "1", log_path=d / "server.log")
    yield request.param, s
    s.stop()


def _chat(s: ServerProc, stream: bool, **body: Any) -> tuple[str, str, list[tuple[str, Any]], str]:
    """(reasoning, content, [(name, arguments)], finish_reason) of a chat answer, streamed or whole."""
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": TOOLS,
            "max_tokens": 200, **body}
    if not stream:
        status, r = s.request("POST", "/v1/chat/completions", body)
        assert status == 200, r
        m = r["choices"][0]["message"]
        return (m.get("reasoning_content", ""), m["content"] or "", [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls", [])],
            r["choices"][0]["finish_reason"])
    reasoning = content = finish = ""
    calls: dict[int, list[str]] = {}
    for ev in sse_json(s.stream("/v1/chat/completions", {**body, "stream": True})):
        for ch in ev.get("choices", []) if isinstance(ev, dict) else []:
            delta = ch.get("delta", {})
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls", []):
                slot = calls.setdefault(tc["index"], ["", ""])
                slot[0] += tc["function"].get("name") or ""
                slot[1] += tc["function"].get("arguments") or ""
            finish = ch.get("finish_reason") or finish
    return reasoning, content, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))], finish


@pytest.mark.parametrize("stream", [False, True])
def test_forced_answers_are_parsed(served: tuple[str, ServerProc], stream: bool) -> None:
    template, s = served
    answer, reasoning, content, calls = FORCED[template]
    got = _chat(s, stream, grammar="root ::= " + json.dumps(answer, ensure_ascii=False))
    assert got == (reasoning, content, calls, "tool_calls")


def test_required_and_named_follow_the_format(served: tuple[str, ServerProc]) -> None:
    """The server's grammar for tool_choice "required" / a named tool writes the family's format, which the parser
    reads back."""
    _, s = served
    bounded = json.loads(json.dumps(TOOLS))
    bounded[0]["function"]["parameters"]["properties"]["city"]["maxLength"] = 12  # random text ends in time
    bounded[1]["function"]["parameters"]["properties"]["zone"].update(minimum=-12, maximum=12)
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "get_time"}}]):
        _, _, calls, finish = _chat(s, False, tools=bounded, tool_choice=choice, temperature=1.0, seed=seed,
                                    max_tokens=400, parallel_tool_calls=False)  # random text would go on calling
        assert finish == "tool_calls" and calls, calls
        assert all(isinstance(args, dict) for _, args in calls)
        assert len(calls) == 1
        if isinstance(choice, dict):
            assert calls[0][0] == "get_time"


def test_apply_template_without_tools(served: tuple[str, ServerProc]) -> None:
    """Firefunction v2's template adds the undefined `functions` to its system prompt: as in llama.cpp, nothing."""
    template, s = served
    status, r = s.request("POST", "/apply-template", {"messages": [{"role": "user", "content": "What is today?"}]})
    assert status == 200, r
    if "llama" in template.lower():  # the Llama 3.x templates print today's date
        assert datetime.now().strftime("%b %d %Y" if "firefunction" in template else "%d %b %Y") in r["prompt"]
