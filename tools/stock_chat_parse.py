#!/usr/bin/env python3
"""Stock llama.cpp's answers for tool-call parsing, the reference of tests/server/test_toolcall_formats.py.

Builds tools/stock_chat_parse.cpp against the stock libraries of the pin (build/stock/, tools/stock_llama.py:
libllama-common there holds common/chat's template code and output parsers), then, for each chat template and answer
text in CASES, asks it for the prompt llama-server renders and the message its parser makes of the answer (or its
error), and writes them to tests/server/data/stock_toolcalls.json (today's date in a prompt written as <DATETIME> or
<DATE_STRING>, the names of llama.cpp's template variables). Usage: python tools/stock_chat_parse.py
"""
from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "vendor" / "llama.cpp" / "models" / "templates"
OUT = ROOT / "tests" / "server" / "data" / "stock_toolcalls.json"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}}
PARIS, ROME = '{"city": "Paris"}', '{"city": "Rome"}'
L3, FF = "meta-llama-Llama-3.3-70B-Instruct", "fireworks-ai-llama-3-firefunction-v2"
CR = "CohereForAI-c4ai-command-r7b-12-2024-tool_use"
CASES: dict[str, list[str]] = {
    L3: ["It is sunny.", f'{{"name": "get_weather", "parameters": {PARIS}}}',
         f'{{"type": "function", "name": "get_weather", "parameters": {PARIS}}}',
         f'Let me look. {{"name": "get_weather", "parameters": {PARIS}}}',
         '  {"name":"get_time","parameters":{"zone": 2}}\n',
         f'{{"name": "get_weather", "parameters": {PARIS}}} ok',
         f'{{"name": "get_weather", "arguments": {PARIS}}}', "a {brace} here",
         f'{{"name": "get_weather", "parameters": {PARIS}}}\n{{"name": "get_weather", "parameters": {ROME}}}'],
    FF: ["It is sunny.", f' functools[{{"name": "get_weather", "arguments": {PARIS}}}]',
         f'functools[{{"name": "get_weather", "arguments": {PARIS}}}, {{"name": "get_time", "arguments": '
         f'{{"zone": -3}}}}]', f'Sure functools[{{"name": "get_weather", "arguments": {PARIS}}}]',
         f'functools[{{"name": "get_weather", "arguments": {PARIS}}}] then', "functools are nice"],
    CR: ["<|START_RESPONSE|>It is sunny.<|END_RESPONSE|>",
         "<|START_THINKING|>The user asks.<|END_THINKING|><|START_RESPONSE|>It is sunny.<|END_RESPONSE|>",
         f'<|START_THINKING|>Weather tool.<|END_THINKING|><|START_ACTION|>[\n    {{"tool_call_id": "0", '
         f'"tool_name": "get_weather", "parameters": {PARIS}}}\n]<|END_ACTION|>',
         f'<|START_ACTION|>[{{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {PARIS}}}, '
         f'{{"tool_call_id": "1", "tool_name": "get_time", "parameters": {{"zone": 1}}}}]<|END_ACTION|>',
         f'<|START_ACTION|>[{{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {PARIS}}}]',
         "It is sunny."],
    "meetkai-functionary-medium-v3.1": [
        "It is sunny.", f'<function=get_weather>{PARIS}</function>', f'Sure <function=get_weather>{PARIS}</function>',
        f'<function=get_weather>{PARIS}</function>\n<function=get_time>{{"zone": 3}}</function>',
        f'<function=get_weather>{PARIS}</function> after', f'<function=get_weather>{PARIS}'],
    "Qwen-Qwen3-0.6B": ["It is sunny.", "<think>\nHm.\n</think>\n\nIt is sunny.",
                        f'<think>\nHm.\n</think>\n\nLet me check.\n<tool_call>\n{{"name": "get_weather", '
                        f'"arguments": {PARIS}}}\n</tool_call>'],
}


def build() -> Path:
    sys.path.insert(0, str(ROOT / "tools"))
    from stock_llama import build_stock  # noqa: PLC0415  (after the sys.path change)

    lib = build_stock(["llama-common"])
    src = ROOT / "build" / "stock" / "src" / "llama.cpp"
    exe = ROOT / "build" / "stock" / "stock_chat_parse"
    cpp = ROOT / "tools" / "stock_chat_parse.cpp"
    if not exe.exists() or exe.stat().st_mtime < cpp.stat().st_mtime:
        subprocess.run(["g++", "-std=c++17", "-O1", *(f"-I{src / d}" for d in ("common", "include", "ggml/include",
                                                                                 "vendor")),
                        str(cpp), f"-L{lib}", "-lllama-common", "-lllama", "-lggml", "-lggml-base",
                        f"-Wl,-rpath,{lib}", "-o", str(exe)], check=True)
    return exe


def main() -> int:
    exe = build()
    out = []
    for name, answers in CASES.items():
        req = {"template": (TEMPLATES / f"{name}.jinja").read_text(), "tools": [WEATHER, TIME],
               "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "outputs": answers}
        got = json.loads(subprocess.run([str(exe)], input=json.dumps(req), capture_output=True, text=True,
                                        check=True).stdout)
        now = datetime.now()
        prompt = got["prompt"].replace(now.strftime("%b %d %Y"), "<DATETIME>").replace(now.strftime("%d %b %Y"),
                                                                                        "<DATE_STRING>")
        out.append({"template": name, "format": got["format"], "generation_prompt": got["generation_prompt"],
                    "prompt": prompt, "cases": [{"answer": a, "stock": p}
                                                       for a, p in zip(answers, got["parsed"], strict=True)]})
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
