"""`rapidmoe-cli serve` under hostile or heavy clients, against real server processes: the connection cap, the
header and body deadlines and keep-alive idle timeout, malformed requests answered in JSON, deeply nested JSON, a
shutdown that aborts a running decode, no second status line after an error mid-stream, and many concurrent
streaming clients (a burst beyond the slots waits in the queue, as in llama-server).
"""
from __future__ import annotations

import http.client
import io
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPMessage
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc, read_all, sse_json
from testkit import SANITIZED

from rapidmoe.server import app
from rapidmoe.server.api import serving
from rapidmoe.server.config import ServerConfig
from rapidmoe.server.errors import ApiError


@pytest.fixture(scope="module")
def srv(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """3 connections at most, 1 s for headers, 3 s for a body, 0.5 s keep-alive idle."""
    log = tmp_path_factory.mktemp("server") / "hard.log"
    s = ServerProc(tiny_qwen, "--parallel", "4", "--queue-size", "16", "-c", "4096", "-t", "1",
                   "--max-connections", "3", "--header-timeout", "1", "--body-timeout", "3",
                   "--keepalive-timeout", "0.5", log_path=log)
    yield s
    s.stop()


def good(s: ServerProc) -> None:
    status, body = s.request("POST", "/completion", {"prompt": "Hello", "n_predict": 2})
    assert status == 200 and body["tokens_predicted"] == 2, body


def _wait_connections_closed(s: ServerProc) -> None:
    time.sleep(0.8)  # the server closes idle keep-alive connections after 0.5 s


def test_connection_cap_answers_503(srv: ServerProc) -> None:
    _wait_connections_closed(srv)
    idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
    for sock in idle:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers not finished: each holds a connection
    time.sleep(0.2)
    extra = socket.create_connection(("127.0.0.1", srv.port))
    extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    t0 = time.monotonic()
    answer = read_all(extra)
    assert time.monotonic() - t0 < 2.0  # at once (no thread, no waiting for the idle ones)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"Connection: close" in head, answer
    assert b"\r\nRetry-After: 1\r\n" in head, answer
    assert "too many connections" in json.loads(body)["error"]["message"]
    for sock in idle:
        sock.close()
    _wait_connections_closed(srv)
    good(srv)


def test_header_deadline_stops_a_trickling_client(srv: ServerProc) -> None:
    _wait_connections_closed(srv)
    sock = socket.create_connection(("127.0.0.1", srv.port))
    t0 = time.monotonic()
    sock.sendall(b"GET /health HTTP/1.1\r\n")
    got = b""
    sock.settimeout(0.2)
    for i in range(30):  # a header line every 0.2 s: each byte would reset a plain socket timeout
        try:
            sock.sendall(b"X-Slow-%d: y\r\n" % i)
        except OSError:
            break
        try:
            got += sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            break
        if got:
            break
    got += read_all(sock, 2.0)
    elapsed = time.monotonic() - t0
    assert got.startswith(b"HTTP/1.1 408 ") and 0.9 < elapsed < 4.0, (got, elapsed)
    sock.close()
    good(srv)


def test_keepalive_idle_connection_is_closed(srv: ServerProc) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
    conn.request("GET", "/health")
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Connection") != "close"
    r.read()
    t0 = time.monotonic()
    assert conn.sock is not None
    assert conn.sock.recv(1) == b""  # the server closed the idle connection
    assert 0.4 < time.monotonic() - t0 < 3.0
    conn.close()


def test_header_deadline_ends_with_the_headers(srv: ServerProc) -> None:
    """A body that comes 1.5 s after its headers (past the 1 s header deadline, within --timeout) is read, and
    the answer streams for as long as it takes."""
    _wait_connections_closed(srv)
    body = json.dumps({"prompt": "Once", "n_predict": 500, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
    time.sleep(1.5)
    sock.sendall(body)
    head, _, rest = read_all(sock, 10.0).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert json.loads(rest)["tokens_predicted"] == 500
    sock.close()


def _answer(raw: bytes, port: int) -> tuple[int, dict[str, Any], float]:
    """(status, JSON body, seconds until the server closed) for raw bytes sent on a fresh connection."""
    sock = socket.create_connection(("127.0.0.1", port))
    t0 = time.monotonic()
    sock.sendall(raw)
    data = read_all(sock, 10.0)
    elapsed = time.monotonic() - t0
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 ") and b"application/json" in head, data
    return int(head.split()[1]), json.loads(body), elapsed


MALFORMED = [
    ("garbage", b"hello there\r\n\r\n", 400),
    ("no version (HTTP/0.9)", b"GET /\r\n", 400),
    ("explicit HTTP/0.9 (found by fuzzing: answered without a status line)", b"GET /health HTTP/0.9\r\n\r\n", 400),
    ("TLS hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),
    ("four words", b"GET / HTTP/1.1 extra\r\n\r\n", 400),
    ("bad version", b"GET /health HTTP/7.0\r\n\r\n", 505),
    ("line too long", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
    ("header too long", b"GET /health HTTP/1.1\r\nX-A: " + b"a" * 70000 + b"\r\n\r\n", 431),
    ("unknown method", b"PUT /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 501),
]


@pytest.mark.parametrize("raw,status", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_requests_get_json_errors(srv: ServerProc, raw: bytes, status: int) -> None:
    """http.server answers these itself, with an HTML page (and HTTP/0.9 without a status line after waiting for
    headers): here each is llama-server's JSON error body, at once, and the connection is closed."""
    _wait_connections_closed(srv)
    got, body, elapsed = _answer(raw, srv.port)
    assert got == status and body["error"]["code"] == status and body["error"]["message"], body
    assert elapsed < 1.0  # answered and closed at once (not at the keep-alive or header deadline)
    good(srv)


def test_body_deadline(srv: ServerProc) -> None:
    """A body must arrive whole within --body-timeout (3 s) of its headers: one trickling a byte every 0.4 s (a
    per-read timeout would never fire) gets a JSON 408 at 3 s, not at --timeout (600 s); one whose sender closes
    early gets 400 at once."""
    _wait_connections_closed(srv)
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
    t0 = time.monotonic()
    sock.settimeout(0.4)
    data = b""
    for _ in range(25):
        try:
            sock.sendall(b" ")
            data += sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            break
        if data:
            break
    data += read_all(sock, 2.0)
    elapsed = time.monotonic() - t0
    sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and 2.9 < elapsed < 4.5, (data, elapsed)
    assert json.loads(body)["error"]["message"].startswith("timed out reading the request body (")
    _wait_connections_closed(srv)
    got, r, elapsed = _answer(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro",
                              srv.port)
    assert (got, r["error"]["message"]) == (408, "timed out reading the request body (5 of 100 bytes in 3 s)")
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")
    sock.shutdown(socket.SHUT_WR)
    t0 = time.monotonic()
    head, _, body = read_all(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and time.monotonic() - t0 < 1.0, head
    assert "shorter than Content-Length (5 of 100 bytes)" in json.loads(body)["error"]["message"]
    sock.close()
    good(srv)


@pytest.mark.parametrize("depth", [65, 5000, 200_000])
def test_deep_json_is_400(srv: ServerProc, depth: int) -> None:
    raw = b'{"prompt": "a", "x": ' + b"[" * depth + b"]" * depth + b"}"
    status, r = srv.request("POST", "/completion", raw=raw)
    assert status == 400 and "nested too deeply" in r["error"]["message"], r
    ok = b'{"prompt": "a", "n_predict": 1, "x": ' + b"[" * 60 + b"]" * 60 + b"}"
    assert srv.request("POST", "/completion", raw=ok)[0] == 200
    good(srv)


# ---- many clients ----

def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_many_concurrent_streams_all_complete(tiny_qwen: Path, tmp_path: Path) -> None:
    """24 streaming clients at once on 4 slots (20 wait in the queue): every answer complete, twice; the
    server's memory after the second round is within 16 MiB of the first."""
    s = ServerProc(tiny_qwen, "--parallel", "4", "--queue-size", "32", "-c", "4096", "-t", "1",
                   log_path=tmp_path / "load.log")
    n = 24

    def client(i: int) -> str:
        events = sse_json(s.stream("/v1/completions", {"prompt": f"Client {i} says", "max_tokens": 16,
                                                       "ignore_eos": True, "stream": True, "temperature": 0}))
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 16
        return "".join(e["choices"][0]["text"] for e in events[:-1])

    try:
        rss = []
        texts = []
        for _ in range(2):
            with ThreadPoolExecutor(n) as ex:
                texts.append(list(ex.map(client, range(n))))
            rss.append(_rss_kib(s.proc.pid))
        assert texts[0] == texts[1]  # greedy: the same answers whatever the interleaving
        assert rss[1] - rss[0] < 16 * 1024 or SANITIZED, rss  # AddressSanitizer's quarantine holds freed memory
        _, m = s.request("GET", "/metrics")
        assert f'rapidmoe:http_requests_total{{route="/v1/completions",status="200"}} {2 * n}' in m
    finally:
        s.stop()


def test_burst_beyond_the_slots_waits_in_the_queue(tiny_qwen: Path, tmp_path: Path) -> None:
    """llama-server's default: with -np 2 and no --queue-size, 24 streams at once all wait for a slot and complete
    (the old default of 16 waiting places answered six of them 503 at once)."""
    s = ServerProc(tiny_qwen, "--parallel", "2", "-c", "2048", "-t", "1", log_path=tmp_path / "burst.log")

    def client(i: int) -> int:
        events = sse_json(s.stream("/v1/completions", {"prompt": f"Client {i} says", "max_tokens": 8,
                                                       "ignore_eos": True, "stream": True}))
        assert events[-1] == "[DONE]"
        return int(events[-2]["usage"]["completion_tokens"])

    try:
        with ThreadPoolExecutor(24) as ex:
            assert list(ex.map(client, range(24))) == [8] * 24
        _, m = s.request("GET", "/metrics")
        assert "rapidmoe:requests_rejected_total 0" in m and "rapidmoe:requests_finished_total 24" in m, m
    finally:
        s.stop()


# ---- shutdown ----

def test_shutdown_aborts_a_running_decode(tiny_qwen: Path, tmp_path: Path) -> None:
    """SIGTERM while a 3500-token prompt is in one llama_decode: the decode is aborted through llama.cpp's abort
    callback, the client gets 503, the process exits 0 soon after."""
    s = ServerProc(tiny_qwen, "--parallel", "1", "-c", "8192", "-b", "4096", "-t", "1",
                   log_path=tmp_path / "stop.log")
    prompt = " ".join(["word"] * 3500)
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(s.request, "POST", "/completion", {"prompt": prompt, "n_predict": 4})
        t0 = time.monotonic()
        while not s.request("GET", "/slots")[1][0]["is_processing"]:
            assert time.monotonic() - t0 < 10
            time.sleep(0.005)
        time.sleep(0.05)
        os.kill(s.proc.pid, signal.SIGTERM)
        t_kill = time.monotonic()
        status, body = fut.result(30)
    assert s.proc.wait(30) == 0
    log = s.log()
    s.stop()
    assert status == 503 and "shutting down" in body["error"]["message"], body
    assert s.last_headers["retry-after"] == "1"
    assert "llama_decode aborted" in log, log
    assert time.monotonic() - t_kill < 10


# ---- an error after the headers were sent ----

class _FakeServer:
    def __init__(self) -> None:
        self.state = serving.AppState(ServerConfig(model=Path("m.gguf")))

    def active(self, delta: int) -> None:
        pass


def _handler() -> Any:
    h: Any = app.Handler.__new__(app.Handler)
    h.wfile, h.server = io.BytesIO(), _FakeServer()
    h.request_version, h.command, h.path, h.requestline = "HTTP/1.1", "POST", "/completion", "POST /completion"
    h.headers, h.close_connection, h._sent, h.client_address = HTTPMessage(), False, False, ("127.0.0.1", 1)
    return h


class _Deadlines:
    """The header watchdog as the handler sees it: `fired` when its 408 already went out."""

    def __init__(self, fired: bool) -> None:
        self.fired = fired

    def disarm(self, conn: Any) -> bool:
        return not self.fired


BAD_HEADS = [(b"GET / HTTP/1.1\r\n", b"X: y\r\n" * 101 + b"\r\n", 431), (b"GET / HTTP/2.0\r\n", b"\r\n", 505),
             (b"GET / HTTP/1.1 x\r\n", b"\r\n", 400), (b"GET /\r\n", b"", 400)]


@pytest.mark.parametrize("fired", [False, True])
@pytest.mark.parametrize("line,head,status", BAD_HEADS, ids=[str(s) for *_, s in BAD_HEADS])
def test_no_error_after_the_header_deadline_answered(line: bytes, head: bytes, status: int, fired: bool) -> None:
    """http.server's own errors found while parsing the request line and headers (too many headers, HTTP/2,
    bad syntax, HTTP/0.9) are answered in JSON, unless the header deadline fired first: then its 408 is the
    answer and nothing more is written (never two status lines)."""
    h = _handler()
    h.server.deadlines = _Deadlines(fired)
    h._reading_headers, h.connection = True, socket.socket()  # never connected: only settimeout is called
    h.raw_requestline, h.rfile = line, io.BytesIO(head)
    assert h.parse_request() is False and h.close_connection
    out = h.wfile.getvalue()
    if fired:
        assert out == b""
    else:
        assert out.startswith(b"HTTP/1.1 %d " % status) and b'"error"' in out, out
    assert not h._reading_headers
    h.connection.close()


def _heads_written(code: int) -> list[bytes]:
    """The head of a `code` answer written each way: a route's reply, http.server's send_error, a raw answer."""
    h = _handler()
    h._send(serving.Reply(code, b"{}"))
    h2 = _handler()
    h2.send_error(code, "x")
    heads = [out.partition(b"\r\n\r\n")[0] for out in
             (h.wfile.getvalue(), h2.wfile.getvalue(), app._raw_reply(ApiError(code, "t", "x")))]
    assert all(head.startswith(b"HTTP/1.1 %d " % code) for head in heads), heads
    return heads


def test_every_503_carries_retry_after_once() -> None:
    """However a 503 is written (a route's reply, http.server's send_error, a raw answer where no handler runs)
    it has one `Retry-After`; other statuses have none."""
    for code in (503, 400):
        for head in _heads_written(code):
            assert head.count(b"\r\nRetry-After: 1") == (code == 503), head


def test_every_501_says_do_not_retry() -> None:
    """However a 501 is written (a route's reply, http.server's send_error for an unknown method, a raw answer) it
    carries `x-should-retry: false` once, the header the openai SDK obeys before retrying a 5xx; others do not."""
    for code in (501, 500, 503):
        for head in _heads_written(code):
            assert head.count(b"\r\nx-should-retry: false") == (code == 501), head


def test_error_mid_stream_ends_the_stream_without_a_second_status_line() -> None:
    def chunks() -> Iterator[bytes]:
        yield b"data: {}\n\n"
        raise ValueError("a bug")

    h, aborted = _handler(), []
    h._dispatch = lambda *a: serving.Stream(chunks(), lambda: aborted.append(True))
    h._handle("POST")
    out = h.wfile.getvalue()
    assert out.count(b"HTTP/1.1 ") == 1 and out.startswith(b"HTTP/1.1 200 ")
    assert b'"server_error"' in out and out.endswith(b"0\r\n\r\n") and aborted == [True]
    assert h.close_connection

    h = _handler()

    def fails_after_headers(s: Any) -> int:
        h.send_response(200)
        h.end_headers()
        h._sent = True
        raise RuntimeError("after the headers")

    h._dispatch = lambda *a: serving.Stream(iter(()), lambda: None)
    h._send_stream = fails_after_headers
    h._handle("POST")
    assert h.wfile.getvalue().count(b"HTTP/1.1 ") == 1 and h.close_connection
