"""Server-Sent Events framing exactly as llama-server writes it (`format_oai_sse`).

Each event is `data: <json>\\n\\n`; a list is one event per item; the OpenAI routes end with `data: [DONE]`.
"""
from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"


def event(data: Any) -> bytes:
    items = data if isinstance(data, list) else [data]
    return b"".join(b"data: " + json.dumps(x, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
                    for x in items)


def error_event(error_body: dict[str, Any]) -> bytes:
    """An error after the stream started: llama-server sends `data: {"error": {...}}`."""
    return event(error_body)
