"""A `rapidmoe-cli serve` process on loopback for tests and benchmarks, and a raw SSE reader."""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rapidmoe import _children
from rapidmoe.server import sse


def read_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the peer writes on `sock` until it closes (or stays silent for `timeout` seconds)."""
    sock.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        out += chunk
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProc:
    """Starts the server, waits for /health 200; `stop()` sends SIGTERM."""

    def __init__(self, model: Path, *args: str, log_path: Path, port: int | None = None,
                 cmd: list[str] | None = None, ready_timeout: float = 60.0) -> None:
        self.port = port or free_port()
        self.log_path = log_path
        self.last_headers: dict[str, str] = {}
        argv = cmd or [sys.executable, "-m", "rapidmoe.cli", "serve", str(model)]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self._log = open(log_path, "w")
        # a child that ends with this process: a killed pytest leaks no server; a crash prints every thread's stack
        self.proc = _children.spawn(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
        self.wait_ready(ready_timeout)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"server not ready in {timeout} s:\n{self.log()}")

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                raw: bytes | None = None, timeout: float = 60.0) -> tuple[int, Any]:
        """(status, parsed JSON or text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        text = r.read()
        conn.close()
        self.last_headers = {k.lower(): v for k, v in r.getheaders()}  # of this answer, names in lower case
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text.decode("utf-8", "replace")

    def stream(self, path: str, body: Any, headers: dict[str, str] | None = None) -> Iterator[bytes]:
        """The raw SSE events (each `data: ...` block without its blank line) of a streaming POST."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        if r.status != 200:
            raise AssertionError(f"status {r.status}: {r.read()!r}")
        assert r.getheader("Content-Type", "").startswith("text/event-stream")
        yield from sse.read_events(r)  # raises if the stream ends inside an event
        conn.close()

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        _children.stop(self.proc, timeout=10.0)
        self._log.close()


def stock_server_bin() -> Path:
    """Stock llama-server's folder: it runs where llama-server is built already (tools/stock_llama.py
    llama-server, as bench/bench_server.py builds it) or with RAPIDMOE_STOCK_SERVER=1 (builds it: ~70 more
    compile steps than the stock libllama other tests build, 10+ minutes on 2 cores); else the test skips."""
    import pytest  # noqa: PLC0415 - only the tests that compare with stock need it
    from stock_llama import STOCK, build_stock  # noqa: PLC0415 - tools/ is on sys.path through conftest

    if os.environ.get("RAPIDMOE_STOCK_SERVER") == "1":
        return build_stock(["llama-server"])
    built = STOCK / "build" / "bin" / "llama-server"
    if not built.exists():
        pytest.skip("stock llama-server not built (python tools/stock_llama.py llama-server, or "
                    "RAPIDMOE_STOCK_SERVER=1)")
    return built.parent


def sse_json(events: Iterator[bytes]) -> list[Any]:
    """Parse `data: {json}` events; `[DONE]` comes back as the string "[DONE]"."""
    out: list[Any] = []
    for ev in events:
        assert ev.startswith(b"data: ") and b"\n" not in ev, ev
        payload = ev[len(b"data: "):]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out
