"""Chat messages -> prompt text with the model's Jinja chat template, as llama-server applies it.

The template comes from the GGUF (`tokenizer.chat_template`), or --chat-template; a model without one gets
ChatML, llama-server's fallback. Rendering uses llama-cpp-python's sandboxed Jinja formatter; with --no-jinja,
llama.cpp's built-in formats (legacy_chat.py).
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import jinja2

from .._runtime import llama_cpp
from . import legacy_chat
from .errors import invalid_request
from .params import check_utf8

CHATML = llama_cpp.llama_chat_format.CHATML_CHAT_TEMPLATE
ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's, less the legacy "function"


def _jsonable(obj: Any) -> Any:
    """Jinja's `map`/`select` give generators; templates pass them to `tojson` (DeepSeek-R1's tool list)."""
    if isinstance(obj, Iterable) and not isinstance(obj, (str, bytes, dict)):
        return list(obj)
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


class _Undefined(jinja2.Undefined):
    """An undefined name joins strings as an empty one, as in llama.cpp's Jinja (Firefunction v2's template adds
    `functions`, which llama-server never sets, to its system prompt)."""

    def __add__(self, other: object) -> Any:
        return other if isinstance(other, str) else super().__add__(other)

    def __radd__(self, other: object) -> Any:
        return other if isinstance(other, str) else super().__radd__(other)


class _Formatter(llama_cpp.llama_chat_format.Jinja2ChatFormatter):
    def __init__(self, template: str, eos_token: str, bos_token: str, add_generation_prompt: bool = True) -> None:
        super().__init__(template, eos_token, bos_token, add_generation_prompt=add_generation_prompt)
        env = self._environment.environment
        env.undefined = _Undefined
        # llama.cpp's Jinja has no HTML escaping: `|safe` gives plain text, so that a string added to it is not
        # escaped (Functionary v3.1's tool list is `"..."|safe + tool|tojson`); filters are bound when compiling
        env.filters["safe"] = str
        self._environment = env.from_string(template)

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, **kwargs: Any) -> str:
        """The rendered prompt; unlike the base class's call, no `functions`, `function_call` or `tool_choice` set
        to None (llama-server leaves them undefined)."""
        def raise_exception(message: str) -> None:
            raise ValueError(message)
        return self._environment.render(messages=messages, eos_token=self.eos_token, bos_token=self.bos_token,
                                        raise_exception=raise_exception, tools=tools,
                                        add_generation_prompt=self.add_generation_prompt,
                                        strftime_now=self.strftime_now, **kwargs)

    @staticmethod
    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                          default=_jsonable)


class ChatTemplate:
    def __init__(self, template: str, bos_token: str, eos_token: str, *, jinja: bool = True,
                 kwargs: dict[str, Any] | None = None, add_bos: bool = False, add_eos: bool = False) -> None:
        """`jinja` False: llama.cpp's built-in format for the template (llama-server's --no-jinja); `kwargs`: the
        server's template arguments (--chat-template-kwargs, --reasoning on|off), under each request's own.
        `add_bos`/`add_eos`: the tokenizer adds BOS/EOS itself (llama_vocab_get_add_bos/eos), so a rendered prompt
        that starts with the BOS text or ends with the EOS text loses it, as llama.cpp's common/chat.cpp does;
        otherwise a template that writes `{{ bos_token }}` (DeepSeek-R1/V3, Llama 3, Mistral) gives two BOS."""
        self.source = template
        self.jinja = jinja
        self.kwargs = dict(kwargs or {})
        self.bos_token, self.eos_token = bos_token, eos_token
        self.add_bos, self.add_eos = add_bos, add_eos
        if jinja:
            self._fmt = _Formatter(template, eos_token, bos_token)
            self._fmt_bare = _Formatter(template, eos_token, bos_token, add_generation_prompt=False)

    def render(self, messages: list[dict[str, Any]], body: dict[str, Any],
               tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True) -> str:
        """The prompt text. Besides messages and tools the template sees what llama-server gives it by default:
        `enable_thinking` true (its default reasoning "auto"; Command-R7B's template renders an empty thinking
        block without it), today's date as `datetime` ("%b %d %Y") and `date_string` ("%d %b %Y") (Llama 3.x
        templates print it); then the server's (--chat-template-kwargs, --reasoning on|off) and the request's
        `chat_template_kwargs`, each overriding what comes before; last OpenAI's `reasoning_effort`, as
        llama-server maps it: "none" sets `enable_thinking` false, any other value is the template's
        `reasoning_effort` (GPT-OSS's template reads it)."""
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise invalid_request("\"chat_template_kwargs\" must be an object")
        effort = body.get("reasoning_effort")
        if effort is not None and not isinstance(effort, str):
            raise invalid_request("\"reasoning_effort\" must be a string")
        if not self.jinja:  # no template arguments without Jinja, as llama-server's legacy path
            return legacy_chat.render(self.source, messages, add_generation_prompt)
        now = datetime.now()
        kwargs = {"enable_thinking": True, "datetime": now.strftime("%b %d %Y"),
                  "date_string": now.strftime("%d %b %Y"), **self.kwargs, **kwargs}
        if effort == "none":
            kwargs["enable_thinking"] = False
            kwargs.pop("reasoning_effort", None)
        elif effort:
            kwargs["reasoning_effort"] = check_utf8(effort, "reasoning_effort")
        fmt = self._fmt if add_generation_prompt else self._fmt_bare
        if "<|channel|>" not in self.source:  # llama.cpp maps "developer" to "system" for all but GPT-OSS
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        try:
            prompt = fmt.prompt(messages, tools or None, **kwargs)
        except Exception as e:  # noqa: BLE001 - a template error is the request's (raise_exception in the template)
            raise invalid_request(f"chat template failed: {e}") from None
        if self.add_bos and self.bos_token and prompt.startswith(self.bos_token):
            prompt = prompt[len(self.bos_token):]
        if self.add_eos and self.eos_token and prompt.endswith(self.eos_token):
            prompt = prompt[:-len(self.eos_token)]
        return prompt


def check_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """llama-server's checks: an array of {role, content}; content a string or [{type: text, text}]. The role must
    be one of OpenAI's (ROLES; an unknown one is a 400, as OpenAI answers; "function" messages of the legacy
    function calling are refused by name, as `functions` is)."""
    if "messages" not in body:
        raise invalid_request("'messages' is required")
    msgs = body["messages"]
    if not isinstance(msgs, list):
        raise invalid_request("Expected 'messages' to be an array")
    if not msgs:
        raise invalid_request("'messages' must not be empty")
    if len(msgs) >= 2 and all(isinstance(m, dict) and m.get("role") == "assistant" for m in msgs[-2:]):
        raise invalid_request("Cannot have 2 or more assistant messages at the end of the list.")  # llama-server's
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid_request(f"messages[{i}] must be an object with a string 'role'")
        if m["role"] == "function":
            raise invalid_request(f"messages[{i}]: role 'function' (legacy function calling) is not supported by "
                                  "this server; use 'tool' messages")
        if m["role"] not in ROLES:
            raise invalid_request(f"messages[{i}]: invalid role {m['role']!r}; expected one of "
                                  + ", ".join(f"'{r}'" for r in ROLES))
        content = m.get("content")
        if content is None and m["role"] != "assistant":
            raise invalid_request("All non-assistant messages must contain 'content'")
        if isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise invalid_request("unsupported content[].type (only text parts are supported)")
                parts.append(p["text"])
            content = "\n".join(parts)
        elif content is not None and not isinstance(content, str):
            raise invalid_request("Expected 'content' to be a string or an array")
        out.append({**m, "role": check_utf8(m["role"], "role"),
                    "content": check_utf8(content, "content") if content is not None else ""})
    return out
