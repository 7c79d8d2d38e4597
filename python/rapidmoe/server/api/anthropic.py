"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens, on the chat path (chat_path.py).

server/anthropic.py maps the request and shapes the answer; errors on these paths are answered in Anthropic's
shape by the HTTP layer (routes.ANTHROPIC_PATHS).
"""
from __future__ import annotations

from typing import Any

from .. import anthropic
from ..engine import Chunk, Finished
from ..toolcalls import Delta
from .chat_path import chat_setup, one_answer, prompt_tokens
from .serving import AppState, Reply, Request, Stream, json_reply


def anthropic_messages(st: AppState, req: Request) -> Reply | Stream:
    """POST /v1/messages: Anthropic's Messages API on the chat path (anthropic.py maps the request and shapes the
    answer; errors are answered in Anthropic's shape by the HTTP layer, see ANTHROPIC_PATHS)."""
    body = req.json()
    chat = anthropic.to_chat(body)
    model = st.check_model(chat)
    cs = chat_setup(st, chat)
    msg_id = anthropic.message_id()

    def whole(d: Delta, fin: Finished) -> dict[str, Any]:
        blocks = anthropic.Blocks()
        blocks.add(d)
        return anthropic.message(msg_id, model, blocks.blocks, fin)

    def start(ev: Chunk | Finished) -> list[bytes]:
        cached = ev.timings.cache_n if ev.timings is not None else 0
        return anthropic.message_start(msg_id, model, len(cs.toks), cached)

    blocks = anthropic.Blocks()  # the streamed answer's
    return one_answer(st, req, chat, cs, whole=whole, start=start, add=blocks.add,
                      end=lambda fin: anthropic.message_end(blocks, fin), error_event=anthropic.error_event)


def anthropic_count_tokens(st: AppState, req: Request) -> Reply:
    """POST /v1/messages/count_tokens: the tokens of the prompt /v1/messages would evaluate (the chat template's
    rendering of system, messages and tools, tokenized as the chat route does)."""
    chat = anthropic.to_chat(req.json(), count_only=True)
    st.check_model(chat)
    return json_reply({"input_tokens": prompt_tokens(st, chat)})
