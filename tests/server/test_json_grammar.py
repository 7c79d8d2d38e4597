"""The JSON grammars the server builds (json_schema, response_format, tool calls) keep raw control characters out of
strings, as llama.cpp's own converter does: llama-cpp-python's port allowed any character but '"' and '\\', and a
sampled U+0002 made a Llama 3 tool call invalid JSON, answered as content with finish_reason "stop"
(test_toolcall_formats' required/named test on that template, with flash attention on, failed so)."""
from __future__ import annotations

import json
import re

from testkit import ROOT

from rapidmoe.server.structured import JSON_CHAR, schema_to_grammar
from rapidmoe.server.toolcalls import tool_grammar, tools_from

TEMPLATES = ROOT / "vendor" / "llama.cpp" / "models" / "templates"
STOCK_CONVERTER = ROOT / "vendor" / "llama.cpp" / "common" / "json-schema-to-grammar.cpp"


def _stock_char_rule() -> str:
    """llama.cpp's `char` primitive, read from its C++ source (a string literal: its escapes undone)."""
    m = re.search(r'\{"char",\s*\{"((?:[^"\\]|\\.)*)"', STOCK_CONVERTER.read_text())
    assert m, "llama.cpp's converter no longer defines a char primitive this way"
    return str(json.loads(f'"{m.group(1)}"'))  # the literal's escapes are JSON's too


def test_char_rule_excludes_what_llama_cpp_excludes() -> None:
    first_alt = _stock_char_rule().split(" | ")[0]
    assert first_alt == JSON_CHAR.content.split(" | ")[0] == r'[^"\\\x7F\x00-\x1F]'


def test_schema_and_tool_grammars_use_it() -> None:
    g = schema_to_grammar({"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}}}, "json_schema")
    assert f"char ::= {JSON_CHAR.content}" in g.splitlines()
    template = (TEMPLATES / "meta-llama-Llama-3.3-70B-Instruct.jinja").read_text()
    req = tools_from({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}}}],
        "tool_choice": "required"}, template)
    assert req is not None
    assert f"char ::= {JSON_CHAR.content}" in tool_grammar(req, False).splitlines()
