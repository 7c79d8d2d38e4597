"""Server-Sent Events framing exactly as llama-server writes it (`format_oai_sse`).

Each event is `data: <json>\\n\\n`; a list is one event per item; the OpenAI routes end with `data: [DONE]`.
Anthropic's Messages and OpenAI's Responses streams name their events (`named_event`).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Protocol

DONE = b"data: [DONE]\n\n"


def event(data: Any) -> bytes:
    items = data if isinstance(data, list) else [data]
    return b"".join(b"data: " + json.dumps(x, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
                    for x in items)


def named_event(name: str, data: dict[str, Any]) -> bytes:
    """A named event, as Anthropic's Messages and OpenAI's Responses streams write them: `event: NAME` then
    `data: JSON` (the data's `type` is the event's name)."""
    return (b"event: " + name.encode() + b"\ndata: "
            + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")


def error_event(error_body: dict[str, Any]) -> bytes:
    """An error after the stream started: llama-server sends `data: {"error": {...}}`."""
    return event(error_body)


class _Readable(Protocol):
    def read1(self, n: int = ...) -> bytes: ...


def read_events(resp: _Readable) -> Iterator[bytes]:
    """Client side: the raw events (without the blank line) of an SSE response as they arrive; ValueError if the
    stream ends inside an event."""
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            yield ev
    if buf:
        raise ValueError(f"stream ended inside an event: {buf!r}")
