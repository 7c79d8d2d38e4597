"""Tool calls and reasoning in chat answers, for the model families this project targets.

- `hermes` (Qwen3, Qwen2.5): calls as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- `deepseek-r1` (DeepSeek-R1/V3 and llama.cpp's R1 template): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
  <｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`;
- `deepseek-v3.1`: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...`;
- `llama3` (Llama 3.1-3.3): the answer is `{"name": NAME, "parameters": ARGS}`, after any content;
- `firefunction` (Firefunction v2): `functools[{"name": NAME, "arguments": ARGS}, ...]`, after any content;
- `command-r7b`: `<|START_ACTION|>[{"tool_call_id": ID, "tool_name": NAME, "parameters": ARGS}, ...]<|END_ACTION|>`,
  content inside `<|START_RESPONSE|>...<|END_RESPONSE|>`, reasoning inside `<|START_THINKING|>...<|END_THINKING|>`;
- `functionary-v3.1`: `<function=NAME>ARGS</function>...`, after any content.

The family is recognized from the chat template's text (the template renders `tools` itself); the formats are the
ones llama.cpp's common/chat parser reads for these templates (tests/server/data/stock_toolcalls.json holds its
answers). Where stock's parser fails an answer that does not fit the format, ours answers it as content. Reasoning:
`<think>...</think>` (Command-R7B: its thinking markers) at the start of the answer (or an answer that starts inside
it because the generation prompt ended with `<think>`) goes to `reasoning_content` (llama-server's
`reasoning_format` "auto"/"deepseek").
`tool_choice` "required" or a named function is enforced with a GBNF grammar built from the tools' parameter
schemas. `OutputParser` splits the text as it streams: it sends reasoning and content as soon as they cannot be
the start of a tag, and each tool call whole once its block has closed.
"""
# ruff: noqa: RUF001, RUF002 - DeepSeek's tool-call markers really are written with U+FF5C and U+2581
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from .errors import ApiError, invalid_request
from .text import partial_stop_len

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CR_THINK_OPEN, CR_THINK_CLOSE = "<|START_THINKING|>", "<|END_THINKING|>"
CR_ACTION_OPEN, CR_ACTION_CLOSE = "<|START_ACTION|>", "<|END_ACTION|>"
CR_RESPONSE_OPEN, CR_RESPONSE_CLOSE = "<|START_RESPONSE|>", "<|END_RESPONSE|>"
FIRE_OPEN = "functools["
FN_OPEN, FN_CLOSE = "<function=", "</function>"
FUNCTIONARY_HINT = "start with <function= and end with </function>"  # Functionary v3.1's tool instructions
LLAMA3_HINT = '"parameters": dictionary of argument name and its value'  # Llama 3.1-3.3's tool instructions
OPENERS = {"hermes": HERMES_OPEN, "deepseek-r1": DS_CALLS_BEGIN, "deepseek-v3.1": DS_CALLS_BEGIN,
           "firefunction": FIRE_OPEN, "command-r7b": CR_ACTION_OPEN, "functionary-v3.1": FN_OPEN}

_DS_R1_CALL = re.compile(re.escape(DS_CALL_BEGIN) + r"\s*(?:function)?\s*" + re.escape(DS_SEP)
                         + r"(?P<name>[^\n]+?)\s*\n```(?:json)?\s*(?P<args>.*?)\s*```\s*" + re.escape(DS_CALL_END),
                         re.DOTALL)
_DS_V31_CALL = re.compile(re.escape(DS_CALL_BEGIN) + r"(?P<name>[^<\n]+?)" + re.escape(DS_SEP)
                          + r"(?P<args>.*?)" + re.escape(DS_CALL_END), re.DOTALL)


def template_family(template: str) -> str | None:
    """The tool-call format a chat template writes, or None if it renders no tool calls we can parse."""
    if HERMES_OPEN in template:
        return "hermes"
    if DS_CALLS_BEGIN in template:
        if re.search(re.escape(DS_CALL_BEGIN) + r"'\s*\+\s*tool\['function'\]\['name'\]", template):
            return "deepseek-v3.1"
        return "deepseek-r1"
    if CR_ACTION_OPEN in template and CR_RESPONSE_OPEN in template:
        return "command-r7b"
    if " functools[" in template:
        return "firefunction"
    if FUNCTIONARY_HINT in template:
        return "functionary-v3.1"
    if LLAMA3_HINT in template:
        return "llama3"
    return None


def template_thinks(template: str) -> bool:
    return THINK_CLOSE in template or THINK_OPEN in template or CR_THINK_OPEN in template


def think_tags(template: str) -> tuple[str, str]:
    """The markers around the template's reasoning: Command-R7B's, else `<think>`."""
    return (CR_THINK_OPEN, CR_THINK_CLOSE) if CR_THINK_OPEN in template else (THINK_OPEN, THINK_CLOSE)


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    strict: bool = False  # OpenAI's `strict`: the arguments must follow `parameters` exactly (the grammar enforces it)


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools as this server handles them."""

    family: str  # "" when the template's format is unknown (only tool_choice "none" then)
    tools: tuple[Tool, ...]
    choice: str  # "auto" | "none" | "required" | "named"
    named: str | None = None
    parallel: bool = True

    @property
    def parse(self) -> bool:
        return self.choice != "none"

    @property
    def strict(self) -> bool:
        """Some tool asks for `strict` arguments; with "auto" a lazy grammar, started by the family's opener,
        enforces them (tool_grammar)."""
        return self.choice == "auto" and any(t.strict for t in self.tools)


def tools_from(body: dict[str, Any], template: str) -> ToolRequest | None:
    """Validate `tools`, `tool_choice` and `parallel_tool_calls` (OpenAI's shapes); None without tools."""
    tools_v = body.get("tools")
    choice_v = body.get("tool_choice")
    if tools_v is None or tools_v == []:
        if choice_v not in (None, "none", "auto"):
            raise invalid_request("\"tool_choice\" needs \"tools\"")
        return None
    if not isinstance(tools_v, list):
        raise invalid_request("\"tools\" must be an array")
    family = template_family(template)
    if family is None and choice_v != "none":  # with "none" the template renders the tools, nothing is parsed
        raise invalid_request("\"tools\" is not supported with this model's chat template "
                              "(tool calls are parsed for Qwen3/Hermes, DeepSeek-R1/V3, Llama 3.x, Firefunction v2, "
                              "Command-R7B and Functionary v3.1 templates; tool_choice \"none\" works with any "
                              "template)")
    tools: list[Tool] = []
    for i, t in enumerate(tools_v):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise invalid_request(f"\"tools[{i}]\" must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise invalid_request(f"\"tools[{i}].function.name\" must be 1-64 letters, digits, '_', '.' or '-'")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise invalid_request(f"\"tools[{i}].function.parameters\" must be a JSON schema object")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid_request(f"\"tools[{i}].function.strict\" must be a boolean")
        tools.append(Tool(name, params, bool(strict)))
    if len({t.name for t in tools}) != len(tools):
        raise invalid_request("\"tools\" has two functions with the same name")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid_request("\"parallel_tool_calls\" must be a boolean")
    named = None
    if choice_v is None or choice_v == "auto":
        choice = "auto"
    elif choice_v in ("none", "required"):
        choice = choice_v
    elif isinstance(choice_v, dict) and isinstance(choice_v.get("function"), dict):
        choice, named = "named", choice_v["function"].get("name")
        if named not in {t.name for t in tools}:
            raise invalid_request(f"\"tool_choice\" names {named!r}, which is not in \"tools\"")
    else:
        raise invalid_request("\"tool_choice\" must be \"auto\", \"none\", \"required\" or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    return ToolRequest(family or "", tuple(tools), choice, named, parallel)


def template_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The (validated) tools as llama-server gives them to the template: each function's name, description ("" when
    absent) and parameters ({} when absent), nothing else."""
    out = []
    for t in tools:
        fn = t["function"]
        out.append({"type": "function", "function": {"name": fn["name"], "description": fn.get("description", ""),
                                                     "parameters": fn.get("parameters", {})}})
    return out


def _literal(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def tool_grammar(req: ToolRequest, open_think: bool) -> str:
    """GBNF that admits only tool calls in the family's format (one, or several with parallel_tool_calls), each
    with arguments valid for its tool's parameter schema; for "required" any tool, for "named" that one.
    `open_think`: the prompt left a `<think>` open, so the answer first closes it (empty). For "auto" with a
    `strict` tool: the calls from the family's opener on (the grammar starts there, `strict_trigger`), a strict
    tool's arguments by its schema, another's any JSON object."""
    from .structured import schema_converter  # noqa: PLC0415  (structured loads the compiled part on import)

    tools = [t for t in req.tools if req.choice != "named" or t.name == req.named]
    if req.choice == "auto":
        tools = [t if t.strict else Tool(t.name, {"type": "object"}) for t in tools]
        open_think = False  # the reasoning comes before the opener, outside the grammar
    conv = schema_converter()
    try:
        alts = [_tool_alternative(conv, req.family, i, t) for i, t in enumerate(tools)]
    except ApiError:
        raise
    except Exception as e:  # noqa: BLE001 - the converter asserts on schemas it cannot convert
        raise invalid_request(f"\"tools\": cannot make a grammar from the parameters: {e}") from None
    one = "tool-call"

    rules = [f"{one} ::= " + " | ".join(f"( {a} )" for a in alts)]
    calls = _calls_rule(req.family, one, req.parallel)
    prefix = f"{_literal(THINK_CLOSE + chr(10) + chr(10))} " if open_think else ""
    rules.insert(0, f"root ::= {prefix}{calls}")
    return "\n".join(rules) + "\n" + str(conv.format_grammar())


def strict_trigger(family: str) -> str:
    """The text at which the grammar of strict tools under tool_choice "auto" starts (trigger.py): the family's
    tool-call opener, with which tool_grammar's calls begin; "" for Llama 3.x, whose calls are bare JSON."""
    return OPENERS.get(family, "")


def _calls_rule(family: str, one: str, parallel: bool) -> str:
    """The grammar sequence of the answer's calls (rule `one` is a single call) in the family's format."""
    if family == "hermes":
        return f"{one} ( \"\\n\" {one} )*" if parallel else one
    if family == "llama3":  # one call: llama.cpp's parser reads no more for Llama 3.x
        return one
    if family == "functionary-v3.1":
        return f"{one} {one}*" if parallel else one
    more = f" ( \", \" {one} )*" if parallel else ""
    if family == "firefunction":
        return f"{_literal(FIRE_OPEN)} {one}{more} \"]\""
    if family == "command-r7b":
        return f"{_literal(CR_ACTION_OPEN + '[')} {one}{more} {_literal(']' + CR_ACTION_CLOSE)}"
    return f"{_literal(DS_CALLS_BEGIN)} {one} {one}* {_literal(DS_CALLS_END)}" if parallel else \
        f"{_literal(DS_CALLS_BEGIN)} {one} {_literal(DS_CALLS_END)}"


def _json_call_schema(family: str, t: Tool) -> dict[str, Any] | None:
    """The JSON object of one call, for the families that write calls as JSON objects."""
    props: dict[str, Any]
    if family == "hermes":
        props = {"name": {"const": t.name}, "arguments": t.parameters}
    elif family == "llama3":
        props = {"name": {"const": t.name}, "parameters": t.parameters}
    elif family == "firefunction":
        props = {"name": {"const": t.name}, "arguments": t.parameters}
    elif family == "command-r7b":
        props = {"tool_call_id": {"type": "string", "pattern": "^[0-9]{1,3}$"}, "tool_name": {"const": t.name},
                 "parameters": t.parameters}
    else:
        return None
    return {"type": "object", "properties": props, "required": list(props)}


def _tool_alternative(conv: Any, family: str, i: int, t: Tool) -> str:
    """One tool's call in the family's format, as a grammar sequence (rules added to `conv`)."""
    nl = "\n"
    schema = _json_call_schema(family, t)
    if schema is not None:
        call = conv.visit_checked(schema, f"call-{i}")
        return f"{_literal(HERMES_OPEN + nl)} {call} {_literal(nl + HERMES_CLOSE)}" if family == "hermes" else call
    args = conv.visit_checked(t.parameters, f"args-{i}")
    if family == "functionary-v3.1":
        return f"{_literal(FN_OPEN + t.name + '>')} {args} {_literal(FN_CLOSE)}"
    if family == "deepseek-r1":
        head = DS_CALL_BEGIN + "function" + DS_SEP + t.name + nl + "```json" + nl
        return f"{_literal(head)} {args} {_literal(nl + '```' + DS_CALL_END)}"
    return f"{_literal(DS_CALL_BEGIN + t.name + DS_SEP)} {args} {_literal(DS_CALL_END)}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"type": "function", "function": {"name": self.name, "arguments": self.arguments},
                             "id": self.id}
        if index is not None:
            d["index"] = index
        return d


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[int, ToolCall]] = field(default_factory=list)  # (index in the answer, call)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)


def _call_from_json(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _args_text(raw: str) -> str | None:
    try:
        return json.dumps(json.loads(raw), ensure_ascii=False)
    except ValueError:
        return None


_DECODER = json.JSONDecoder()
_LLAMA3_HEADS = ('{"name":', '{"type":"function","name":')  # a Llama 3.x call's start, whitespace removed


def _json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value at `pos` (after whitespace) and the index after it, or None if none is complete there."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def _json_calls(family: str, value: Any) -> list[ToolCall] | None:
    """The calls of a decoded JSON call list (firefunction, command-r7b) or object (llama3); None if it is not one."""
    items = value if isinstance(value, list) and family != "llama3" else [value]
    name_key, args_key = {"llama3": ("name", "parameters"), "firefunction": ("name", "arguments"),
                          "command-r7b": ("tool_name", "parameters")}[family]
    calls = []
    for it in items:
        if not isinstance(it, dict) or not isinstance(it.get(name_key), str) or not isinstance(it.get(args_key), dict):
            return None
        call = ToolCall(it[name_key], json.dumps(it[args_key], ensure_ascii=False))
        if family == "command-r7b" and isinstance(it.get("tool_call_id"), str) and it["tool_call_id"]:
            call.id = it["tool_call_id"]  # llama.cpp answers the model's own id
        calls.append(call)
    return calls if calls else None


def _llama3_start(text: str, final: bool) -> int:
    """Where a Llama 3.x call may start in `text` (a `{` that opens, or may still open, `{"name": ...`), or -1."""
    pos = text.find("{")
    while pos >= 0:
        head = re.sub(r"\s+", "", text[pos:pos + 64])
        if any(head.startswith(h) or (not final and h.startswith(head)) for h in _LLAMA3_HEADS):
            return pos
        pos = text.find("{", pos + 1)
    return -1


def _held(text: str, final: bool, *markers: str) -> int:
    """How much of the end of `text` to hold back while streaming: a possible start of one of `markers`."""
    return 0 if final else max(partial_stop_len(text, m) for m in markers)


class OutputParser:
    """Splits generated text into reasoning, content and tool calls, incrementally (`feed`) or at the end.

    What `feed` returns, concatenated, equals what `finish` would answer for the whole text: reasoning is sent
    without its trailing whitespace until more text follows, content likewise, and nothing that may still
    become a tag."""

    def __init__(self, *, family: str | None, parse_tools: bool, reasoning: bool, starts_in_thinking: bool,
                 think: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)) -> None:
        """`think`: the reasoning's markers (think_tags); Command-R7B's also mean content comes wrapped in
        `<|START_RESPONSE|>...<|END_RESPONSE|>`, which is unwrapped."""
        self.family = family if parse_tools else None
        self.think = think
        self.wrapped = think[0] == CR_THINK_OPEN or family == "command-r7b"
        self.reasoning = reasoning
        self.starts_in_thinking = starts_in_thinking and reasoning
        self.text = ""
        self._sent_reasoning = 0
        self._sent_content = 0
        self._sent_calls = 0
        self.calls: list[ToolCall] = []
        self.final_reasoning = self.final_content = ""

    # ---- splitting a whole text (final=True: the answer is complete) ----

    def _split(self, final: bool) -> tuple[str, str, list[ToolCall]]:
        text, reasoning = self.text, ""
        t_open, t_close = self.think
        if self.reasoning:
            body = None
            if self.starts_in_thinking:
                body = text
            elif text.lstrip().startswith(t_open):
                body = text.lstrip()[len(t_open):]
            elif not final and t_open.startswith(text.lstrip()) and text.strip():
                return "", "", []  # may still become "<think>"
            if body is not None:
                end = body.find(t_close)
                if end < 0:
                    keep = 0 if final else partial_stop_len(body, t_close)
                    reasoning = body[:len(body) - keep].strip() if final else body[:len(body) - keep].lstrip().rstrip()
                    return reasoning, "", []
                reasoning, text = body[:end].strip(), body[end + len(t_close):]
        content, calls = self._split_calls(text, final)
        return reasoning, self._unwrap(content, final), calls

    def _unwrap(self, content: str, final: bool) -> str:
        """Command-R7B's content without its `<|START_RESPONSE|>...<|END_RESPONSE|>` markers."""
        if not self.wrapped:
            return content
        if content.startswith(CR_RESPONSE_OPEN):
            content = content[len(CR_RESPONSE_OPEN):].lstrip()
        elif not final and CR_RESPONSE_OPEN.startswith(content):
            return ""
        end = content.find(CR_RESPONSE_CLOSE)
        if end >= 0:
            return content[:end].rstrip()
        return content[:len(content) - _held(content, final, CR_RESPONSE_CLOSE)].rstrip()

    def _split_calls(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        if self.family is None:
            keep = _held(text, final, CR_ACTION_OPEN, CR_RESPONSE_OPEN) if self.wrapped else 0
            return text[:len(text) - keep].strip(), []
        if self.family == "llama3":
            start = _llama3_start(text, final)
        else:
            start = text.find(OPENERS[self.family])
        if start < 0:
            keep = 0 if self.family == "llama3" else _held(text, final, OPENERS[self.family])
            content = text[:len(text) - keep]
            return content.strip(), []
        content = text[:start]
        calls, rest = self._parse_calls(text[start:], final)
        if final and rest.strip():
            content = content + rest
        return content.strip(), calls

    def _parse_calls(self, block: str, final: bool) -> tuple[list[ToolCall], str]:
        """Complete calls in `block` (which starts with the opener) and, at the end, what could not be parsed."""
        calls: list[ToolCall] = []
        if self.family == "hermes":
            pos = 0
            while True:
                i = block.find(HERMES_OPEN, pos)
                if i < 0:
                    return calls, block[pos:] if final else ""
                j = block.find(HERMES_CLOSE, i)
                if j < 0:
                    if final:  # an unclosed last call (EOS right after the JSON): parse what is there
                        c = _call_from_json(block[i + len(HERMES_OPEN):].strip())
                        return ([*calls, c], "") if c else (calls, block[i:])
                    return calls, ""
                c = _call_from_json(block[i + len(HERMES_OPEN):j].strip())
                if c is None:
                    return calls, block[i:] if final else ""
                calls.append(c)
                pos = j + len(HERMES_CLOSE)
        if self.family in ("llama3", "firefunction", "command-r7b"):
            return self._parse_json_calls(block, final)
        if self.family == "functionary-v3.1":
            return self._parse_functionary(block, final)
        pattern = _DS_R1_CALL if self.family == "deepseek-r1" else _DS_V31_CALL
        for m in pattern.finditer(block):
            args = _args_text(m.group("args"))
            if args is None:
                break
            calls.append(ToolCall(m.group("name").strip(), args))
        return calls, ""

    @staticmethod
    def _parse_functionary(block: str, final: bool) -> tuple[list[ToolCall], str]:
        """Functionary v3.1's `<function=NAME>ARGS</function>` calls (the last may be unclosed at the end), answered
        at the end of the answer, as llama.cpp fails an answer with text after them; such an answer is content."""
        if not final:
            return [], ""
        calls: list[ToolCall] = []
        pos = 0
        while block[pos:].strip():
            i = block.find(FN_OPEN, pos)
            j = block.find(">", i) if i >= 0 and not block[pos:i].strip() else -1
            got = _json_at(block, j + 1) if j >= 0 else None
            if got is None or not isinstance(got[0], dict):
                return [], block
            tail = block[got[1]:].lstrip()
            if not tail.startswith(FN_CLOSE) and tail:
                return [], block
            pos = len(block) - len(tail) + (len(FN_CLOSE) if tail else 0)
            calls.append(ToolCall(block[i + len(FN_OPEN):j].strip(), json.dumps(got[0], ensure_ascii=False)))
        return calls, ""

    def _parse_json_calls(self, block: str, final: bool) -> tuple[list[ToolCall], str]:
        """Llama 3.x's call object, Firefunction's `functools[...]` or Command-R7B's action list. The calls are
        answered once nothing can follow them (the end of the answer; Command-R7B: `<|END_ACTION|>`), as llama.cpp
        fails an answer with text after them; such an answer is content here."""
        assert self.family is not None
        start = len(FIRE_OPEN) - 1 if self.family == "firefunction" else \
            len(CR_ACTION_OPEN) if self.family == "command-r7b" else 0
        got = _json_at(block, start)
        calls = _json_calls(self.family, got[0]) if got else None
        if calls is None:
            return [], block
        rest = block[got[1]:] if got else ""
        if self.family == "command-r7b":
            end = rest.lstrip().startswith(CR_ACTION_CLOSE)
            if end:
                return calls, rest.lstrip()[len(CR_ACTION_CLOSE):]
            if not final:
                return [], ""
            return (calls, "") if not rest.strip() else ([], block)
        if not final:
            return [], ""
        return (calls, "") if not rest.strip() else ([], block)

    # ---- incremental ----

    def feed(self, text: str) -> Delta:
        self.text += text
        return self._delta(final=False)

    def finish(self) -> Delta:
        return self._delta(final=True)

    def _delta(self, final: bool) -> Delta:
        reasoning, content, calls = self._split(final)
        d = Delta()
        if len(reasoning) > self._sent_reasoning:
            d.reasoning, self._sent_reasoning = reasoning[self._sent_reasoning:], len(reasoning)
        if len(content) > self._sent_content:
            d.content, self._sent_content = content[self._sent_content:], len(content)
        if len(calls) > self._sent_calls:
            new = calls[self._sent_calls:]
            d.calls = [(len(self.calls) + k, c) for k, c in enumerate(new)]
            self.calls += new
            self._sent_calls = len(calls)
        if final:
            self.final_reasoning, self.final_content = reasoning, content
        return d
