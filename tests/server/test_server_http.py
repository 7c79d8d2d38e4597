"""HTTP basics of `rapidmoe-cli serve`, on raw sockets where the framing matters: HEAD answered as GET without the
body, the CORS preflight listing only the methods there are, and `x-should-retry: false` on every 501 so that the
openai SDK does not retry a switched-off feature.
"""
from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc

MAX_BODY = 2048


@pytest.fixture(scope="module")
def srv(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """--max-body 2048, 2 s for a body; no --embedding."""
    s = ServerProc(tiny_qwen, "--parallel", "1", "-c", "1024", "-t", "1", "--max-body", str(MAX_BODY),
                   "--body-timeout", "2", log_path=tmp_path_factory.mktemp("server") / "http.log")
    yield s
    s.stop()


def _exchange(port: int, raw: bytes, timeout: float = 10.0) -> bytes:
    """Everything the server writes back on a fresh connection after `raw`, until it closes."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(raw)
        sock.settimeout(timeout)
        out = b""
        while True:
            try:
                data = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not data:
                break
            out += data
        return out


def _parse(data: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, the bytes after the head) of the first answer in `data`."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    assert sep and head.startswith(b"HTTP/1.1 "), data
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, rest


def _answer(port: int, raw: bytes) -> tuple[int, dict[str, str], Any]:
    """(status, headers, JSON body) of the one answer to `raw`, which asks the server to close after it."""
    status, headers, rest = _parse(_exchange(port, raw))
    assert len(rest) == int(headers["content-length"]), rest
    return status, headers, json.loads(rest)


def _chunked(path: str, chunks: list[bytes], extra: bytes = b"") -> bytes:
    """A chunked POST, closed after its answer; `extra` goes after the chunks (trailers and the final CRLF)."""
    body = b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in chunks) + b"0\r\n" + (extra or b"\r\n")
    return (b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n%b" % (path.encode(), body))


def _still_serves(srv: ServerProc) -> None:
    status, r = srv.request("POST", "/tokenize", {"content": "Hello"})
    assert status == 200 and r["tokens"], r


# ---- HEAD ----

HEAD_ERRORS = {"/v1/stream": 501, "/completion": 405, "/nowhere": 404}
HEAD_PATHS = ["/health", "/", "/static/app.js", "/v1/models", "/props", "/slots", *HEAD_ERRORS]


@pytest.mark.parametrize("path", HEAD_PATHS)
def test_head_is_get_without_the_body(srv: ServerProc, path: str) -> None:
    """HEAD gets GET's status and headers (Content-Length that of GET's body) and no body: the next answer on
    the connection starts right after its head. Also for GET's errors (501, 405, 404)."""
    get = _exchange(srv.port, b"GET %b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path.encode())
    status, headers, body = _parse(get)
    both = _exchange(srv.port, b"HEAD %b HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n"
                     b"Connection: close\r\n\r\n" % path.encode())
    h_status, h_headers, rest = _parse(both)
    assert h_status == status == (HEAD_ERRORS.get(path) or 200), both
    drop = {"date", "connection"}  # the time, and GET's "close" asked for by this test
    assert {k: v for k, v in h_headers.items() if k not in drop} == {
        k: v for k, v in headers.items() if k not in drop}
    assert int(h_headers["content-length"]) == len(body) > 0
    assert rest.startswith(b"HTTP/1.1 200 "), rest[:80]  # /health's answer: nothing of a body came before it


# ---- CORS preflight ----

def test_cors_preflight_lists_only_the_methods_there_are(srv: ServerProc) -> None:
    status, headers, _ = _parse(_exchange(srv.port, b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                          b"Origin: http://example.com\r\nConnection: close\r\n\r\n"))
    methods = [m.strip() for m in headers["access-control-allow-methods"].split(",")]
    assert status == 200 and methods == ["GET", "HEAD", "POST", "OPTIONS"], headers
    for method, status in zip(methods, [200, 200, 405, 200], strict=True):  # each has a handler (POST: not here)
        got = _exchange(srv.port, b"%b /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % method.encode())
        assert _parse(got)[0] == status, got
    for method in ("DELETE", "PUT", "PATCH"):  # not listed: none has a route
        got = _exchange(srv.port, b"%b /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % method.encode())
        assert _parse(got)[0] == 501, got


# ---- 501 ----

def test_openai_sdk_does_not_retry_a_501(srv: ServerProc) -> None:
    """Embeddings on a server started without --embedding: llama-server's 501, with `x-should-retry: false`, so the
    openai SDK (which retries every 5xx unless told not to) sends the request once, not 1 + max_retries times."""
    openai = pytest.importorskip("openai")
    route = 'rapidmoe:http_requests_total{route="/v1/embeddings",status="501"}'

    def count() -> int:
        status, text = srv.request("GET", "/metrics")
        assert status == 200
        return sum(int(line.split()[-1]) for line in text.splitlines() if line.startswith(route))

    before = count()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=2)
    with pytest.raises(openai.APIStatusError) as e:
        client.embeddings.create(model="m", input="Hello")
    assert e.value.status_code == 501 and e.value.response.headers["x-should-retry"] == "false"
    assert count() - before == 1
