"""A grammar that starts where the answer opens a tool call: strict tools under tool_choice "auto".

The answer is free text until the tool-call family's opener (Qwen3's `<tool_call>`, DeepSeek's tool-calls
marker, ...) has been generated; from there the grammar enforces the calls. `TriggerWatch`
follows the generated text and says when the opener is complete. The grammar can only start at a token boundary
(llama.cpp's grammar takes whole tokens; one that runs past the opener would leave text the grammar has not seen),
so a token that completes the opener and runs on is replaced by tokens that end exactly at it. Pure state: no
llama.cpp here; the slot's sampler (sampling.py) owns the grammar and feeds it `opener_tokens` at the start.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TriggerSpec:
    opener: bytes  # the text the grammar starts with (the family's tool-call opener)
    opener_tokens: tuple[int, ...]  # tokens spelling exactly `opener`, fed to the grammar when it starts
    after: bytes = b""  # watch only once this has been generated (the end of a thinking block the prompt opened)


class TriggerWatch:
    """`forced()`: a token that must be generated next (completing the opener at a token boundary), else None;
    `replace(tok)`: the token to generate instead of a sampled one; `accept(tok)`: True when the opener has just
    been completed (start the grammar now). `piece` renders a token as the grammar sees it (special tokens as
    their text); `tokenize` tokenizes text with special tokens parsed."""

    def __init__(self, spec: TriggerSpec, piece: Callable[[int], bytes],
                 tokenize: Callable[[bytes], list[int]]) -> None:
        self.spec = spec
        self._piece = piece
        self._tokenize = tokenize
        self.text = b""
        self.start = -1 if spec.after else 0  # where the opener is looked for; -1: `after` not yet seen
        self.queue: list[int] = []
        self.started = False

    def forced(self) -> int | None:
        return self.queue[0] if self.queue else None

    def _find(self, text: bytes) -> int:
        """Where the opener ends in `text` (a new occurrence: not one ending in the text seen already), or -1."""
        if self.start < 0:
            return -1
        op = self.spec.opener
        j = text.find(op, max(self.start, len(self.text) - len(op) + 1))
        return j + len(op) if j >= 0 else -1

    def replace(self, tok: int) -> int:
        """The sampled `tok`, or the first of the tokens that spell its piece up to the end of the opener it
        completes inside itself (the rest are forced next)."""
        if self.started or self.queue:
            return tok
        new = self.text + self._piece(tok)
        end = self._find(new)
        if end < 0 or end == len(new):
            return tok
        keep = new[len(self.text):end]
        toks = self._tokenize(keep)
        if not toks or b"".join(self._piece(t) for t in toks) != keep:
            log.warning("tool-call opener completed inside a token that cannot be re-spelt; the grammar will not "
                        "start at this opener")
            return tok
        self.queue = toks[1:]
        return toks[0]

    def accept(self, tok: int) -> bool:
        if self.started:
            return False
        if self.queue and tok == self.queue[0]:
            self.queue.pop(0)
        self.text += self._piece(tok)
        if self.start < 0:
            j = self.text.find(self.spec.after)
            if j < 0:
                return False
            self.start = j + len(self.spec.after)
        if not self.queue and self.text.endswith(self.spec.opener) and \
                len(self.text) - len(self.spec.opener) >= self.start:
            self.started = True
        return self.started
