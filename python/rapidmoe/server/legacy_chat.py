"""Chat formatting without Jinja (`serve --no-jinja`), as llama-server's `common_chat_templates_apply_legacy`.

llama.cpp's `llama_chat_apply_template` recognises the model family from the template's text (or takes a built-in
name: "chatml", "command-r", ...) and writes its format; messages are plain role/content pairs. Tools, reasoning
and template arguments belong to the Jinja path (chat.py), not here.
"""
from __future__ import annotations

import ctypes
from typing import Any

from .._runtime import llama_cpp as lc
from .errors import ApiError

_PROBE = [{"role": "user", "content": "probe"}]


def builtin_names() -> list[str]:
    """llama.cpp's built-in template names (llama_chat_builtin_templates)."""
    n = lc.llama_chat_builtin_templates(None, 0)  # NULL: just the count
    names = (ctypes.c_char_p * n)()
    lc.llama_chat_builtin_templates(names, n)
    return [x.decode() for x in names if x is not None]


def _apply(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str | None:
    """llama_chat_apply_template's text, or None when it does not know the template."""
    keep = [(m["role"].encode(), m["content"].encode()) for m in messages]  # alive while llama.cpp reads them
    chat = (lc.llama_chat_message * len(keep))(*(lc.llama_chat_message(r, c) for r, c in keep))
    tmpl = template.encode()
    size = max(256, 2 * sum(len(r) + len(c) for r, c in keep))
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = lc.llama_chat_apply_template(tmpl, chat, len(keep), add_generation_prompt, buf, size)
        if n < 0:
            return None
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n
    return None


def supported(template: str) -> bool:
    """Whether llama.cpp formats this template (or built-in name) without Jinja."""
    return _apply(template, _PROBE, True) is not None


def render(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    """The prompt text: role and content of each message in the built-in format. "developer" is written as
    "system", as llama.cpp's message parser maps it."""
    msgs = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m.get("content") or ""}
            for m in messages]
    out = _apply(template, msgs, add_generation_prompt)
    if out is None:  # checked at start (supported); kept for a template llama.cpp refuses for these messages
        raise ApiError(400, "invalid_request_error", "this chat template is not supported without Jinja, try "
                                                     "using --jinja")
    return out
