"""The pure state behind thinking budgets, think-first grammars and strict tools (server/reasoning.py, trigger.py),
against independent references: a reading of llama.cpp's common/reasoning-budget.cpp written out as the expected
token stream, Python's own substring search for the automaton that must never write the end tag, and byte strings
for the trigger's re-spelling. No model, no build."""
from __future__ import annotations

import random
import re

import pytest

from rapidmoe.server.reasoning import BudgetSpec, ReasoningBudget, excluding, utf8_complete
from rapidmoe.server.trigger import TriggerSpec, TriggerWatch

# ---- the reasoning budget ----

START, END, MSG = (100,), (101, 102), (7, 8)
PIECES = {50: "é".encode()[:1], 60: "é".encode()[1:]}  # a two-byte character split over two tokens; others: "x"


def run(spec: BudgetSpec, sampled: list[int]) -> list[int]:
    """The tokens generated when the model would sample `sampled` in order (each forced token takes a step and
    skips nothing of what the model wanted next: a forced token replaces the step's sample)."""
    b = ReasoningBudget(spec, lambda t: PIECES.get(t, b"x"))
    out: list[int] = []
    it = iter(sampled)
    while True:
        tok = b.forced()
        if tok is None:
            tok = next(it, None)
            if tok is None:
                return out
        b.accept(tok)
        out.append(tok)


def spec(n: int, counting: bool, forced: tuple[int, ...] = END) -> BudgetSpec:
    return BudgetSpec(n, START, (END,), forced, counting)


def test_budget_forces_the_end_after_n_thinking_tokens() -> None:
    # the prompt left the block open: 3 tokens of thinking, then the end tag, then the answer as sampled
    assert run(spec(3, True), [1, 2, 3, 4, 9]) == [1, 2, 3, *END, 4, 9]
    # budget 0: the end at once, before anything is sampled
    assert run(spec(0, True), [1, 2]) == [*END, 1, 2]
    # the message comes before the end tag
    assert run(spec(1, True, MSG + END), [1, 2]) == [1, *MSG, *END, 2]


def test_budget_counts_only_inside_a_thinking_block() -> None:
    # outside a block nothing is counted; the start tag opens one, with its own budget
    assert run(spec(2, False), [1, 2, 3, *START, 4, 5, 6]) == [1, 2, 3, *START, 4, 5, *END, 6]
    # a block the model closes itself is not forced; a second block gets a fresh budget (llama.cpp's re-arm)
    assert run(spec(3, True), [1, *END, 3, *START, 4, 5, 6, 7]) == [1, *END, 3, *START, 4, 5, 6, *END, 7]
    # the budget runs out inside the model's own end tag: the whole tag is forced after it (as in llama.cpp)
    assert run(spec(2, True), [1, *END, 3]) == [1, END[0], *END, END[1], 3]


def test_budget_waits_for_a_whole_character() -> None:
    # the budget runs out on the first byte of "é": the end is forced after the next token whose own piece ends
    # on a whole character (llama.cpp checks each piece alone, so "é"'s second byte does not end the wait)
    assert run(spec(1, True), [50, 60, 3, 4]) == [50, 60, 3, *END, 4]
    assert run(spec(1, True), [50, 3, 4]) == [50, 3, *END, 4]
    assert utf8_complete(b"") and utf8_complete(b"a") and utf8_complete("é".encode())
    assert not utf8_complete("é".encode()[:1]) and not utf8_complete("€".encode()[:2])


# ---- text that never contains the end tag ----

def _automaton(rules: list[str]) -> dict[str, list[tuple[str, bool, str]]]:
    """rule name -> [(characters, negated, next rule)] for the `( [..] next | ... )?` rules `excluding` writes."""
    out = {}
    for r in rules:
        name, body = r.split(" ::= ")
        alts = re.findall(r"\[(\^?)((?:\\u[0-9a-f]{4}|\\U[0-9a-f]{8}|[A-Za-z0-9])+)\] (\S+)", body)
        out[name] = [(re.sub(r"\\[uU]([0-9a-f]+)", lambda m: chr(int(m.group(1), 16)), cs), neg == "^", nxt)
                     for neg, cs, nxt in alts]
    return out


def accepts(start: str, rules: list[str], text: str) -> bool:
    table, state = _automaton(rules), start
    for c in text:
        for chars, neg, nxt in table[state]:
            if (c in chars) != neg:
                state = nxt
                break
        else:
            return False
    return True


@pytest.mark.parametrize("delim", ["</think>", "<|END_THINKING|>", "aab", "abab"])
def test_excluding_rules_admit_exactly_the_texts_without_the_tag(delim: str) -> None:
    start, rules = excluding("t", delim)
    rng = random.Random(0)
    alphabet = [*sorted(set(delim)), "z", "\n"]
    # random texts over the tag's own letters (the hard case: near misses and overlaps) and two others, with the
    # tag itself spliced into some of them
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24))) for _ in range(3000)]
    texts += [t[:i] + delim + t[i:] for t in texts[:300] for i in (len(t) // 2,)]
    texts += ["I think </thin k> so </think", "x" + delim, delim + "x", delim[:-1] * 3, "é" + delim[:-1]]
    for t in texts:
        assert accepts(start, rules, t) == (delim not in t), (delim, t)


# ---- the strict-tools trigger ----

VOCAB = {1: b"Sure", 2: b".<tool", 3: b"_call>\n{", 4: b"<tool_call>", 5: b"\n{", 6: b"_call>", 7: b"_c",
         8: b"all>", 9: b"</think>", 10: b" x"}


def tokenize(text: bytes) -> list[int]:
    """Greedy longest match over VOCAB (the re-spelling the trigger asks for)."""
    out: list[int] = []
    while text:
        t = max((t for t, p in VOCAB.items() if text.startswith(p)), key=lambda t: len(VOCAB[t]))
        out.append(t)
        text = text[len(VOCAB[t]):]
    return out


def watch(after: bytes = b"") -> TriggerWatch:
    return TriggerWatch(TriggerSpec(b"<tool_call>", (4,), after), VOCAB.__getitem__, tokenize)


def feed(w: TriggerWatch, sampled: list[int]) -> tuple[list[int], int]:
    """(generated tokens, how many had been generated when the grammar started; -1: never)."""
    out: list[int] = []
    it, started = iter(sampled), -1
    while True:
        tok = w.forced()
        if tok is None:
            nxt = next(it, None)
            if nxt is None:
                return out, started
            tok = w.replace(nxt)
        out.append(tok)
        if w.accept(tok):
            started = len(out)


def test_trigger_starts_at_the_opener() -> None:
    assert feed(watch(), [1, 4, 5]) == ([1, 4, 5], 2)  # one token
    assert feed(watch(), [1, 2, 6, 5]) == ([1, 2, 6, 5], 3)  # across two, ending at a token boundary
    assert feed(watch(), [1, 10]) == ([1, 10], -1)


def test_trigger_respells_a_token_that_runs_past_the_opener() -> None:
    # "_call>\n{" completes the opener and runs on: it becomes "_call>", the grammar starts, "\n{" is the
    # grammar's to choose next
    assert feed(watch(), [1, 2, 3, 5]) == ([1, 2, 6, 5], 3)
    # a re-spelling of two tokens ("_c" "all>") is forced over two steps
    VOCAB[11] = b"_call>\n{"
    del VOCAB[6]
    try:
        assert feed(watch(), [1, 2, 11, 5]) == ([1, 2, 7, 8, 5], 4)
    finally:
        VOCAB[6] = b"_call>"
        del VOCAB[11]


def test_trigger_waits_for_the_end_of_thinking() -> None:
    # an opener inside the thinking block the prompt opened is the model's thought, not a call
    assert feed(watch(after=b"</think>"), [4, 10, 9, 1, 4]) == ([4, 10, 9, 1, 4], 5)
