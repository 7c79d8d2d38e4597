"""OpenAI's Responses API: /v1/responses and /v1/responses/input_tokens, on the chat path (chat_path.py).

server/responses_api.py maps the request and shapes the output items and stream events.
"""
from __future__ import annotations

from typing import Any

from .. import responses_api
from ..engine import Finished
from ..toolcalls import Delta
from .chat_path import chat_setup, one_answer, prompt_tokens
from .serving import AppState, Reply, Request, Stream, json_reply


def oai_responses(st: AppState, req: Request) -> Reply | Stream:
    """POST /v1/responses: OpenAI's Responses API on the chat path (responses_api.py maps the request and shapes
    the output items and stream events)."""
    body = req.json()
    chat = responses_api.to_chat(body)
    model = st.check_model(chat)
    cs = chat_setup(st, chat)
    head = responses_api.Head(model, body)
    items = responses_api.Items()

    def whole(d: Delta, fin: Finished) -> dict[str, Any]:
        items.add(d)
        status = "incomplete" if responses_api.incomplete(fin) else "completed"
        items.close(status)
        return head.response(status, items.output, fin)

    return one_answer(st, req, chat, cs, whole=whole, start=lambda ev: items.start(head), add=items.add,
                      end=lambda fin: items.finish(head, fin), error_event=responses_api.error_event)


def oai_responses_input_tokens(st: AppState, req: Request) -> Reply:
    """POST /v1/responses/input_tokens: the tokens of the prompt /v1/responses would evaluate."""
    chat = responses_api.to_chat(req.json(), count_only=True)
    st.check_model(chat)
    return json_reply({"object": "response.input_tokens", "input_tokens": prompt_tokens(st, chat)})
