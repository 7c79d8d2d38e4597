"""HTTP basics of `rapidmoe-cli serve`: `x-should-retry: false` on every 501, so that the openai SDK does not retry
a switched-off feature.
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
