"""HTTP basics of `rapidmoe-cli serve`, on raw sockets where the framing matters: HEAD answered as GET without the
body, the CORS preflight listing only the methods there are, chunked request bodies (decoded as Content-Length
ones are read, under the same --max-body and --body-timeout; malformed framing a JSON 400 that closes the
connection), and `x-should-retry: false` on every 501 so that the openai SDK does not retry a switched-off feature.
"""
from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc, read_all

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
        return read_all(sock, timeout)


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


# ---- chunked request bodies ----

def test_chunked_body_is_read_as_a_content_length_one(srv: ServerProc) -> None:
    """A chunked body (chunk extensions, uppercase hex, trailers) gets the answer of the same body sent with
    Content-Length; two of them on one keep-alive connection, then a GET, are all answered in order."""
    body = json.dumps({"prompt": "Once upon a time", "n_predict": 4, "temperature": 0}).encode()
    status, ref = srv.request("POST", "/completion", raw=body)
    assert status == 200, ref
    pieces = [body[:5], body[5:6], body[6:]]
    framed = (b"%X;name=value\r\n%b\r\n" % (len(pieces[0]), pieces[0]) + b"%x \t;ext\r\n%b\r\n" % (1, pieces[1])
              + b"%x\r\n%b\r\n" % (len(pieces[2]), pieces[2]) + b"0\r\nX-Checksum: 1\r\nX-Other: 2\r\n\r\n")
    request = (b"POST /completion HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
               b"Content-Type: application/json\r\n\r\n" + framed)
    data = _exchange(srv.port, request * 2 + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    for _ in range(2):
        status, headers, rest = _parse(data)
        n = int(headers["content-length"])
        answer, data = json.loads(rest[:n]), rest[n:]
        assert status == 200 and answer["content"] == ref["content"] and answer["tokens_predicted"] == 4, answer
        assert headers.get("connection") != "close"
    assert _parse(data)[0] == 200


def test_chunked_body_limit_is_max_body(srv: ServerProc) -> None:
    """--max-body bytes in chunks are read (the framing does not count); one byte more is the 413 a Content-Length
    body over it gets, answered before the chunk that crosses the limit is sent."""
    body = json.dumps({"content": "Hello"}).encode()
    body += b" " * (MAX_BODY - len(body))
    status, _, r = _answer(srv.port, _chunked("/tokenize", [body[:1000], body[1000:]]))
    assert status == 200 and r["tokens"], r
    over = _answer(srv.port, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1))
    assert over[0] == 413
    status, headers, r = _answer(srv.port, b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                 b"%x\r\n%b\r\n%x\r\n" % (MAX_BODY, body, 1))  # the byte over is never sent
    assert (status, r) == (413, over[2]) and headers["connection"] == "close", r
    status, _, r = _answer(srv.port, _chunked("/tokenize", [])[:-5] + b"f" * 40 + b"\r\n")  # 2^160 bytes
    assert (status, r) == (413, over[2])
    _still_serves(srv)


BAD_CHUNKS = [
    ("not hex", b"zz\r\nab\r\n0\r\n\r\n", "chunk size b'zz' is not a hexadecimal number"),
    ("0x prefix", b"0x2\r\nab\r\n0\r\n\r\n", "chunk size b'0x2' is not a hexadecimal number"),
    ("sign", b"+2\r\nab\r\n0\r\n\r\n", "chunk size b'+2' is not a hexadecimal number"),
    ("negative", b"-2\r\nab\r\n0\r\n\r\n", "chunk size b'-2' is not a hexadecimal number"),
    ("leading space", b" 2\r\nab\r\n0\r\n\r\n", "chunk size b' 2' is not a hexadecimal number"),
    ("underscore", b"1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n", "chunk size b'1_0' is not a hexadecimal number"),
    ("empty size", b"\r\nab\r\n0\r\n\r\n", "chunk size b'' is not a hexadecimal number"),
    ("data longer than its size", b"2\r\nabc\r\n0\r\n\r\n", "a chunk of 2 bytes is not followed by CRLF"),
    ("no CRLF after the data", b"2\r\nab0\r\n\r\n", "a chunk of 2 bytes is not followed by CRLF"),
    ("size line too long", b"2;" + b"e" * 5000 + b"\r\nab\r\n0\r\n\r\n", "a chunk size line over 4096 bytes"),
    ("trailer without a colon", b"2\r\nab\r\n0\r\nnot a field\r\n\r\n", "trailer line b'not a field' is not"),
    ("trailers too long", b"2\r\nab\r\n0\r\n" + b"X-A: b\r\n" * 2000 + b"\r\n", "trailers over 8192 bytes"),
    ("ends inside a chunk", b"10\r\nab", "the connection ended inside a chunk (2 bytes read)"),
    ("ends inside a size line", b"1", "the connection ended inside a chunk size line"),
    ("ends before the trailers end", b"2\r\nab\r\n0\r\n", "the connection ended inside a trailer line"),
]


@pytest.mark.parametrize("framed,message", [b[1:] for b in BAD_CHUNKS], ids=[b[0] for b in BAD_CHUNKS])
def test_malformed_chunked_body_is_400_and_closes(srv: ServerProc, framed: bytes, message: str) -> None:
    """Each a JSON 400 naming what is wrong, then the connection is closed (where the next request would start
    is lost); the server goes on serving."""
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + framed)
        sock.shutdown(socket.SHUT_WR)  # what the "ends inside" cases need; the others are answered before
        sock.settimeout(10)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status, headers, rest = _parse(data)
    r = json.loads(rest)
    assert status == 400 and headers["connection"] == "close", data
    assert r["error"]["message"].startswith("bad chunked request body: " + message), r
    _still_serves(srv)


TRANSFER_CODINGS = [
    (b"Transfer-Encoding: gzip, chunked\r\n", 501, "Transfer-Encoding 'gzip, chunked': only chunked"),
    (b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n", 501, "Transfer-Encoding 'gzip, chunked'"),
    (b"Transfer-Encoding: gzip\r\n", 400, "Transfer-Encoding 'gzip': the body's length cannot be known"),
    (b"Transfer-Encoding: chunked, identity\r\n", 400, "Transfer-Encoding 'chunked, identity': the body's length"),
    (b"Transfer-Encoding: \r\n", 400, "Transfer-Encoding '': the body's length cannot be known"),
    (b"Transfer-Encoding: chunked\r\nContent-Length: 9\r\n", 400, "a request with both Transfer-Encoding and"),
]


@pytest.mark.parametrize("head,status,message", TRANSFER_CODINGS, ids=[str(i) for i in range(len(TRANSFER_CODINGS))])
def test_transfer_codings_other_than_chunked_are_refused(srv: ServerProc, head: bytes, status: int,
                                                         message: str) -> None:
    """RFC 9112: chunked not last leaves the body's length unknown (400), a coding this server does not decode is
    a 501, and Content-Length beside Transfer-Encoding is refused (400)."""
    got, headers, r = _answer(srv.port, b"POST /tokenize HTTP/1.1\r\nHost: x\r\n%b\r\n2\r\n{}\r\n0\r\n\r\n" % head)
    assert (got, headers["connection"]) == (status, "close") and r["error"]["message"].startswith(message), r
    _still_serves(srv)


def _trickle(port: int, head: bytes, piece: bytes, every: float = 0.3) -> tuple[bytes, float]:
    """Sends `head`, then `piece` every `every` seconds until the server answers; (answer, seconds until it)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(head)
        t0 = time.monotonic()
        sock.settimeout(every)
        data = b""
        while time.monotonic() - t0 < 15:
            try:
                sock.sendall(piece)
                data += sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if data:
                break
        elapsed = time.monotonic() - t0
        sock.settimeout(2)
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except OSError:
            pass
    return data, elapsed


@pytest.mark.parametrize("where", ["chunks", "size line", "trailers"])
def test_slow_chunked_sender_gets_408_at_the_body_deadline(srv: ServerProc, where: str) -> None:
    """A sender trickling its chunked body (1-byte chunks, or one line a byte at a time, so a timeout each read
    resets would never fire) gets a JSON 408 at --body-timeout (2 s) after its headers, as a Content-Length body."""
    head = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    start, piece = {"chunks": (b"", b"1\r\n \r\n"), "size line": (b"1", b"0"),
                    "trailers": (b"0\r\nX-A: ", b"b")}[where]
    data, elapsed = _trickle(srv.port, head + start, piece)
    status, headers, rest = _parse(data)
    assert status == 408 and headers["connection"] == "close" and 1.9 < elapsed < 3.5, (data, elapsed)
    assert json.loads(rest)["error"]["message"].startswith("timed out reading the chunked request body (")
    _still_serves(srv)


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
