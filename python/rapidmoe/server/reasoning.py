"""Thinking in chat answers as llama-server's sampler shapes it: the reasoning budget and the grammar that lets a
structured answer think first.

- The budget (`--reasoning-budget N`, a request's `reasoning_budget_tokens` or `thinking_budget_tokens`, Anthropic's
  `thinking.budget_tokens`): after N generated tokens inside the thinking block, the end tag (after
  `reasoning_budget_message`, if any) is forced, token by token. `ReasoningBudget` is llama.cpp's
  common/reasoning-budget.cpp state machine, fed one token at a time by the slot's sampler.
- `think_first`: a JSON answer's grammar (`response_format`, `json_schema`) with optional reasoning in front, as the
  parser llama.cpp's common/chat generates admits it: where the prompt left `<think>` open, thinking text up to the
  end tag, then the JSON; otherwise an optional whole thinking block, then the JSON.
Nothing here touches the engine, llama.cpp or sockets.
"""
from __future__ import annotations

import enum
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetSpec:
    """A request's reasoning budget, in tokens of the model's vocabulary."""

    tokens: int  # generated tokens allowed inside the thinking block (0: the end is forced at once)
    start: tuple[int, ...]  # the start tag
    ends: tuple[tuple[int, ...], ...]  # the end tags that close it naturally
    forced: tuple[int, ...]  # what is forced when the budget runs out: the message, then the first end tag
    counting: bool  # the prompt left the thinking block open: count from the first generated token
    spent: int = 0  # tokens of the open block the prompt holds already (`<think>\n`'s newline), which llama.cpp,
    # feeding its budget the generation prompt, counts too


class _State(enum.Enum):
    IDLE = "idle"  # outside a thinking block
    COUNTING = "counting"
    WAITING_UTF8 = "waiting_utf8"  # budget spent inside a multi-byte character: force once it is complete
    FORCING = "forcing"
    DONE = "done"


class _Matcher:
    """Which of some token sequences ends at the latest token (the longest, if several); forgets what it has seen
    after a match, as llama.cpp's Aho-Corasick matcher resets to its root."""

    def __init__(self, seqs: Sequence[Sequence[int]]) -> None:
        self.seqs = [tuple(s) for s in seqs if s]
        self.n = max((len(s) for s in self.seqs), default=0)
        self.window: list[int] = []

    def advance(self, tok: int) -> int:
        self.window = [*self.window[-(self.n - 1):], tok] if self.n > 1 else [tok]
        best = -1
        for i, s in enumerate(self.seqs):
            if tuple(self.window[-len(s):]) == s and (best < 0 or len(s) > len(self.seqs[best])):
                best = i
        if best >= 0:
            self.window = []
        return best

    def reset(self) -> None:
        self.window = []


def utf8_complete(piece: bytes) -> bool:
    """The piece does not end inside a UTF-8 sequence (common_utf8_is_complete)."""
    if not piece:
        return True
    for i in range(1, min(4, len(piece)) + 1):
        c = piece[-i]
        if c & 0xC0 != 0x80:
            expected = 4 if c >= 0xF0 else 3 if c >= 0xE0 else 2 if c >= 0xC0 else 1
            return i >= expected
    return False


class ReasoningBudget:
    """The budget's state for one answer: `forced()` is the token the sampler must take next (None: sample as
    usual), `accept(tok)` every generated token, forced or sampled."""

    def __init__(self, spec: BudgetSpec, piece: Callable[[int], bytes]) -> None:
        self.spec = spec
        self._piece = piece
        self._start = _Matcher([spec.start])
        self._end = _Matcher(spec.ends)
        self.remaining = spec.tokens
        self.force_pos = 0
        self.state = _State.IDLE
        if spec.counting:
            self._begin(spec.spent)

    def _begin(self, spent: int = 0) -> None:
        self.remaining = self.spec.tokens - spent
        self.state = _State.COUNTING if self.remaining > 0 else _State.FORCING
        self.force_pos = 0

    def forced(self) -> int | None:
        if self.state is _State.FORCING and self.force_pos < len(self.spec.forced):
            return self.spec.forced[self.force_pos]
        return None

    def accept(self, tok: int) -> None:
        st = self.state
        if st in (_State.IDLE, _State.DONE):
            if self._start.advance(tok) >= 0:  # a new thinking block gets a fresh budget (DONE re-arms)
                self._end.reset()
                self._begin()
        elif st in (_State.COUNTING, _State.WAITING_UTF8):
            if self._end.advance(tok) >= 0:
                self.state = _State.DONE  # closed by the model
                return
            complete = utf8_complete(self._piece(tok))
            if st is _State.WAITING_UTF8:
                if complete:
                    self._force()
            else:
                self.remaining -= 1
                if self.remaining <= 0:
                    if complete:
                        self._force()
                    else:
                        self.state = _State.WAITING_UTF8
                        self._end.reset()
        elif st is _State.FORCING:
            self._end.advance(tok)
            self.force_pos += 1
            if self.force_pos >= len(self.spec.forced):
                self.state = _State.DONE

    def _force(self) -> None:
        self.state = _State.FORCING
        self.force_pos = 0
        self._end.reset()


# ---- grammar: reasoning, then the structured answer ----

def _char(c: str) -> str:
    """One character for a GBNF character class (escaped by code point, so that no class syntax can leak)."""
    return c if c.isalnum() and c.isascii() else (f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")


def excluding(name: str, delim: str) -> tuple[str, list[str]]:
    """(start rule, rules) of GBNF matching any text that does not contain `delim`: an automaton whose state i is
    the longest prefix of `delim` the text ends with (Knuth-Morris-Pratt); the move to len(delim) has no
    alternative, so `delim` cannot be written. llama.cpp's parser generator builds the same kind of rule."""
    n = len(delim)
    fail = [0] * n
    k = 0
    for i in range(1, n):
        while k and delim[i] != delim[k]:
            k = fail[k - 1]
        if delim[i] == delim[k]:
            k += 1
        fail[i] = k

    def step(i: int, c: str) -> int:
        while i and delim[i] != c:
            i = fail[i - 1]
        return i + 1 if delim[i] == c else i

    alphabet = sorted(set(delim))
    rules = []
    for i in range(n):
        by_target: dict[int, list[str]] = {}
        for c in alphabet:
            by_target.setdefault(step(i, c), []).append(c)
        alts = [f"[{''.join(map(_char, cs))}] {name}-{t}" for t, cs in sorted(by_target.items()) if t < n]
        alts.append(f"[^{''.join(map(_char, alphabet))}] {name}-0")
        rules.append(f"{name}-{i} ::= ( " + " | ".join(alts) + " )?")
    return f"{name}-0", rules


def think_first(answer_rule: str, grammar: str, think: tuple[str, str], open_think: bool) -> str:
    """`grammar` (whose rule `answer_rule` is the answer) behind the reasoning a thinking template lets the model
    write first: with `open_think` (the prompt ends inside the thinking block) thinking text, the end tag, then the
    answer; else an optional `start ... end` block, then the answer."""
    t_open, t_close = think
    text, rules = excluding("think-text", t_close)
    close = f"{text} {json.dumps(t_close, ensure_ascii=False)} think-space"
    if open_think:
        root = f"root ::= {close} {answer_rule}"
    else:
        root = f"root ::= ( {json.dumps(t_open, ensure_ascii=False)} {close} )? {answer_rule}"
    return "\n".join([root, *rules, "think-space ::= [ \\t\\r\\n]{0,8}", grammar])
