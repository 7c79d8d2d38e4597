"""The prompt (prefix) cache of `rapidmoe-cli serve`: each slot keeps its KV after a request, a new request goes to
the idle slot sharing the longest prefix and only the rest of its prompt is evaluated. Checked against the token
ids (from /tokenize and `return_tokens`, computed here), and greedy answers against `cache_prompt: false`.
"""
from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from server_proc import ServerProc
from testkit import GREEDY

from rapidmoe.server.chat import CHATML  # chat requests here keep ChatML, whatever the model carries

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def srv(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    log = tmp_path_factory.mktemp("server") / "cache.log"
    s = ServerProc(tiny_qwen, "--parallel", "2", "-c", "4096", "-t", "1", "--chat-template", CHATML,
                   log_path=log)
    yield s
    s.stop()


def _toks(s: ServerProc, text: str) -> list[int]:
    return s.request("POST", "/tokenize", {"content": text, "add_special": True})[1]["tokens"]


def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _complete(s: ServerProc, prompt: str, **kw: object) -> dict:
    status, r = s.request("POST", "/completion", {"prompt": prompt, "n_predict": 12, "ignore_eos": True,
                                                  "return_tokens": True, **GREEDY, **kw})
    assert status == 200, r
    return r


def _metric(s: ServerProc, name: str) -> float:
    _, text = s.request("GET", "/metrics")
    return float(next(ln.split()[1] for ln in text.splitlines() if ln.startswith(name + " ")))


def test_multi_turn_reuses_the_prefix_and_answers_the_same(srv: ServerProc) -> None:
    history = "A chat about the sea. User: tell me about waves. Assistant:"
    kv: dict[int, list[int]] = {}  # what each slot holds, computed from the token ids
    for turn in range(4):
        toks = _toks(srv, history)
        cached_before = _metric(srv, "llamacpp:prompt_tokens_cached_total")
        r = _complete(srv, history)
        t, slot = r["timings"], r["id_slot"]
        expect = min(_lcp(kv.get(slot, []), toks), len(toks) - 1)
        assert t["cache_n"] == expect and t["prompt_n"] == len(toks) - expect, (turn, t, expect)
        if turn > 0:
            assert expect >= len(toks) // 2  # the conversation so far really came from the cache
        assert r["tokens_cached"] == len(toks) + len(r["tokens"]) - 1  # prompt + generated but the last
        assert _metric(srv, "llamacpp:prompt_tokens_cached_total") == cached_before + expect
        fresh = _complete(srv, history, cache_prompt=False)
        assert fresh["timings"]["cache_n"] == 0 and fresh["content"] == r["content"]
        kv[slot] = toks + r["tokens"][:-1]
        kv[fresh["id_slot"]] = toks + fresh["tokens"][:-1]
        history += r["content"] + f" User: and then {turn}? Assistant:"


def test_requests_go_to_the_slot_holding_their_prefix(srv: ServerProc) -> None:
    a = "Alpha alpha alpha: a long shared prefix about mountains and rivers and lakes, " * 3
    b = "Beta beta: something else entirely, numbers 1 2 3 4 5 6 7 8 9 10 11 12 13 14, " * 3
    ra, rb = _complete(srv, a), _complete(srv, b)
    assert ra["id_slot"] != rb["id_slot"]  # b went to the least recently used slot, not over a's cache
    for _ in range(2):
        ra2 = _complete(srv, a + " more about the mountains")
        rb2 = _complete(srv, b + " 15 16 17")
        assert ra2["id_slot"] == ra["id_slot"] and rb2["id_slot"] == rb["id_slot"]
        assert ra2["timings"]["cache_n"] >= len(_toks(srv, a)) - 2
        assert rb2["timings"]["cache_n"] >= len(_toks(srv, b)) - 2


def test_diverging_tail_is_removed_and_recomputed(srv: ServerProc) -> None:
    base = "The quick brown fox jumps over the lazy dog while the cat watches from the window sill"
    r1 = _complete(srv, base)
    other = base[:40] + " and then a completely different story begins here"
    r2 = _complete(srv, other, id_slot=r1["id_slot"])
    expect = _lcp(_toks(srv, base) + r1["tokens"][:-1], _toks(srv, other))
    assert r2["timings"]["cache_n"] == expect and 0 < expect < len(_toks(srv, other))
    assert r2["content"] == _complete(srv, other, cache_prompt=False)["content"]
    # the same prompt again: everything but its last token comes from the cache
    r3 = _complete(srv, other, id_slot=r2["id_slot"])
    assert r3["timings"]["cache_n"] == len(_toks(srv, other)) - 1 and r3["content"] == r2["content"]


def test_parallel_conversations_with_cache_equal_no_cache(srv: ServerProc) -> None:
    starts = ["Story one: a ship", "Story two: a castle on a hill", "Story three: the desert at night"]

    def converse(start: str) -> list[tuple[str, str]]:
        history, out = start, []
        for turn in range(3):
            r = _complete(srv, history, n_predict=8)
            out.append((history, r["content"]))
            history += r["content"] + f" Next {turn}:"
        return out

    with ThreadPoolExecutor(3) as ex:
        runs = list(ex.map(converse, starts))
    for run in runs:
        for history, content in run:
            assert _complete(srv, history, n_predict=8, cache_prompt=False)["content"] == content


def test_openai_usage_reports_cached_tokens(srv: ServerProc) -> None:
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    msgs = [{"role": "system", "content": "You are terse and helpful, and you answer in one line."},
            {"role": "user", "content": "Name a color."}]
    r1 = c.chat.completions.create(model="x", messages=msgs, max_tokens=6, **GREEDY)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "Another one."}]
    r2 = c.chat.completions.create(model="x", messages=msgs, max_tokens=6, **GREEDY)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens - 2 <= cached < r2.usage.prompt_tokens
