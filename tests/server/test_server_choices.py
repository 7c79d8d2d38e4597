"""Several prompts per request and `n` > 1 on `rapidmoe-cli serve`: one choice per prompt and per completion,
indexed prompt-major as OpenAI does (index = prompt_i * n + j), streamed with each chunk's index, usage summed.

The reference for every choice is the same server answering that prompt alone (greedy, or with the seed the
choice is documented to use: seed + j), so a merged prompt or a wrong index cannot pass.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc, sse_json, stock_server_bin
from testkit import GREEDY, ROOT

openai = pytest.importorskip("openai")

# Sampled answers are compared token for token only when computed the same way: one slot, whole prompt in one
# batch (logits of a sequence batched with others, or of a prompt partly reused from the KV, differ in the last
# bits, enough to move a draw at a high temperature).
SAME = {"id_slot": 0, "cache_prompt": False}
# Greedy answers too: on the synthetic model near-ties are common, and the last bits flip the argmax. Choices run
# one after another in slot 0, each exactly as the same prompt sent alone.
EXACT = {**GREEDY, **SAME}
MSGS = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def srv(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    log = tmp_path_factory.mktemp("server") / "choices.log"
    s = ServerProc(tiny_qwen, "--parallel", "3", "-c", "3072", "-t", "1", log_path=log)
    yield s
    s.stop()


def ok(s: ServerProc, path: str, body: dict[str, Any]) -> Any:
    status, r = s.request("POST", path, body)
    assert status == 200, r
    return r


def alone(s: ServerProc, prompt: Any, **kw: Any) -> str:
    """The text the server answers for this one prompt."""
    r = ok(s, "/v1/completions", {"prompt": prompt, **kw})
    assert len(r["choices"]) == 1
    return str(r["choices"][0]["text"])


def n_tokens(s: ServerProc, text: str) -> int:
    return len(ok(s, "/tokenize", {"content": text, "add_special": True})["tokens"])


# ---- several prompts ----

def test_list_of_prompts_is_one_choice_each(srv: ServerProc) -> None:
    """The issue's case: ["The cat", "Once upon"] was answered as the one prompt "The catOnce upon"."""
    kw = {"max_tokens": 4, "ignore_eos": True, **EXACT}
    r = ok(srv, "/v1/completions", {"prompt": ["The cat", "Once upon"], **kw})
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert [c["text"] for c in r["choices"]] == [alone(srv, "The cat", **kw), alone(srv, "Once upon", **kw)]
    assert r["usage"]["completion_tokens"] == 8
    assert r["usage"]["prompt_tokens"] == n_tokens(srv, "The cat") + n_tokens(srv, "Once upon")
    assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + 8


def test_token_lists_and_mixed_prompts(srv: ServerProc) -> None:
    """OpenAI's and llama-server's prompt forms: token ids, a list of token-id lists, strings mixed with id lists
    and llama-server's {"prompt_string"} object; an array holding any integer stays ONE prompt."""
    kw = {"max_tokens": 3, "ignore_eos": True, **EXACT}
    ids = ok(srv, "/tokenize", {"content": "Once upon", "add_special": True})["tokens"]
    cat = ok(srv, "/tokenize", {"content": "The cat", "add_special": True})["tokens"]
    once, the_cat = alone(srv, ids, **kw), alone(srv, cat, **kw)
    assert alone(srv, "Once upon", **kw) == once  # the same tokens, however given
    cases = [([ids, cat], [once, the_cat]), (["Once upon", cat], [once, the_cat]),
             ([cat, {"prompt_string": "Once upon"}], [the_cat, once]),
             ([[*ids], "The cat", ids], [once, the_cat, once])]
    for prompt, want in cases:
        r = ok(srv, "/v1/completions", {"prompt": prompt, **kw})
        assert [c["text"] for c in r["choices"]] == want, prompt
        assert [c["index"] for c in r["choices"]] == list(range(len(want)))
    one = ok(srv, "/v1/completions", {"prompt": [*ids, "The cat"], **kw})  # ids mixed with a string: one prompt
    assert len(one["choices"]) == 1
    plain = ok(srv, "/tokenize", {"content": "The cat", "add_special": False})["tokens"]
    assert one["usage"]["prompt_tokens"] == len(ids) + len(plain)  # no BOS inside: it starts with ids


def test_openai_client_batch(srv: ServerProc) -> None:
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    r = c.completions.create(model="x", prompt=["The cat", "Once upon", "A"], max_tokens=2, temperature=0,
                           extra_body=SAME)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    want = [alone(srv, p, max_tokens=2, **EXACT) for p in ("The cat", "Once upon", "A")]
    assert [ch.text for ch in r.choices] == want


def test_native_completion_answers_a_list(srv: ServerProc) -> None:
    """/completion: several prompts answer a list of results, each with its index (llama-server's shape); one
    prompt answers the object."""
    kw = {"n_predict": 3, "ignore_eos": True, **EXACT}
    r = ok(srv, "/completion", {"prompt": ["The cat", "Once upon"], **kw})
    assert isinstance(r, list) and [x["index"] for x in r] == [0, 1]
    for x, p in zip(r, ("The cat", "Once upon"), strict=True):
        single = ok(srv, "/completion", {"prompt": p, **kw})
        assert isinstance(single, dict) and single["index"] == 0
        assert x["content"] == single["content"] and x["prompt"] == p and x["tokens_predicted"] == 3
    assert isinstance(ok(srv, "/completion", {"prompt": ["The cat"], **kw}), dict)  # a batch of one


# ---- n > 1 ----

def test_n_choices_are_prompt_major_with_seed_plus_j(srv: ServerProc) -> None:
    """n = 3 over two prompts: choice i*3+j is prompt i sampled with seed + j."""
    kw = {"max_tokens": 6, "ignore_eos": True, "temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **SAME}
    r = ok(srv, "/v1/completions", {"prompt": ["The cat", "Once upon"], "n": 3, "seed": 11, **kw})
    assert [c["index"] for c in r["choices"]] == list(range(6))
    for i, p in enumerate(("The cat", "Once upon")):
        texts = [r["choices"][i * 3 + j]["text"] for j in range(3)]
        assert texts == [alone(srv, p, seed=11 + j, **kw) for j in range(3)]
    assert len({r["choices"][j]["text"] for j in range(3)}) > 1  # the completions of one prompt differ
    assert r["usage"]["completion_tokens"] == 36
    again = ok(srv, "/v1/completions", {"prompt": "The cat", "n_cmpl": 2, "seed": 11, **kw})  # llama-server's name
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in r["choices"][:2]]


def test_chat_n(srv: ServerProc) -> None:
    kw = {"messages": MSGS, "max_tokens": 5, "temperature": 1.5, "top_k": 0, "min_p": 0.0, "seed": 3,
          "reasoning_format": "none", **SAME}
    r = ok(srv, "/v1/chat/completions", {**kw, "n": 2})
    assert [c["index"] for c in r["choices"]] == [0, 1]
    for j, c in enumerate(r["choices"]):
        single = ok(srv, "/v1/chat/completions", {**kw, "seed": 3 + j})
        assert c["message"] == single["choices"][0]["message"] and c["message"]["role"] == "assistant"
    assert r["usage"]["completion_tokens"] == 10
    assert r["usage"]["prompt_tokens"] == 2 * single["usage"]["prompt_tokens"]


def test_n_with_one_forced_slot_does_not_lock_up(srv: ServerProc) -> None:
    """llama-server's test_chat_completions_multiple_choices: n = 2 with id_slot 0 runs one after the other."""
    for _ in range(2):
        r = ok(srv, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 4, "n": 2, "id_slot": 0,
                                             "ignore_eos": True})
        assert len(r["choices"]) == 2 and all(c["finish_reason"] == "length" for c in r["choices"])


def _hold_slot(s: ServerProc, slot: int) -> tuple[socket.socket, int]:
    """A streamed request that keeps `slot` busy until its context is full or the socket closes, and its task id."""
    body = json.dumps({"prompt": "a", "n_predict": 100000, "ignore_eos": True, "stream": True,
                       "id_slot": slot}).encode()
    sock = socket.create_connection(("127.0.0.1", s.port))
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
    assert b" 200 " in sock.recv(4096)
    state = s.request("GET", "/slots")[1][slot]
    assert state["is_processing"]
    return sock, state["id_task"]


def test_a_request_pinned_to_a_busy_slot_does_not_hold_up_the_queue(srv: ServerProc) -> None:
    """Slot 0 busy, a request for slot 0 with n = 4 waits for it (four generations in a row there); a request
    behind it that can take any slot starts at once in a free one instead of waiting behind all four."""
    hold, task = _hold_slot(srv, 0)
    with ThreadPoolExecutor(1) as ex:
        try:
            pinned = ex.submit(srv.request, "POST", "/v1/completions",
                               {"prompt": "b", "max_tokens": 2, "n": 4, "id_slot": 0})
            t0 = time.monotonic()
            while "llamacpp:requests_deferred 4" not in srv.request("GET", "/metrics")[1]:  # all four queued
                assert time.monotonic() - t0 < 10
                time.sleep(0.01)
            status, r = srv.request("POST", "/v1/completions", {"prompt": "c", "max_tokens": 2})
            assert status == 200 and len(r["choices"]) == 1, r
            assert srv.request("GET", "/slots")[1][0]["id_task"] == task  # answered while slot 0 was still held
            assert not pinned.done()
        finally:
            hold.close()
        status, r = pinned.result(60)
    assert status == 200 and [c["index"] for c in r["choices"]] == [0, 1, 2, 3], r


def test_queue_timeout_bounds_only_the_wait_for_a_first_choice(tiny_qwen: Path, tmp_path: Path) -> None:
    """--queue-timeout 0.5 on one slot: n = 2 runs its choices one after the other, the second starting well
    past 0.5 s (a request being answered is not timed out), while a request that waits 0.5 s without any of its
    choices started gets 503 with Retry-After."""
    s = ServerProc(tiny_qwen, "--parallel", "1", "-c", "4096", "-t", "1", "--queue-timeout", "0.5",
                   log_path=tmp_path / "queue.log")
    try:
        body = {"prompt": "a", "max_tokens": 1500, "ignore_eos": True, "n": 2}
        with ThreadPoolExecutor(1) as ex:
            t0 = time.monotonic()
            long = ex.submit(s.request, "POST", "/v1/completions", body)
            while not (slot := s.request("GET", "/slots")[1][0])["is_processing"]:
                assert time.monotonic() - t0 < 10
                time.sleep(0.01)
            first = slot["id_task"]
            status, r = s.request("POST", "/v1/completions", {"prompt": "b", "max_tokens": 2})
            assert status == 503 and "timed out waiting" in r["error"]["message"], r
            assert s.last_headers["retry-after"] == "1"
            while s.request("GET", "/slots")[1][0]["id_task"] == first:  # the second choice has the next task id
                time.sleep(0.01)
            assert time.monotonic() - t0 > 0.5, "the first choice ended within the queue timeout: test too short"
            status, r = long.result(60)
        assert status == 200, r
        assert [(c["index"], c["finish_reason"]) for c in r["choices"]] == [(0, "length"), (1, "length")]
        assert r["usage"]["completion_tokens"] == 3000
    finally:
        s.stop()


FORCED = ('<think>\nThe user asks.\n</think>\n\nLet me check.\n<tool_call>\n'
          '{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>')
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}}


def test_chat_n_parses_each_choice(tiny_qwen: Path, tmp_path: Path) -> None:
    """Reasoning and tool calls are parsed per choice (Qwen3's real template, the answer forced by a grammar),
    whole and streamed."""
    template = ROOT / "vendor/llama.cpp/models/templates/Qwen-Qwen3-0.6B.jinja"
    model = tmp_path / "qwen3.gguf"
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(tiny_qwen), str(model),
                    "--chat-template", template.read_text(), "--force"], check=True, capture_output=True)
    s = ServerProc(model, "--parallel", "2", "-c", "2048", "-t", "1", log_path=tmp_path / "qwen3.log")
    try:
        body = {"messages": MSGS, "tools": [TIME_TOOL], "n": 2, "max_tokens": 100,
                "grammar": "root ::= " + json.dumps(FORCED)}
        r = ok(s, "/v1/chat/completions", body)
        assert [c["index"] for c in r["choices"]] == [0, 1]
        for c in r["choices"]:
            m = c["message"]
            assert (c["finish_reason"], m["reasoning_content"], m["content"]) == ("tool_calls", "The user asks.",
                                                                                 "Let me check.")
            assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in m["tool_calls"]] == [
                ("get_time", {"zone": 1})]
        events = sse_json(s.stream("/v1/chat/completions", {**body, "stream": True}))
        got: dict[int, dict[str, Any]] = {}
        for e in events[:-1]:
            for c in e["choices"]:
                g = got.setdefault(c["index"], {"reasoning": "", "content": "", "calls": [], "finish": []})
                g["reasoning"] += c["delta"].get("reasoning_content") or ""
                g["content"] += c["delta"].get("content") or ""
                g["calls"] += [t["function"]["name"] for t in c["delta"].get("tool_calls") or []]
                g["finish"] += [c["finish_reason"]] if c["finish_reason"] else []
        want = {"reasoning": "The user asks.", "content": "Let me check.", "calls": ["get_time"],
                "finish": ["tool_calls"]}
        assert got == {0: want, 1: want}
    finally:
        s.stop()


# ---- streaming ----

def _by_index(events: list[Any], key: str) -> tuple[dict[int, str], dict[int, list[str]]]:
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for e in events:
        if e == "[DONE]" or e is None:  # stock llama-server sends a `data: null` event between prompts
            continue
        for c in e["choices"]:
            piece = c["text"] if key == "text" else (c["delta"].get(key) or "")
            texts[c["index"]] = texts.get(c["index"], "") + piece
            if c["finish_reason"] is not None:
                finishes.setdefault(c["index"], []).append(c["finish_reason"])
    return texts, finishes


def test_streamed_choices_carry_their_index(srv: ServerProc) -> None:
    body = {"prompt": ["The cat", "Once upon"], "n": 2, "max_tokens": 6, "ignore_eos": True, **EXACT}
    whole = ok(srv, "/v1/completions", body)
    events = sse_json(srv.stream("/v1/completions", {**body, "stream": True}))
    assert events[-1] == "[DONE]"
    texts, finishes = _by_index(events, "text")
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert finishes == {i: ["length"] for i in range(4)}


def test_streamed_completions_with_usage(srv: ServerProc) -> None:
    """`stream_options.include_usage` on /v1/completions as in chat (OpenAI answers both so): one chunk with empty
    `choices` and the usage summed over every choice, last before [DONE]; none without it."""
    body = {"prompt": ["The cat", "Once upon"], "n": 2, "max_tokens": 3, "ignore_eos": True, "stream": True, **GREEDY}
    prompt_tokens = 2 * (n_tokens(srv, "The cat") + n_tokens(srv, "Once upon"))
    events = sse_json(srv.stream("/v1/completions", {**body, "stream_options": {"include_usage": True}}))
    assert events[-1] == "[DONE]" and events[-2]["choices"] == [] and events[-2]["object"] == "text_completion"
    usage = events[-2]["usage"]
    assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        "prompt_tokens": prompt_tokens, "completion_tokens": 12, "total_tokens": prompt_tokens + 12}
    assert all(e["choices"] for e in events[:-2])
    _, finishes = _by_index(events[:-2], "text")
    assert finishes == {i: ["length"] for i in range(4)}
    plain = sse_json(srv.stream("/v1/completions", body))
    assert plain[-1] == "[DONE]" and all(e["choices"] for e in plain[:-1])
    status, r = srv.request("POST", "/v1/completions", {**body, "stream_options": 5})
    assert status == 400 and "stream_options" in r["error"]["message"], r


def test_streamed_chat_n_with_usage(srv: ServerProc) -> None:
    body = {"messages": MSGS, "n": 3, "max_tokens": 5, "ignore_eos": True, "reasoning_format": "none", **EXACT}
    whole = ok(srv, "/v1/chat/completions", body)
    events = sse_json(srv.stream("/v1/chat/completions", {**body, "stream": True,
                                                          "stream_options": {"include_usage": True}}))
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    usage = events[-2]["usage"]  # one usage chunk, summed over the choices, at the end
    assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        "prompt_tokens": whole["usage"]["prompt_tokens"], "completion_tokens": 15,
        "total_tokens": whole["usage"]["prompt_tokens"] + 15}
    assert sum("usage" in e for e in events[:-1]) == 1
    texts, finishes = _by_index(events[:-2], "content")
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}
    roles = [c["index"] for e in events[:-2] for c in e["choices"] if c["delta"].get("role")]
    assert sorted(roles) == [0, 1, 2]  # each choice opens with its role delta


def test_streamed_native_list(srv: ServerProc) -> None:
    body = {"prompt": ["The cat", "Once upon"], "n_predict": 4, "ignore_eos": True, **EXACT}
    whole = ok(srv, "/completion", body)
    events = sse_json(srv.stream("/completion", {**body, "stream": True}))
    texts = {0: "", 1: ""}
    for e in events:
        texts[e["index"]] += e["content"]
    assert [texts[0], texts[1]] == [x["content"] for x in whole]
    assert sorted(e["index"] for e in events if e["stop"]) == [0, 1]


def test_client_leaving_cancels_every_choice(srv: ServerProc) -> None:
    body = json.dumps({"prompt": ["a", "b", "c"], "n_predict": 100000, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
    assert b" 200 " in sock.recv(4096)
    time.sleep(0.3)
    assert all(x["is_processing"] for x in srv.request("GET", "/slots")[1])
    sock.close()
    t0 = time.monotonic()
    while any(x["is_processing"] for x in srv.request("GET", "/slots")[1]):
        assert time.monotonic() - t0 < 5
        time.sleep(0.05)


# ---- refused ----

BAD = [
    ({"prompt": "a", "n": 0}, 400, '"n" must be in [1, 128]'),
    ({"prompt": "a", "n": 129}, 400, '"n" must be in [1, 128]'),
    ({"prompt": "a", "n": 1.5}, 400, '"n" must be an integer'),
    ({"prompt": []}, 400, '"prompt" must not be empty'),
    ({"prompt": ["a", 5.5]}, 400, '"prompt[1]"'),
    ({"prompt": ["a", []]}, 400, '"prompt[1]"'),
    ({"prompt": ["a", {"text": "b"}]}, 400, "prompt_string"),
    ({"prompt": [{"prompt_string": "a", "multimodal_data": ["AAAA"]}]}, 400, "multimodal"),
    ({"prompt": ["a"] * 300, "n": 4}, 400, "at most 1024 per request"),
    ({"prompt": ["a", "word " * 2000]}, 400, "exceeds the available context size"),
]


@pytest.mark.parametrize("body,status,msg", BAD, ids=[b[2] for b in BAD])
def test_bad_prompts_and_n_are_refused(srv: ServerProc, body: dict[str, Any], status: int, msg: str) -> None:
    for path in ("/v1/completions", "/completion"):
        got, r = srv.request("POST", path, body)
        assert got == status and msg in r["error"]["message"], (path, r)
    assert srv.request("GET", "/slots")[1][0]["is_processing"] is False  # nothing was started


# ---- the same requests to stock llama-server of the same pin ----

@pytest.fixture(scope="module")
def stock(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    bin_dir = stock_server_bin()
    s = ServerProc(tiny_qwen, "-m", str(tiny_qwen), "--parallel", "3", "-c", "3072", "-t", "1", "-tb", "1",
                   "--no-ui", "--cache-ram", "0", cmd=[str(bin_dir / "llama-server")],
                   log_path=tmp_path_factory.mktemp("server") / "stock.log", ready_timeout=120)
    yield s
    s.stop()


def _shape(r: Any) -> Any:
    """What must agree with llama-server: the choices (or results) in order, each with its index, text, finish."""
    if isinstance(r, list) or "content" in r:  # native: a list of results, or one result
        return [(x["index"], x["content"], x["tokens_predicted"], x["stop_type"]) for x in (r if isinstance(r, list)
                                                                                          else [r])]
    return [(c["index"], c.get("text", c.get("message", {}).get("content")), c["finish_reason"])
            for c in r["choices"]]


STOCK_CASES = [
    ("/v1/completions", {"prompt": ["The cat", "Once upon"], "max_tokens": 4}),
    ("/v1/completions", {"prompt": ["The cat", "Once upon"], "n": 3, "max_tokens": 3}),
    ("/v1/completions", {"prompt": [[9707, 1879], "The cat"], "max_tokens": 3}),
    ("/v1/completions", {"prompt": [9707, 1879, "The cat"], "max_tokens": 3}),  # ids mixed with text: one prompt
    ("/completion", {"prompt": ["The cat", {"prompt_string": "Once upon"}], "n_predict": 3}),
    ("/completion", {"prompt": ["The cat"], "n_predict": 3}),  # a batch of one: the object
    ("/completion", {"prompt": "The cat", "n_cmpl": 2, "n_predict": 3}),
]


@pytest.mark.stock
@pytest.mark.parametrize("path,body", STOCK_CASES, ids=[f"{p} {json.dumps(b['prompt'])[:30]}" for p, b in STOCK_CASES])
def test_choices_match_stock_llama_server(srv: ServerProc, stock: ServerProc, path: str, body: dict[str, Any]) -> None:
    """Greedy, whole answers: the same number of choices, in the same order, with the same indices and texts."""
    body = {**body, "ignore_eos": True, "cache_prompt": False, **GREEDY}
    ours, theirs = ok(srv, path, body), ok(stock, path, body)
    assert _shape(ours) == _shape(theirs)
    if isinstance(ours, dict) and "usage" in ours:  # llama-server reports the first choice's usage, we sum
        n = len(ours["choices"])
        assert ours["usage"]["completion_tokens"] == n * theirs["usage"]["completion_tokens"]


@pytest.mark.stock
def test_streamed_choices_match_stock_llama_server(srv: ServerProc, stock: ServerProc) -> None:
    body = {"prompt": ["The cat", "Once upon"], "n": 2, "max_tokens": 4, "stream": True, "ignore_eos": True,
            "cache_prompt": False, **GREEDY}
    got = [_by_index(sse_json(s.stream("/v1/completions", body)), "text") for s in (srv, stock)]
    assert got[0] == got[1] and got[0][1] == {i: ["length"] for i in range(4)}


@pytest.mark.stock
def test_unknown_role_where_stock_renders_it(srv: ServerProc, stock: ServerProc) -> None:
    """The documented difference: the pinned llama-server answers a message with role "error" (200), OpenAI and
    this server refuse it (400)."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "error", "content": "Invalid API Key"}]
    body = {"messages": msgs, "max_tokens": 1}
    assert stock.request("POST", "/v1/chat/completions", body)[0] == 200
    status, r = srv.request("POST", "/v1/chat/completions", body)
    assert status == 400 and "invalid role 'error'" in r["error"]["message"], r
