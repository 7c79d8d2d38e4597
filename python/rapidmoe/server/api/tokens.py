"""llama-server's text utilities: /tokenize, /detokenize and /apply-template (the chat template's prompt)."""
from __future__ import annotations

from typing import Any

from ..errors import invalid_request
from ..params import check_utf8, get_bool
from .chat_path import chat_prompt
from .serving import AppState, Reply, Request, check_ids, json_reply, tokenize_text


def apply_template(st: AppState, req: Request) -> Reply:
    """POST /apply-template: the rendered prompt; `add_generation_prompt` false leaves the assistant's header off
    (as llama-server; the chat route refuses it, since it cannot continue a turn)."""
    body = req.json()
    return json_reply({"prompt": chat_prompt(st, body, get_bool(body, "add_generation_prompt", True))[0]})


def tokenize(st: AppState, req: Request) -> Reply:
    body = req.json()
    content = body.get("content")
    if not isinstance(content, str):
        raise invalid_request("\"content\" (a string) is required")
    check_utf8(content, "content")
    toks = tokenize_text(st, content, get_bool(body, "add_special", False), get_bool(body, "parse_special", True))
    if not get_bool(body, "with_pieces", False):
        return json_reply({"tokens": toks})
    assert st.engine is not None
    out = []
    for tok in toks:
        raw = st.engine.llm.detokenize([tok], special=True)
        try:
            piece: Any = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        out.append({"id": tok, "piece": piece})
    return json_reply({"tokens": out})


def detokenize(st: AppState, req: Request) -> Reply:
    body = req.json()
    toks = body.get("tokens", [])
    if not isinstance(toks, list):
        raise invalid_request("\"tokens\" must be an array of token ids")
    assert st.engine is not None
    text = st.engine.llm.detokenize(check_ids(st, toks, "tokens"), special=True) if toks else b""
    return json_reply({"content": text.decode("utf-8", "replace")})
