"""The HTTP server as a fuzz target: one `rapidmoe-cli serve` process, then cases sent over raw sockets: malformed
framing (request lines, versions, methods), headers (lengths, duplicates, chunked bodies, folding, huge), bodies
(llama-server requests mutated by structure: wrong types, boundary numbers, huge and nested values; invalid JSON
and UTF-8), slow clients (trickled headers, a body that stalls) and vanishing clients (closed or reset mid-request
and mid-stream).

Findings: a 5xx other than 503, a reply that is not HTTP, no reply in time to a complete request, the server not
answering /health after a case, the process gone, or a traceback, "internal error" or sanitizer report in its log
while the case ran.
"""
from __future__ import annotations

import json
import random
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .harness import SANITIZER_MARKS
from .mutate_misc import mutate_json

POST_SEEDS: dict[str, dict[str, Any]] = {
    "/completion": {"prompt": "Hello", "n_predict": 3, "temperature": 0, "stream": False},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 2},
    "/v1/chat/completions": {"messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
                             "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                                 "type": "object", "properties": {"a": {"type": "string"}}}}}]},
    "/tokenize": {"content": "Hello world", "add_special": True, "with_pieces": True},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/apply-template": {"messages": [{"role": "user", "content": "Hi"}]},
    "/v1/messages": {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}]}]},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 3, "temperature": 0},
    "/v1/chat/completions/input_tokens": {"messages": [{"role": "user", "content": "Hi"}]},
    "/completion#grammar": {"prompt": "x", "n_predict": 3, "json_schema": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0}}}},
    "/v1/embeddings": {"input": "Hi"},
}
GET_PATHS = ["/health", "/props", "/slots", "/metrics", "/v1/models", "/", "/static/app.js", "/rapidmoe/stats",
             "/nope", "/health?x=%00", "/../../etc/passwd", "/%ff", "/" + "a" * 5000]


@dataclass
class HttpCase:
    kind: str
    chunks: list[bytes]  # sent in order; between them `pause` seconds
    pause: float = 0.0
    read: bool = True  # wait for a reply
    close_early: bool = False  # close (RST) right after sending, or after the first reply bytes when streaming
    note: str = ""
    recipe: dict[str, Any] = field(default_factory=dict)


def _req(method: str, path: str, body: bytes = b"", headers: list[tuple[str, str]] | None = None,
         version: str = "HTTP/1.1", length: bool = True) -> bytes:
    hs = [("Host", "127.0.0.1"), ("Content-Type", "application/json"), ("Connection", "close")]
    if length and (body or method == "POST"):
        hs.append(("Content-Length", str(len(body))))
    hs += headers or []
    head = f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hs) + "\r\n"
    return head.encode("latin-1", "replace") + body


def _post_body(rng: random.Random) -> tuple[str, bytes]:
    key = rng.choice(list(POST_SEEDS))
    path = key.split("#")[0]
    seed = POST_SEEDS[key]
    if rng.random() < 0.15:
        seed = {**seed, "stream": True}
    body = mutate_json(rng, seed) if rng.random() < 0.85 else json.dumps(seed).encode()
    return path, body


def make_case(seed: int, index: int) -> HttpCase:
    rng = random.Random(f"{seed}/http/{index}")
    kind = rng.choices(["framing", "headers", "body", "body", "body", "slow", "vanish", "get"],
                       [1, 2, 3, 3, 3, 1, 1.5, 1])[0]
    if kind == "framing":
        line = rng.choice([b"GARBAGE\r\n\r\n", b"GET /health\r\n\r\n", b"GET /health HTTP/2.0\r\n\r\n",
                           b"GET /health HTTP/0.9\r\n\r\n", b"\r\n\r\n", b"GET " + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
                           b"BREW /health HTTP/1.1\r\n\r\n", b"GET /health HTTP/1.1\r\n", b"\x00\xff\xfe\r\n\r\n",
                           b"GET http://x/health HTTP/1.1\r\nHost: x\r\n\r\n", b"POST /completion HTTP/1.1\r\n\r\n",
                           b"GET /health HTTP/1.1\nHost: x\n\n", b"GET\t/health\tHTTP/1.1\r\n\r\n",
                           b"DELETE /slots HTTP/1.1\r\nContent-Length: 0\r\n\r\n", b"HEAD / HTTP/1.1\r\n\r\n",
                           b"OPTIONS * HTTP/1.1\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n" * 3])
        return HttpCase(kind, [line], note=line[:60].decode("latin-1"))
    if kind == "headers":
        path, body = _post_body(rng)
        n = len(body)
        hdrs = rng.choice([
            [("Content-Length", str(n)), ("Content-Length", str(n + 1))], [("Content-Length", "-1")],
            [("Content-Length", "99999999999999999999")], [("Content-Length", "abc")], [("Content-Length", " 5 ")],
            [("Transfer-Encoding", "chunked")], [("Transfer-Encoding", "gzip, chunked")],
            [("X-Big", "a" * 70000)], [(f"X-{i}", "v") for i in range(150)], [("Expect", "100-continue")],
            [("Authorization", "Bearer " + "x" * 10000)], [("x-api-key", "\x00")], [("Content-Type", "text/plain")],
            [("Connection", "keep-alive, upgrade"), ("Upgrade", "h2c")], [("Host", "")],
            [("Content-Encoding", "gzip")], [("Accept", "text/event-stream")]])
        no_len = any(k.lower() in ("content-length", "transfer-encoding") for k, _ in hdrs)
        if any(v == "chunked" or v.endswith("chunked") for _, v in hdrs):
            body = rng.choice([b"5\r\nhello\r\n0\r\n\r\n", b"zz\r\n", b"ffffffffffffffff\r\n", b"0\r\n\r\n"])
        raw = _req("POST", path, body, hdrs, length=not no_len)
        if rng.random() < 0.2:  # an obs-folded header line, or a header without a colon
            raw = raw.replace(b"\r\n\r\n", rng.choice([b"\r\n folded\r\n\r\n", b"\r\nNoColon\r\n\r\n"]), 1)
        return HttpCase(kind, [raw], note=str(hdrs)[:80])
    if kind == "get":
        path = rng.choice(GET_PATHS)
        return HttpCase(kind, [_req("GET", path)], note=path[:60])
    if kind == "slow":
        path, body = _post_body(rng)
        raw = _req("POST", path, body)
        cut = rng.randrange(1, len(raw))
        if rng.random() < 0.5:  # trickled: a few bytes at a time, then the rest
            parts = [*[raw[i: i + 7] for i in range(0, cut, 7)][:12], raw[min(cut, 84):]]
            return HttpCase(kind, parts, pause=0.1, note="trickle")
        return HttpCase(kind, [raw[:cut]], note=f"stall after {cut} of {len(raw)} bytes")  # the deadline answers
    if kind == "vanish":
        path, body = _post_body(rng)
        if rng.random() < 0.6:
            req = dict(POST_SEEDS["/completion"], stream=True, n_predict=64)
            path, body = "/completion", json.dumps(req).encode()
        raw = _req("POST", path, body)
        cut = rng.choice([len(raw), len(raw), rng.randrange(1, len(raw))])
        return HttpCase(kind, [raw[:cut]], read=cut == len(raw), close_early=True, note=f"close after {cut}")
    path, body = _post_body(rng)
    return HttpCase(kind, [_req("POST", path, body)], note=path + " " + body[:80].decode("utf-8", "replace"))


class Server:
    """`rapidmoe-cli serve` on a free loopback port, its output in a log file."""

    def __init__(self, model: Path, log_path: Path, env: dict[str, str], ready_timeout: float = 180.0) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.log_path = log_path
        log: IO[bytes] = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rapidmoe.cli", "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port),
             "-c", "512", "-np", "2", "-t", "1", "--header-timeout", "2", "--body-timeout", "2",
             "--keepalive-timeout", "1", "--max-body", str(4 << 20), "-n", "8"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        log.close()
        t0 = time.monotonic()
        while time.monotonic() - t0 < ready_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log()[-3000:]}")
            if self.health(2.0) == 200:
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready in {ready_timeout} s: {self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_bytes().decode(errors="replace")

    def health(self, timeout: float) -> int:
        try:
            status, _ = exchange(self.port, [_req("GET", "/health")], timeout=timeout)
            return status
        except OSError:
            return -1

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def exchange(port: int, chunks: list[bytes], *, timeout: float, pause: float = 0.0, read: bool = True,
             close_early: bool = False) -> tuple[int, bytes]:
    """Send the chunks; (status of the reply, or 0 if none was read / -2 if it was not HTTP; the reply's bytes)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        for i, c in enumerate(chunks):
            if i and pause:
                time.sleep(pause)
            try:
                s.sendall(c)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server refused the rest (a limit): its reply may still be there
        if close_early and not read:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
            return 0, b""
        data = b""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            try:
                b = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not b:
                break
            data += b
            if close_early:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                break
        if not data:
            return 0, b""
        if not data.startswith(b"HTTP/1."):
            return -2, data
        return int(data.split(b" ", 2)[1]), data
    finally:
        s.close()


@dataclass
class HttpVerdict:
    finding: bool
    detail: str
    status: int


def run_case(server: Server, case: HttpCase, timeout: float = 60.0) -> HttpVerdict:
    before = server.log_path.stat().st_size
    try:
        status, data = exchange(server.port, case.chunks, timeout=timeout, pause=case.pause, read=case.read,
                                close_early=case.close_early)
    except OSError as e:
        status, data = -3, str(e).encode()
    problems = []
    if status == -2:
        problems.append(f"reply is not HTTP: {data[:80]!r}")
    elif status == -3:
        problems.append(f"cannot connect: {data.decode()}")
    elif status == 500 or status >= 600:  # 501 (not supported), 503 (busy), 505 (version) are answers
        problems.append(f"status {status}: {data[-300:]!r}")
    elif status == 0 and case.read and not case.close_early and case.kind in ("body", "get", "headers"):
        problems.append("no reply")
    h = server.health(30.0)
    if server.proc.poll() is not None:
        problems.append(f"server died with {server.proc.returncode}")
    elif h not in (200, 503):
        problems.append(f"/health answered {h} after the case")
    with server.log_path.open("rb") as f:
        f.seek(before)
        new = f.read().decode(errors="replace")
    for mark in ("Traceback (most recent call last)", "internal error", *SANITIZER_MARKS):
        if mark in new:
            problems.append(f"log: {mark}: {new[new.index(mark): new.index(mark) + 400]!r}")
            break
    return HttpVerdict(bool(problems), "; ".join(problems), status)
