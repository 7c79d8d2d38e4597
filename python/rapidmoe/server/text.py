"""Turning sampled token pieces into text a client can be sent: UTF-8 assembly and stop strings.

Pure string logic, no engine: a piece may end inside a multi-byte character, and text that could be the start
of a stop string is held back until it is known not to be one (llama-server's partial-stop rule).
"""
from __future__ import annotations

import codecs


class TextAssembler:
    """Bytes of token pieces in, complete text out; stops at the first stop string (which is not emitted)."""

    def __init__(self, stops: list[str]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = [s for s in stops if s]
        self._held = ""  # decoded text not yet sent: a possible prefix of a stop string
        self.stopping_word = ""  # the stop string that ended generation, if any

    def push(self, piece: bytes) -> str:
        """Text now safe to send. After a stop string matched, `stopping_word` is set and nothing more comes."""
        if self.stopping_word:
            return ""
        self._held += self._decoder.decode(piece)
        return self._release()

    def flush(self) -> str:
        """At the end of generation: whatever is held (incomplete bytes become U+FFFD)."""
        if self.stopping_word:
            return ""
        self._held += self._decoder.decode(b"", final=True)
        out, self._held = self._held, ""
        return out

    def _release(self) -> str:
        text = self._held
        first: tuple[int, str] | None = None
        for stop in self._stops:
            i = text.find(stop)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, stop)
        if first is not None:
            self.stopping_word = first[1]
            self._held = ""
            return text[:first[0]]
        keep = max((partial_stop_len(text, s) for s in self._stops), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]


def partial_stop_len(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
