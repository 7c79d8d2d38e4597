"""OpenAI's Responses API (`POST /v1/responses`) mapped onto the chat path.

A Responses request is checked field by field and turned into an OpenAI chat body (`to_chat`), which then goes
through the same template, sampling and tool-call parsing as /v1/chat/completions (api/chat_path.py). The
answer's parsed pieces (toolcalls.Delta) become output items (`Items`: reasoning, message, function_call), whole
or as the Responses stream's events. Fields this server does not implement (stored responses, reasoning summaries,
built-in tools, images and files, ...) are a 400 naming them. Pure data shaping: no engine, no sockets.
"""
from __future__ import annotations

import json
import secrets
import string
import time
from dataclasses import dataclass, field
from typing import Any

from .engine import Finished
from .errors import ApiError, invalid_request
from .params import check_keys, check_utf8, refused, text_value
from .sse import named_event
from .toolcalls import Delta, ToolCall

# OpenAI's fields that are implemented, each accepted value checked below, plus three llama.cpp extensions
# (`chat_template_kwargs`, `grammar`, `seed`, as on the chat route); any other field is refused by name.
# `metadata` and `user` have no effect on the answer.
FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "tools", "tool_choice",
                    "parallel_tool_calls", "stream", "temperature", "top_p", "text", "store", "truncation", "include",
                    "chat_template_kwargs", "grammar", "seed", "metadata", "user", "reasoning"})
COUNT_FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                          "truncation", "chat_template_kwargs"})  # /v1/responses/input_tokens
_WHY = {"previous_response_id": "stored responses", "conversation": "stored conversations", "background":
        "background responses",
        "prompt": "prompt templates", "service_tier": "service tiers", "max_tool_calls": "a tool-call budget",
        "top_logprobs": "log-probabilities", "stream_options": "stream options", "prompt_cache_key":
        "cache keys; the slots' prefix cache works without one", "safety_identifier": "", "user": ""}

_ALNUM = string.ascii_letters + string.digits


def new_id(prefix: str, n: int = 24) -> str:
    return prefix + "".join(secrets.choice(_ALNUM) for _ in range(n))


def _parts(v: Any, name: str, kinds: tuple[str, ...]) -> str:
    """A message's content: a string, or parts of the given text types joined by newlines (as the chat route
    joins text parts)."""
    if isinstance(v, str):
        return check_utf8(v, name)
    if not isinstance(v, list):
        raise invalid_request(f"\"{name}\" must be a string or an array of content parts")
    texts = []
    for j, p in enumerate(v):
        pn = f"{name}[{j}]"
        if not isinstance(p, dict) or not isinstance(p.get("type"), str):
            raise invalid_request(f"\"{pn}\" must be a content part with a \"type\"")
        if p["type"] not in kinds:
            raise refused(f"{pn}.type", "text parts: " + ", ".join(kinds), value=p['type'])
        check_keys(p, {"type", "text", "annotations", "logprobs"}, f"{pn}.")
        if p.get("annotations"):
            raise refused(f"{pn}.annotations")
        texts.append(text_value(p.get("text"), f"{pn}.text"))
    return "\n".join(texts)


def _assistant(out: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message that output items replayed in `input` (reasoning, message, function calls) belong to:
    the previous message when it is the assistant's, else a new one."""
    if not out or out[-1]["role"] != "assistant":
        out.append({"role": "assistant", "content": ""})
    return out[-1]


def _input(v: Any, out: list[dict[str, Any]]) -> None:
    """`input` (a string or items) -> OpenAI chat messages appended to `out`."""
    if isinstance(v, str):
        out.append({"role": "user", "content": check_utf8(v, "input")})
        return
    if not isinstance(v, list) or not v:
        raise invalid_request("\"input\" must be a string or a non-empty array of items")
    for i, item in enumerate(v):
        name = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_request(f"\"{name}\" must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            check_keys(item, {"type", "role", "content", "id", "status"}, f"{name}.")
            role = item.get("role")
            if role in ("user", "system", "developer"):
                out.append({"role": role, "content": _parts(item.get("content"), f"{name}.content",
                                                            ("input_text",))})
            elif role == "assistant":
                msg = _assistant(out)
                text = _parts(item.get("content"), f"{name}.content", ("output_text", "input_text"))
                msg["content"] = msg["content"] + "\n" + text if msg["content"] else text
            else:
                raise invalid_request(f"\"{name}.role\" must be \"user\", \"system\", \"developer\" or "
                                      f"\"assistant\", got {role!r}")
        elif kind == "function_call":
            check_keys(item, {"type", "call_id", "name", "arguments", "id", "status"}, f"{name}.")
            _assistant(out).setdefault("tool_calls", []).append({
                "id": text_value(item.get("call_id"), f"{name}.call_id"), "type": "function",
                "function": {"name": text_value(item.get("name"), f"{name}.name"),
                             "arguments": text_value(item.get("arguments"), f"{name}.arguments")}})
        elif kind == "function_call_output":
            check_keys(item, {"type", "call_id", "output", "id", "status"}, f"{name}.")
            out.append({"role": "tool", "tool_call_id": text_value(item.get("call_id"), f"{name}.call_id"),
                        "content": _parts(item.get("output"), f"{name}.output", ("input_text",))})
        elif kind == "reasoning":
            check_keys(item, {"type", "id", "summary", "content", "encrypted_content", "status"}, f"{name}.")
            if item.get("encrypted_content"):
                raise refused(f"{name}.encrypted_content", "encrypted reasoning")
            content = item.get("content")
            text = (_reasoning_text(content, f"{name}.content", "reasoning_text") if content else
                    _reasoning_text(item.get("summary") or [], f"{name}.summary", "summary_text"))
            if text:
                msg = _assistant(out)
                msg["reasoning_content"] = msg["reasoning_content"] + "\n" + text if msg.get("reasoning_content") \
                    else text
        else:
            raise refused(f"{name}.type", "input items: message, function_call, function_call_output, reasoning",
                          value=kind)


def _reasoning_text(v: Any, name: str, kind: str) -> str:
    if not isinstance(v, list):
        raise invalid_request(f"\"{name}\" must be an array")
    texts = []
    for j, p in enumerate(v):
        if not isinstance(p, dict) or p.get("type") != kind:
            raise invalid_request(f"\"{name}[{j}]\" must be {{\"type\": \"{kind}\", \"text\": ...}}")
        check_keys(p, {"type", "text"}, f"{name}[{j}].")
        texts.append(text_value(p.get("text"), f"{name}[{j}].text"))
    return "\n".join(texts)


def _tools(v: Any) -> list[dict[str, Any]]:
    """Function tools -> the chat route's, `strict` with them (the chat route enforces it: toolcalls.ToolRequest;
    absent means not strict)."""
    if not isinstance(v, list):
        raise invalid_request("\"tools\" must be an array")
    out = []
    for i, t in enumerate(v):
        name = f"tools[{i}]"
        if not isinstance(t, dict):
            raise invalid_request(f"\"{name}\" must be an object")
        if t.get("type") != "function":
            raise refused(f"{name}.type", "built-in tools; only function tools", value=t.get('type'))
        check_keys(t, {"type", "name", "description", "parameters", "strict"}, f"{name}.")
        strict = t.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid_request(f"\"{name}.strict\" must be a boolean")
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise invalid_request(f"\"{name}.parameters\" must be a JSON schema object")
        text_value(t.get("name"), f"{name}.name")
        if t.get("description") is not None:
            text_value(t["description"], f"{name}.description")
        # the function as given (its keys in their order: the template writes it as JSON, as the chat route's
        # template_tools gives it: without `strict`), less type
        out.append({"type": "function", "function": {k: x for k, x in t.items() if k != "type" and x is not None}})
    return out


def _tool_choice(v: Any) -> Any:
    if v in ("auto", "none", "required"):
        return v
    if isinstance(v, dict) and v.get("type") == "function":
        check_keys(v, {"type", "name"}, "tool_choice.")
        return {"type": "function", "function": {"name": text_value(v.get("name"), "tool_choice.name")}}
    if isinstance(v, dict) and isinstance(v.get("type"), str):
        raise refused("tool_choice.type", "\"auto\", \"none\", \"required\" or a function", value=v['type'])
    raise invalid_request("\"tool_choice\" must be \"auto\", \"none\", \"required\" or "
                          "{\"type\": \"function\", \"name\": ...}")


def _text_format(v: Any) -> dict[str, Any] | None:
    """`text.format` -> the chat route's `response_format` (None for plain text)."""
    if not isinstance(v, dict):
        raise invalid_request("\"text\" must be an object")
    check_keys(v, {"format"}, "text.")
    fmt = v.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid_request("\"text.format\" must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}")
    if fmt["type"] == "text":
        check_keys(fmt, {"type"}, "text.format.")
        return None
    if fmt["type"] == "json_object":
        check_keys(fmt, {"type"}, "text.format.")
        return {"type": "json_object"}
    check_keys(fmt, {"type", "name", "schema", "strict", "description"}, "text.format.")
    if not isinstance(fmt.get("schema"), dict):
        raise invalid_request("\"text.format.schema\" is required and must be a JSON schema object")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}


def to_chat(body: dict[str, Any], count_only: bool = False) -> dict[str, Any]:
    """The OpenAI chat body of a Responses (or input_tokens) request; 400 naming any field, item type or tool that
    is not implemented."""
    check_keys(body, COUNT_FIELDS if count_only else FIELDS, why=_WHY)
    if body.get("store") is True:
        raise refused("store", "stored responses; send \"store\": false")
    if body.get("truncation") not in (None, "disabled"):
        raise refused("truncation", "only \"disabled\"")
    if body.get("include") not in (None, []):
        raise refused("include", "extra output data")
    if "input" not in body:
        raise invalid_request("\"input\" is required")
    messages: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": text_value(body["instructions"], "instructions")})
    _input(body["input"], messages)
    chat: dict[str, Any] = {"messages": messages}
    choice = _tool_choice(body["tool_choice"]) if body.get("tool_choice") is not None else None
    if choice is not None:
        chat["tool_choice"] = choice
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("text") is not None:
        rf = _text_format(body["text"])
        if rf is not None:
            chat["response_format"] = rf
    mt = body.get("max_output_tokens")
    if mt is not None:
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise invalid_request("\"max_output_tokens\" must be an integer >= 1")
        chat["max_tokens"] = mt
    if body.get("reasoning") is not None:
        _reasoning(body["reasoning"], chat)
    for k in ("model", "parallel_tool_calls", "stream", "temperature", "top_p", "chat_template_kwargs", "grammar",
              "seed"):
        if body.get(k) is not None:
            chat[k] = body[k]
    return chat


def _reasoning(v: Any, chat: dict[str, Any]) -> None:
    """`reasoning.effort` is the chat route's `reasoning_effort`, as llama-server maps it ("none": no thinking where
    the template can switch it off; another value goes to the template); summaries are not written."""
    if not isinstance(v, dict):
        raise invalid_request("\"reasoning\" must be an object")
    check_keys(v, {"effort"}, "reasoning.", why={"summary": "reasoning summaries; the reasoning item holds the "
                                                           "reasoning text itself"})
    if v.get("effort") is not None:
        chat["reasoning_effort"] = text_value(v["effort"], "reasoning.effort")


def error_event(e: ApiError) -> bytes:
    """An error after the stream started: the Responses stream's `error` event."""
    return named_event("error", {"type": "error", "code": e.type, "message": e.message, "param": None})


# ---- answers ----

def usage(fin: Finished) -> dict[str, Any]:
    return {"input_tokens": fin.n_prompt, "input_tokens_details": {"cached_tokens": fin.n_cached},
            "output_tokens": fin.n_decoded, "total_tokens": fin.n_prompt + fin.n_decoded}


def incomplete(fin: Finished) -> bool:
    """The token limit (`max_output_tokens`, or the slot's context) ended the answer: status "incomplete"."""
    return fin.stop_type == "limit"


@dataclass
class Head:
    """What the response object repeats of the request, in every lifecycle event."""

    model: str
    body: dict[str, Any]
    id: str = field(default_factory=lambda: new_id("resp_"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict[str, Any]], fin: Finished | None) -> dict[str, Any]:
        b = self.body
        out: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "model": self.model, "output": output, "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
            "temperature": b.get("temperature"), "top_p": b.get("top_p"), "store": False,
            "truncation": "disabled", "text": b.get("text") or {"format": {"type": "text"}}, "metadata": {},
            "usage": usage(fin) if fin is not None else None}
        if status in ("completed", "incomplete"):
            out["completed_at"] = int(time.time())
        return out


@dataclass
class Items:
    """Output items built from an answer's parsed deltas, in the order they come: consecutive reasoning is one
    reasoning item, consecutive content one message, each tool call one function_call. `add` answers the stream
    events for a delta; the whole answer's `output` comes from the same deltas, so a streamed answer accumulates to
    the non-streamed one. Every event carries its `sequence_number`."""

    output: list[dict[str, Any]] = field(default_factory=list)
    open: str | None = None  # "reasoning" | "message" while such an item takes deltas
    seq: int = 0

    def event(self, kind: str, **data: Any) -> bytes:
        ev = named_event(kind, {"type": kind, "sequence_number": self.seq, **data})
        self.seq += 1
        return ev

    def add(self, d: Delta) -> list[bytes]:
        out = []
        if d.reasoning:
            out += self._text("reasoning", d.reasoning)
        if d.content:
            out += self._text("message", d.content)
        for _, call in d.calls:
            out += self._call(call)
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        """Close the open item (`status` "incomplete" when the token limit cut it)."""
        if self.open is None:
            return []
        i, item = len(self.output) - 1, self.output[-1]
        item["status"] = status
        part = item["content"][0]
        if self.open == "reasoning":
            out = [self.event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                              text=part["text"])]
        else:
            out = [self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                              text=part["text"], logprobs=[]),
                   self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                              part=dict(part))]
        out.append(self.event("response.output_item.done", output_index=i, item=json.loads(json.dumps(item))))
        self.open = None
        return out

    def _text(self, kind: str, s: str) -> list[bytes]:
        out = []
        if self.open != kind:
            out += self.close()
            if kind == "reasoning":
                item: dict[str, Any] = {"type": "reasoning", "id": new_id("rs_"), "summary": [], "content": [],
                                        "status": "in_progress"}
            else:
                item = {"type": "message", "id": new_id("msg_"), "status": "in_progress", "role": "assistant",
                        "content": []}
            self.output.append(item)
            i = len(self.output) - 1
            out.append(self.event("response.output_item.added", output_index=i, item=json.loads(json.dumps(item))))
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            if kind == "message":
                out.append(self.event("response.content_part.added", item_id=item["id"], output_index=i,
                                      content_index=0, part=dict(part)))
            self.open = kind
        i, item = len(self.output) - 1, self.output[-1]
        item["content"][0]["text"] += s
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.event(name, item_id=item["id"], output_index=i, content_index=0, delta=s, **extra))
        return out

    def _call(self, call: ToolCall) -> list[bytes]:
        out = self.close()
        fc_id = "fc_" + call.id.removeprefix("call_")
        item = {"type": "function_call", "id": fc_id, "call_id": call.id, "name": call.name, "arguments": "",
                "status": "in_progress"}
        self.output.append(item)
        i = len(self.output) - 1
        out.append(self.event("response.output_item.added", output_index=i, item=dict(item)))
        out.append(self.event("response.function_call_arguments.delta", item_id=fc_id, output_index=i,
                              delta=call.arguments))
        out.append(self.event("response.function_call_arguments.done", item_id=fc_id, output_index=i,
                              name=call.name, arguments=call.arguments))
        item.update(arguments=call.arguments, status="completed")
        out.append(self.event("response.output_item.done", output_index=i, item=dict(item)))
        return out

    def start(self, head: Head) -> list[bytes]:
        r = head.response("in_progress", [], None)
        return [self.event("response.created", response=r), self.event("response.in_progress", response=r)]

    def finish(self, head: Head, fin: Finished) -> list[bytes]:
        status = "incomplete" if incomplete(fin) else "completed"
        out = self.close(status)
        out.append(self.event(f"response.{status}", response=head.response(status, self.output, fin)))
        return out
