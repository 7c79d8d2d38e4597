"""`rapidmoe-cli serve` against real clients: a server process on loopback running the tiny model.

The official `openai` client for the OpenAI routes; raw HTTP for the native routes and the SSE framing;
parallel streams, a full queue, disconnects, every kind of bad input (each followed by a good request), API keys.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from server_proc import ServerProc, sse_json
from testkit import GREEDY

from rapidmoe.server.text import TextAssembler

openai = pytest.importorskip("openai")

TEMPLATE = "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}\n{% endfor %}<<assistant>>"


@pytest.fixture(scope="module")
def templated_model(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template in its GGUF metadata (gguf-py's own metadata copier)."""
    out = tmp_path_factory.mktemp("server") / "tiny-chat.gguf"
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(tiny_qwen), str(out),
                    "--chat-template", TEMPLATE, "--force"], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def server(templated_model: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """4 slots of 512 tokens, a small body limit, 2 s for a body to arrive, the model also known as "tiny"."""
    log = tmp_path_factory.mktemp("server") / "main.log"
    s = ServerProc(templated_model, "--parallel", "4", "--queue-size", "8", "-c", "2048", "--alias", "tiny,zz-other",
                   "--max-body", "65536", "--timeout", "600", "--body-timeout", "2", "-t", "1", log_path=log)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tight(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """1 slot, 1 waiting place, an API key."""
    log = tmp_path_factory.mktemp("server") / "tight.log"
    s = ServerProc(tiny_qwen, "--parallel", "1", "--queue-size", "1", "-c", "1024", "--api-key", "sekret",
                   "-t", "1", log_path=log)
    yield s
    s.stop()


KEY = {"Authorization": "Bearer sekret"}


def client(s: ServerProc, key: str = "none"):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=60)


def good(s: ServerProc, headers: dict[str, str] | None = None) -> None:
    status, body = s.request("POST", "/completion", {"prompt": "Hello", "n_predict": 4}, headers=headers)
    assert status == 200 and body["tokens_predicted"] == 4, body


# ---- pure text handling ----

def test_text_assembler_stops_and_utf8() -> None:
    a = TextAssembler(["STOP", "\n\n"])
    assert a.push(b"ab") == "ab"
    assert a.push(b"cS") == "c"  # "S" might start "STOP": held
    assert a.push(b"T") == ""
    assert a.push(b"x") == "STx"  # it did not
    assert a.push("é".encode()[:1]) == ""  # half a character waits for the rest
    assert a.push("é".encode()[1:] + b"\n") == "é"
    assert a.push(b"\nlater") == "" and a.stopping_word == "\n\n"
    assert a.flush() == ""
    b = TextAssembler([])
    assert b.push(b"\xe2\x82") == "" and b.flush() == "\ufffd"


# ---- endpoints ----

def test_health_models_props(server: ServerProc, templated_model: Path) -> None:
    assert server.request("GET", "/health") == (200, {"status": "ok"})
    for path in ("/v1/models", "/models"):
        status, body = server.request("GET", path)
        assert status == 200 and body["object"] == "list"
        m = body["data"][0]
        assert m["id"] == "tiny" and m["object"] == "model" and m["owned_by"] == "llamacpp"
        assert m["meta"]["n_vocab"] > 1000 and m["meta"]["size"] == templated_model.stat().st_size
    assert [m.id for m in client(server).models.list()] == ["tiny"]
    status, props = server.request("GET", "/props")
    assert status == 200 and props["total_slots"] == 4 and props["chat_template"] == TEMPLATE
    assert props["default_generation_settings"]["n_ctx"] == 512
    assert props["model_path"] == str(templated_model)


def test_openai_completions(server: ServerProc) -> None:
    c = client(server)
    r = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, **GREEDY)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == 5 and r.choices[0].text
    chunks = list(c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, stream=True,
                                       **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.id == chunks[0].id for ch in chunks)


def test_openai_chat_uses_gguf_template(server: ServerProc) -> None:
    c = client(server)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, **GREEDY)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    rendered = "<<system>>Be brief.\n<<user>>Hi there\n<<assistant>>"
    assert server.request("POST", "/apply-template", {"messages": msgs}) == (200, {"prompt": rendered})
    _, tok = server.request("POST", "/tokenize", {"content": rendered, "add_special": True})
    assert r.usage.prompt_tokens == len(tok["tokens"])
    stream = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == r.choices[0].message.content
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 10


def test_chat_roles(server: ServerProc) -> None:
    """OpenAI's roles only: an unknown one (the chat page once sent its error bubbles back as role "error") is a
    400 naming it, before anything is rendered or generated; "developer" renders as "system" (llama.cpp's rule);
    the legacy "function" role is refused by name (400: the client's error, not one to retry), as `functions` is."""
    ok = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
          {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}]
    bad = [*ok, {"role": "error", "content": "Invalid API Key"}, {"role": "user", "content": "again"}]
    for path in ("/v1/chat/completions", "/apply-template"):
        status, r = server.request("POST", path, {"messages": bad, "max_tokens": 1})
        assert status == 400 and r["error"]["type"] == "invalid_request_error", r
        assert r["error"]["message"].startswith("messages[4]: invalid role 'error'"), r
    with pytest.raises(openai.BadRequestError, match="invalid role"):
        client(server).chat.completions.create(model="tiny", messages=bad, max_tokens=1)
    status, r = server.request("POST", "/apply-template", {"messages": [{"role": "developer", "content": "d"}, *ok]})
    assert r == {"prompt": "<<system>>d\n<<system>>s\n<<user>>u\n<<assistant>>a\n<<tool>>t\n<<assistant>>"}, r
    status, r = server.request("POST", "/v1/chat/completions",
                               {"messages": [*ok, {"role": "function", "name": "f", "content": "1"}]})
    assert status == 400 and "role 'function'" in r["error"]["message"], r
    good(server)


def test_native_completion_and_sse_framing(server: ServerProc) -> None:
    body = {"prompt": "The quick brown fox", "n_predict": 8, "return_tokens": True, **GREEDY}
    status, r = server.request("POST", "/completion", body)
    assert status == 200 and r["stop"] is True and r["stop_type"] == "limit" and r["tokens_predicted"] == 8
    assert len(r["tokens"]) == 8 and r["model"] == "tiny" and r["generation_settings"]["n_predict"] == 8
    t = r["timings"]
    assert t["prompt_n"] + t["cache_n"] == r["tokens_evaluated"] and t["predicted_n"] == 8 and t["predicted_ms"] > 0
    events = sse_json(server.stream("/completion", {**body, "stream": True}))
    assert "[DONE]" not in events  # the native route ends with its stop event, as llama-server's
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == r["content"]
    assert events[-1]["timings"]["predicted_n"] == 8
    raw = list(server.stream("/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True}))
    assert raw[-1] == b"data: [DONE]" and all(ev.startswith(b"data: {") for ev in raw[:-1])


def test_stop_strings_and_eos(server: ServerProc) -> None:
    _, r = server.request("POST", "/completion", {"prompt": "The quick brown fox", "n_predict": 8, **GREEDY})
    word = r["content"][3:6]
    status, s = server.request("POST", "/completion", {"prompt": "The quick brown fox", "n_predict": 8,
                                                       "stop": [word], **GREEDY})
    assert status == 200 and s["stop_type"] == "word" and s["stopping_word"] == word
    assert s["content"] == r["content"][:r["content"].index(word)]
    status, z = server.request("POST", "/completion", {"prompt": "abc", "n_predict": 0})
    assert status == 200 and z["tokens_predicted"] == 0 and z["content"] == ""


def test_tokenize_detokenize(server: ServerProc) -> None:
    status, r = server.request("POST", "/tokenize", {"content": "Hello world"})
    assert status == 200 and len(r["tokens"]) == 2
    _, with_bos = server.request("POST", "/tokenize", {"content": "Hello world", "add_special": True})
    assert len(with_bos["tokens"]) == 3
    assert server.request("POST", "/detokenize", {"tokens": r["tokens"]}) == (200, {"content": "Hello world"})
    _, pieces = server.request("POST", "/tokenize", {"content": "Hello world", "with_pieces": True})
    assert "".join(p["piece"] for p in pieces["tokens"]) == "Hello world"


def test_metrics_and_slots(server: ServerProc) -> None:
    good(server)
    status, text = server.request("GET", "/metrics")
    assert status == 200
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["llamacpp:prompt_tokens_total"] > 0 and values["llamacpp:tokens_predicted_total"] >= 4
    assert values['rapidmoe:http_requests_total{route="/completion",status="200"}'] >= 1
    assert values['rapidmoe:llama_path_seconds_total{path="prompt"}'] > 0
    status, slots = server.request("GET", "/slots")
    assert status == 200 and len(slots) == 4 and {s["id"] for s in slots} == {0, 1, 2, 3}


# ---- concurrency, queue, disconnects ----

def _stream_text(s: ServerProc, prompt: str, n: int) -> str:
    events = sse_json(s.stream("/v1/completions", {"prompt": prompt, "max_tokens": n, "stream": True, **GREEDY}))
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    return "".join(e["choices"][0]["text"] for e in events[:-1])


def test_parallel_streams_are_complete_and_independent(server: ServerProc) -> None:
    prompts = ["Once upon a time", "The capital of France", "def main():", "1, 2, 3, 4,", "Dear Sir", "Hello"]
    alone = {p: _stream_text(server, p, 24) for p in prompts}
    _, before = server.request("GET", "/metrics")
    with ThreadPoolExecutor(len(prompts)) as ex:
        together = dict(zip(prompts, ex.map(lambda p: _stream_text(server, p, 24), prompts), strict=True))
    assert together == alone  # greedy: each stream gets exactly its own answer
    assert len(set(together.values())) == len(prompts)
    _, after = server.request("GET", "/metrics")
    busy = [float(line.split()[1]) for line in after.splitlines() if line.startswith("llamacpp:n_busy_slots_per")]
    busy0 = [float(line.split()[1]) for line in before.splitlines() if line.startswith("llamacpp:n_busy_slots_per")]
    assert busy[0] > busy0[0]  # several slots really shared decode calls


def _open_stream(s: ServerProc, n_predict: int) -> socket.socket:
    """A raw streaming /completion that holds its slot until the socket is closed (or n_predict is reached)."""
    sock = socket.create_connection(("127.0.0.1", s.port))
    body = json.dumps({"prompt": "Once upon a time", "n_predict": n_predict, "ignore_eos": True,
                       "stream": True}).encode()
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
    return sock


def _wait_idle(s: ServerProc, timeout: float = 5.0) -> list[dict]:
    t0 = time.monotonic()
    while True:
        _, slots = s.request("GET", "/slots", headers=KEY)
        if not any(x["is_processing"] for x in slots) or time.monotonic() - t0 > timeout:
            return slots
        time.sleep(0.05)


def test_queue_full_answers_503_fast(tight: ServerProc) -> None:
    first = _open_stream(tight, 100000)  # holds the only slot (until its context is full) ...
    assert b" 200 " in first.recv(4096)
    second = _open_stream(tight, 100000)  # ... this one takes the only waiting place
    time.sleep(0.3)
    t0 = time.monotonic()
    status, body = tight.request("POST", "/completion", {"prompt": "x", "n_predict": 2}, headers=KEY)
    assert status == 503 and body["error"]["type"] == "unavailable_error", body
    assert tight.last_headers["retry-after"] == "1"
    assert time.monotonic() - t0 < 1.0
    _, text = tight.request("GET", "/metrics", headers=KEY)
    assert "rapidmoe:requests_rejected_total 1" in text
    first.close()
    assert b" 200 " in second.recv(4096)  # the waiting one got the slot
    second.close()
    _wait_idle(tight)
    good(tight, KEY)


def test_disconnect_frees_the_slot(tight: ServerProc) -> None:
    sock = _open_stream(tight, 100000)
    assert b" 200 " in sock.recv(4096)
    sock.close()
    slots = _wait_idle(tight)
    assert not slots[0]["is_processing"]
    good(tight, KEY)
    assert "client gone" in tight.log()


def test_disconnect_without_streaming_frees_the_slot(tight: ServerProc) -> None:
    sock = socket.create_connection(("127.0.0.1", tight.port))
    body = json.dumps({"prompt": "Once upon a time", "n_predict": 100000, "ignore_eos": True}).encode()
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    time.sleep(0.3)
    _, slots = tight.request("GET", "/slots", headers=KEY)
    assert slots[0]["is_processing"]
    sock.close()
    assert not _wait_idle(tight, 3.0)[0]["is_processing"]
    good(tight, KEY)


def test_slow_client_times_out(server: ServerProc) -> None:
    """A body cut short is answered 408 (JSON) at --body-timeout (2 s), not at --timeout (600 s, for writes)."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    sock.settimeout(10)
    t0 = time.monotonic()
    data = b""
    while chunk := sock.recv(4096):  # the server closes the connection after its answer
        data += chunk
    assert 1.8 < time.monotonic() - t0 < 5
    head, _, body = data.partition(b"\r\n\r\n")
    assert b" 408 " in head.split(b"\r\n")[0] and b"Connection: close" in head, data
    assert json.loads(body)["error"]["message"] == "timed out reading the request body (1 of 100 bytes in 2 s)"
    sock.close()
    good(server)


# ---- bad input: a 4xx with llama-server's error body, then the server still works ----

BAD = [
    ("malformed json", "/completion", b'{"prompt": "a", ', 400),
    ("body not an object", "/completion", b'["a"]', 400),
    ("empty body", "/v1/completions", b"", 400),
    ("prompt wrong type", "/completion", {"prompt": 5}, 400),
    ("prompt missing", "/v1/completions", {"max_tokens": 3}, 400),
    ("temperature wrong type", "/completion", {"prompt": "a", "temperature": "hot"}, 400),
    ("n_predict bool", "/completion", {"prompt": "a", "n_predict": True}, 400),
    ("stream wrong type", "/completion", {"prompt": "a", "stream": "yes"}, 400),
    ("negative n_predict", "/completion", {"prompt": "a", "n_predict": -5}, 400),
    ("negative max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": -2}, 400),
    ("huge max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": 2**40}, 400),
    ("huge float n_predict", "/completion", {"prompt": "a", "n_predict": 1e300}, 400),
    ("prompt longer than context", "/completion", {"prompt": "word " * 2000}, 400),
    ("token id out of range", "/completion", {"prompt": [1, 10**9]}, 400),
    ("invalid utf-8", "/completion", b'{"prompt": "\xff\xfe abc"}', 400),
    ("lone surrogate", "/completion", b'{"prompt": "\\ud800"}', 400),
    ("messages wrong type", "/v1/chat/completions", {"messages": "hi"}, 400),
    ("message without content", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400),
    ("oversized body", "/completion", {"prompt": "a" * 70000}, 413),
    ("detokenize bad ids", "/detokenize", {"tokens": ["a"]}, 400),
    ("unknown route", "/v2/nothing", {}, 404),
]


@pytest.mark.parametrize("name,path,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_4xx_then_good_request_works(server: ServerProc, name: str, path: str, body: object,
                                                  status: int) -> None:
    raw = body if isinstance(body, bytes) else None
    got, r = server.request("POST", path, None if raw is not None else body, raw=raw)
    assert got == status, r
    assert set(r["error"]) >= {"code", "message", "type"} and r["error"]["code"] == status, r
    if name == "prompt longer than context":
        assert r["error"]["type"] == "exceed_context_size_error" and r["error"]["n_ctx"] == 512
    good(server)


def test_api_key(tight: ServerProc) -> None:
    assert tight.request("GET", "/health")[0] == 200  # public, as in llama-server
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret-and-more"}):
        status, body = tight.request("POST", "/completion", {"prompt": "a", "n_predict": 1}, headers=headers)
        assert status == 401 and body == {"error": {"code": 401, "message": "Invalid API Key",
                                                    "type": "authentication_error"}}
    assert tight.request("GET", "/v1/models")[0] == 401
    with pytest.raises(openai.AuthenticationError):
        client(tight, "wrong").completions.create(model="x", prompt="a", max_tokens=1)
    r = client(tight, "sekret").completions.create(model="tiny-qwen3moe-f16", prompt="a", max_tokens=2)
    assert r.usage.completion_tokens == 2  # the file's stem is a model name too
    assert tight.request("GET", "/v1/models", headers={"X-Api-Key": "sekret"})[0] == 200
    good(tight, KEY)


# ---- split routing and UMIA policy: what /metrics reports comes from the engine's counters ----

def test_split_policy_metrics(make_split, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from rapidmoe.umia.policy import Policy  # noqa: PLC0415 - only this test needs it

    _, wq, wr = make_split("qwen3moe")
    policy = Policy.fixed(1).save(tmp_path / "r1.json")
    s = ServerProc(wq, "--residual", str(wr), "--policy", str(policy), "-t", "1", "-c", "1024",
                   log_path=tmp_path / "split.log")
    try:
        good(s)
        _, props = s.request("GET", "/props")
        assert props["rapidmoe"]["policy"] == str(policy)
        _, text = s.request("GET", "/metrics")
        v = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line[:1] not in "#"}
        k = v["rapidmoe:moe_expert_slots_total"] / (v["rapidmoe:moe_critical_slots_total"] or 1)
        assert v["rapidmoe:moe_critical_slots_total"] > 0 and k == int(k) > 1  # r = 1 of top-k, every token
        assert v["rapidmoe:critical_expert_fraction"] == pytest.approx(1 / k, rel=1e-4)
        assert v['rapidmoe:moe_weight_bytes_total{path="wr"}'] > 0
    finally:
        s.stop()


def test_bad_policy_is_one_line_error(tiny_qwen: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"r_min": "two"}')
    for extra in (["--policy", str(bad)], ["--residual", str(tiny_qwen), "--policy", str(bad)]):
        r = subprocess.run([sys.executable, "-m", "rapidmoe.cli", "serve", str(tiny_qwen), "--port", "0", *extra],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, r.stderr
        err = [line for line in r.stderr.splitlines() if line.startswith("rapidmoe-cli: error:")]
        assert len(err) == 1 and ("policy" in err[0] or "r_min" in err[0]), r.stderr


def test_port_in_use_is_one_line_error(tiny_qwen: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "rapidmoe.cli", "serve", str(tiny_qwen), "--port", str(port)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"rapidmoe-cli: error: cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
