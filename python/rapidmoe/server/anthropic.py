"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) mapped onto the chat path.

A Messages request is checked field by field and turned into an OpenAI chat body (`to_chat`), which then goes
through the same template, sampling and tool-call parsing as /v1/chat/completions (api/chat_path.py). The
answer's parsed pieces (toolcalls.Delta: reasoning, content, tool calls) become Anthropic content blocks
(`Blocks`: thinking, text, tool_use), whole or as Anthropic's SSE events. Every request field, message key,
content block type and tool key this server does not implement is a 400 naming it; nothing is ignored.
Pure data shaping: no engine, no sockets.
"""
from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from .engine import Finished
from .errors import ApiError, invalid_request
from .params import check_keys, check_utf8, refused, text_value
from .sse import named_event
from .toolcalls import Delta, ToolCall

# Request fields: Anthropic's that are implemented, plus three llama.cpp extensions (`chat_template_kwargs`, as
# llama-server passes it on; `grammar` and `seed`, as on the chat route). Any other field is refused by name.
# `metadata` (Anthropic's end-user id, which Claude Code sends with every request) has no effect on the answer and
# is accepted, as the chat route accepts OpenAI's `metadata` and `user`
MESSAGES_FIELDS = frozenset({"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature",
                             "top_p", "top_k", "tools", "tool_choice", "cache_control", "chat_template_kwargs",
                             "grammar", "seed", "metadata", "thinking"})
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "cache_control",
                          "chat_template_kwargs", "thinking"})
THINKING_BUDGET = 10000  # llama-server's budget_tokens when "enabled" gives none

# Why some well-known fields are refused (the message names the field either way).
_WHY = {"service_tier": "service tiers",
        "container": "code-execution containers", "mcp_servers": "MCP servers", "context_management":
        "context management", "output_format": "structured output", "top_logprobs": "log-probabilities"}

MAX_STOP = 16
ERROR_PREFIX = "Error: "  # a tool_result with is_error: its text as the tool message, after this
_ALNUM = string.ascii_letters + string.digits


def _rand(prefix: str, n: int = 24) -> str:
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(n))


def message_id() -> str:
    return _rand("msg_")


def _cache_control(block: dict[str, Any], name: str) -> None:
    """`cache_control` marks a prompt-cache breakpoint: the slots' prefix cache reuses every prompt's longest cached
    prefix anyway, so the one type Anthropic has ("ephemeral", any `ttl`) is honoured as is."""
    cc = block.get("cache_control")
    if cc is not None and (not isinstance(cc, dict) or cc.get("type") != "ephemeral"):
        where = f"{name}.cache_control" if name else "cache_control"
        raise invalid_request(f"\"{where}\" must be {{\"type\": \"ephemeral\"}}")


def _text_block(b: dict[str, Any], name: str) -> str:
    check_keys(b, {"type", "text", "cache_control", "citations"}, f"{name}.")
    if b.get("citations"):
        raise refused(f"{name}.citations", "citations")
    _cache_control(b, name)
    return text_value(b.get("text"), f"{name}.text")


def _blocks(v: Any, name: str) -> list[dict[str, Any]]:
    if not isinstance(v, list) or not all(isinstance(b, dict) for b in v):
        raise invalid_request(f"\"{name}\" must be a string or an array of content blocks")
    for j, b in enumerate(v):
        if not isinstance(b.get("type"), str):
            raise invalid_request(f"\"{name}[{j}].type\" is required")
    return v


def _system(v: Any) -> list[dict[str, Any]]:
    if isinstance(v, str):
        return [{"role": "system", "content": check_utf8(v, "system")}] if v else []
    parts = []
    for j, b in enumerate(_blocks(v, "system")):
        if b["type"] != "text":
            raise refused(f"system[{j}].type", "only text blocks", value=b['type'])
        parts.append({"type": "text", "text": _text_block(b, f"system[{j}]")})
    return [{"role": "system", "content": parts}] if parts else []


def _tool_result(b: dict[str, Any], name: str) -> dict[str, Any]:
    check_keys(b, {"type", "tool_use_id", "content", "is_error", "cache_control"}, f"{name}.")
    _cache_control(b, name)
    is_error = b.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise invalid_request(f"\"{name}.is_error\" must be a boolean")
    content = b.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = check_utf8(content, f"{name}.content")
    else:
        texts = []
        for k, c in enumerate(_blocks(content, f"{name}.content")):
            if c["type"] != "text":
                raise refused(f"{name}.content[{k}].type", "only text in tool results", value=c['type'])
            texts.append(_text_block(c, f"{name}.content[{k}]"))
        text = "\n".join(texts)
    if is_error:  # chat templates have no error flag for a tool message: the model reads it in the text
        text = f"{ERROR_PREFIX}{text}" if text else ERROR_PREFIX.rstrip(": ")
    return {"role": "tool", "tool_call_id": text_value(b.get("tool_use_id"), f"{name}.tool_use_id"), "content": text}


def _tool_use(b: dict[str, Any], name: str) -> dict[str, Any]:
    check_keys(b, {"type", "id", "name", "input", "cache_control"}, f"{name}.")
    _cache_control(b, name)
    args = b.get("input", {})
    if not isinstance(args, dict):
        raise invalid_request(f"\"{name}.input\" must be an object")
    return {"id": text_value(b.get("id"), f"{name}.id"), "type": "function",
            "function": {"name": text_value(b.get("name"), f"{name}.name"),
                         "arguments": json.dumps(args, ensure_ascii=False)}}


def _messages(v: Any) -> list[dict[str, Any]]:
    """Anthropic messages -> OpenAI chat messages, in order: a user message's tool_result blocks become `tool`
    messages (text between them a user message), an assistant message's thinking, text and tool_use blocks one
    assistant message with `reasoning_content`, `content` and `tool_calls`."""
    if not isinstance(v, list):
        raise invalid_request("\"messages\" is required and must be an array")
    if not v:
        raise invalid_request("\"messages\" must not be empty")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(v):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid_request(f"\"{name}\" must be an object")
        check_keys(m, {"role", "content"}, f"{name}.")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise invalid_request(f"\"{name}.role\" must be \"user\" or \"assistant\", got {role!r}")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": check_utf8(content, f"{name}.content")})
            continue
        blocks = _blocks(content, f"{name}.content")
        if role == "user":
            texts: list[dict[str, Any]] = []
            for j, b in enumerate(blocks):
                bn = f"{name}.content[{j}]"
                if b["type"] == "text":
                    texts.append({"type": "text", "text": _text_block(b, bn)})
                elif b["type"] == "tool_result":
                    if texts:
                        out.append({"role": "user", "content": texts})
                        texts = []
                    out.append(_tool_result(b, bn))
                else:
                    raise refused(f"{bn}.type", "user content blocks: text and tool_result", value=b['type'])
            if texts or not blocks:
                out.append({"role": "user", "content": texts or ""})
            continue
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        texts_a: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(blocks):
            bn = f"{name}.content[{j}]"
            if b["type"] == "text":
                texts_a.append(_text_block(b, bn))
            elif b["type"] == "thinking":
                check_keys(b, {"type", "thinking", "signature", "cache_control"}, f"{bn}.")
                reasoning.append(text_value(b.get("thinking"), f"{bn}.thinking"))
            elif b["type"] == "tool_use":
                calls.append(_tool_use(b, bn))
            else:
                raise refused(f"{bn}.type", "assistant content blocks: text, thinking and tool_use",
                              value=b["type"])
        msg["content"] = "\n".join(texts_a)
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    if v[-1].get("role") == "assistant":  # Anthropic continues a final assistant turn; the chat path cannot
        raise refused(f"messages[{len(v) - 1}].role", "as the last message: Anthropic continues it (prefill), "
                      "which the chat path does not do", value="assistant")
    return out


def _tools(v: Any) -> list[dict[str, Any]]:
    if not isinstance(v, list):
        raise invalid_request("\"tools\" must be an array")
    out = []
    for i, t in enumerate(v):
        name = f"tools[{i}]"
        if not isinstance(t, dict):
            raise invalid_request(f"\"{name}\" must be an object")
        if t.get("type", "custom") != "custom":
            raise refused(f"{name}.type", "server and client tools of Anthropic's; only custom tools",
                          value=t["type"])
        check_keys(t, {"type", "name", "description", "input_schema", "cache_control"}, f"{name}.")
        _cache_control(t, name)
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid_request(f"\"{name}.input_schema\" is required and must be a JSON schema object")
        text_value(t.get("name"), f"{name}.name")
        if t.get("description") is not None:
            text_value(t["description"], f"{name}.description")
        # the function with the tool's keys in their order (the template writes it as JSON), input_schema renamed
        out.append({"type": "function", "function": {"parameters" if k == "input_schema" else k: x
                                                     for k, x in t.items()
                                                     if k in ("name", "description", "input_schema")
                                                     and x is not None}})
    return out


def _tool_choice(v: Any, chat: dict[str, Any]) -> None:
    if not isinstance(v, dict) or v.get("type") not in ("auto", "any", "tool", "none"):
        raise invalid_request("\"tool_choice\" must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}")
    kind = v["type"]
    check_keys(v, {"type", "name", "disable_parallel_tool_use"} if kind == "tool" else
                {"type", "disable_parallel_tool_use"} if kind in ("auto", "any") else {"type"}, "tool_choice.")
    if kind == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": text_value(v.get("name"), "tool_choice.name")}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    one = v.get("disable_parallel_tool_use")
    if one is not None:
        if not isinstance(one, bool):
            raise invalid_request("\"tool_choice.disable_parallel_tool_use\" must be a boolean")
        if one and kind == "auto":  # only the grammar of "any"/"tool" can hold the answer to one call
            raise refused("tool_choice.disable_parallel_tool_use", "with \"auto\"; it is enforced with \"any\" and "
                          "\"tool\"")
        chat["parallel_tool_calls"] = not one


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> None:
    v = body.get(name)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise invalid_request(f"\"{name}\" must be a number in [{lo:g}, {hi:g}]")


def to_chat(body: dict[str, Any], count_only: bool = False) -> dict[str, Any]:
    """The OpenAI chat body of a Messages (or count_tokens) request; 400 naming any field, message key, block type
    or tool key that is not implemented."""
    check_keys(body, COUNT_FIELDS if count_only else MESSAGES_FIELDS, why=_WHY)
    _cache_control(body, "")
    system = _system(body["system"]) if body.get("system") is not None else []
    chat: dict[str, Any] = {"messages": [*system, *_messages(body.get("messages"))]}
    for k in ("model", "chat_template_kwargs"):
        if body.get(k) is not None:
            chat[k] = body[k]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
    if body.get("thinking") is not None:
        budget = _thinking(body["thinking"])
        if budget is not None and not count_only:
            chat["thinking_budget_tokens"] = budget
    if count_only:
        return chat
    mt = body.get("max_tokens")
    if mt is None:
        raise invalid_request("\"max_tokens\" is required")
    if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
        raise invalid_request("\"max_tokens\" must be an integer >= 1")
    chat["max_tokens"] = mt
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise invalid_request("\"stop_sequences\" must be an array of non-empty strings")
        if len(stops) > MAX_STOP:
            raise invalid_request(f"\"stop_sequences\" takes at most {MAX_STOP} strings")
        chat["stop"] = [check_utf8(s, "stop_sequences") for s in stops]
    _number(body, "temperature", 0.0, 1.0)
    _number(body, "top_p", 0.0, 1.0)
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise invalid_request("\"top_k\" must be an integer >= 0")
    for k in ("temperature", "top_p", "top_k", "stream", "grammar", "seed"):
        if body.get(k) is not None:
            chat[k] = body[k]
    return chat


def _thinking(v: Any) -> int | None:
    """Anthropic's extended-thinking switch, mapped as llama-server maps it: {"type": "enabled", "budget_tokens": N}
    is the chat route's `thinking_budget_tokens` N (10000 when absent), so the end of thinking is forced after N
    tokens (reasoning.py); {"type": "disabled"} changes nothing (whether the model thinks is its template's,
    switched by `chat_template_kwargs` where the template can)."""
    if not isinstance(v, dict) or v.get("type") not in ("enabled", "disabled"):
        if isinstance(v, dict) and isinstance(v.get("type"), str):
            raise refused("thinking.type", "\"enabled\" or \"disabled\"", value=v["type"])
        raise invalid_request("\"thinking\" must be {\"type\": \"enabled\", \"budget_tokens\": N} or "
                              "{\"type\": \"disabled\"}")
    if v["type"] == "disabled":
        check_keys(v, {"type"}, "thinking.")
        return None
    check_keys(v, {"type", "budget_tokens"}, "thinking.")
    n = v.get("budget_tokens", THINKING_BUDGET)
    if n is None:
        n = THINKING_BUDGET
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise invalid_request("\"thinking.budget_tokens\" must be an integer >= 0")
    return int(n)


# ---- errors ----

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class AnthropicError(ApiError):
    """An error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def error(e: ApiError) -> AnthropicError:
    """Any error of the server in Anthropic's shape and types; "not implemented" (501) is a 400, as Anthropic
    answers a field it does not know."""
    if isinstance(e, AnthropicError):
        return e
    status = 400 if e.status == 501 else e.status
    return AnthropicError(status, _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error"),
                          e.message)


def error_event(e: ApiError) -> bytes:
    return named_event("error", error(e).body())


# ---- answers ----

def tool_input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as the tool_use block's `input` object; arguments that are not a JSON object (a model
    writing a string where the format wants an object) give `{}`, as llama-server answers them."""
    try:
        v = json.loads(call.arguments)
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


@dataclass
class Blocks:
    """Content blocks built from an answer's parsed deltas, in the order they come: consecutive reasoning is one
    thinking block, consecutive content one text block, each tool call one tool_use block. `add` answers the
    stream events for a delta (content_block_start/delta/stop); the whole answer's `blocks` come from the same
    deltas, so a streamed answer accumulates to the non-streamed one."""

    blocks: list[dict[str, Any]] = field(default_factory=list)
    open: str | None = None  # "thinking" | "text" while such a block takes deltas

    def add(self, d: Delta) -> list[bytes]:
        out = []
        if d.reasoning:
            out += self._text("thinking", d.reasoning)
        if d.content:
            out += self._text("text", d.content)
        for _, call in d.calls:
            out += self._tool(call)
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        i = len(self.blocks) - 1
        if self.open == "thinking":  # Anthropic closes a thinking block with its signature (none here: "")
            out.append(named_event("content_block_delta", {"type": "content_block_delta", "index": i,
                                                           "delta": {"type": "signature_delta", "signature": ""}}))
        out.append(named_event("content_block_stop", {"type": "content_block_stop", "index": i}))
        self.open = None
        return out

    def _start(self, block: dict[str, Any]) -> bytes:
        self.blocks.append(block)
        return named_event("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                   "content_block": dict(block)})

    def _text(self, kind: str, s: str) -> list[bytes]:
        out = []
        if self.open != kind:
            out += self.close()
            out.append(self._start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                   else {"type": "text", "text": ""}))
            self.open = kind
        self.blocks[-1][kind] += s
        delta = {"type": "thinking_delta", "thinking": s} if kind == "thinking" else {"type": "text_delta", "text": s}
        out.append(named_event("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                       "delta": delta}))
        return out

    def _tool(self, call: ToolCall) -> list[bytes]:
        out = self.close()
        args = tool_input(call)
        out.append(self._start({"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": {}}))
        i = len(self.blocks) - 1
        self.blocks[-1]["input"] = args
        out.append(named_event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(args, ensure_ascii=False)}}))
        out.append(named_event("content_block_stop", {"type": "content_block_stop", "index": i}))
        return out


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def stop_reason(fin: Finished, tool_use: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): max_tokens when the token limit (or the slot's context) ended the answer,
    else tool_use when it made calls, stop_sequence for a stop sequence, end_turn for the end of generation."""
    if fin.stop_type == "limit":
        return "max_tokens", None
    if tool_use:
        return "tool_use", None
    if fin.stop_type == "word":
        return "stop_sequence", fin.stopping_word
    return "end_turn", None


def usage(n_prompt: int, n_cached: int, n_output: int) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` is the prompt less what came from the cache (`cache_read_input_tokens`,
    the slot's reused KV); nothing is ever written to a separate cache."""
    return {"input_tokens": n_prompt - n_cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": n_cached, "output_tokens": n_output}


def message(msg_id: str, model: str, blocks: list[dict[str, Any]], fin: Finished) -> dict[str, Any]:
    reason, seq = stop_reason(fin, any(b["type"] == "tool_use" for b in blocks))
    return {"id": msg_id, "type": "message", "role": "assistant", "content": blocks, "model": model,
            "stop_reason": reason, "stop_sequence": seq, "usage": usage(fin.n_prompt, fin.n_cached, fin.n_decoded)}


def message_start(msg_id: str, model: str, n_prompt: int, n_cached: int) -> list[bytes]:
    """The stream's opening: message_start (empty content, input usage) and a ping."""
    msg: dict[str, Any] = {"id": msg_id, "type": "message", "role": "assistant", "content": [], "model": model,
           "stop_reason": None, "stop_sequence": None, "usage": usage(n_prompt, n_cached, 0)}
    return [named_event("message_start", {"type": "message_start", "message": msg}),
            named_event("ping", {"type": "ping"})]


def message_end(blocks: Blocks, fin: Finished) -> list[bytes]:
    """The stream's close: the open block's stop, message_delta (stop reason, final usage), message_stop."""
    out = blocks.close()
    reason, seq = stop_reason(fin, any(b["type"] == "tool_use" for b in blocks.blocks))
    out.append(named_event("message_delta", {"type": "message_delta",
                                             "delta": {"stop_reason": reason, "stop_sequence": seq},
                                             "usage": usage(fin.n_prompt, fin.n_cached, fin.n_decoded)}))
    out.append(named_event("message_stop", {"type": "message_stop"}))
    return out
