"""A request's body off its connection: `Content-Length` bytes or a chunked body (RFC 9112 §7.1), whole within one
deadline (--body-timeout) and at most --max-body bytes, every failure an ApiError (400 framing, 408 deadline, 413
size). After any of them the caller closes the connection: where the next request starts is lost. What the body
means belongs to the routes; which framing a request uses, to app.py.
"""
from __future__ import annotations

import io
import re
import socket
import time

from .errors import ApiError, invalid_request, payload_too_large

MAX_LINE = 4096  # bytes of a chunk-size line (size and extensions) or of one trailer line, its line end included
MAX_TRAILERS = 8192  # bytes of all the trailer lines of a chunked body together
_HEX = re.compile(rb"[0-9A-Fa-f]+")


def bad_framing(message: str) -> ApiError:
    return invalid_request(f"bad chunked request body: {message}")


class BodyReader:
    """Reads one body from `rfile` (the connection's buffered reader over `sock`) before `seconds` from now. The
    deadline is one for the whole body: each socket read waits only for what is left of it, so a client trickling
    bytes cannot hold the connection beyond it."""

    def __init__(self, rfile: io.BufferedReader, sock: socket.socket, seconds: float, max_body: int) -> None:
        self.rfile = rfile
        self.sock = sock
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.max_body = max_body
        self.got = 0  # body bytes read so far (chunked: decoded, without the framing)

    def exactly(self, n: int) -> bytes:
        """A `Content-Length: n` body; 400 if the connection ends before n bytes."""
        try:
            data = self._data(n)
        except TimeoutError:
            raise ApiError(408, "invalid_request_error", f"timed out reading the request body ({self.got} of {n} "
                           f"bytes in {self.seconds:g} s)") from None
        if len(data) < n:
            raise invalid_request(f"request body shorter than Content-Length ({self.got} of {n} bytes)")
        return data

    def chunked(self) -> bytes:
        """A chunked body, decoded: `SIZE[;ext]` lines (hexadecimal; extensions ignored), each chunk followed by
        CRLF, a 0 size, then trailer lines (read and dropped) and an empty line. 413 as soon as the sizes add up to
        more than --max-body (the chunk over it is not read)."""
        parts = []
        try:
            while True:
                line = self._line("chunk size")
                size_text = line.split(b";", 1)[0].rstrip(b" \t")
                if not _HEX.fullmatch(size_text):
                    raise bad_framing(f"chunk size {size_text[:40]!r} is not a hexadecimal number")
                size = int(size_text, 16)
                if size == 0:
                    break
                if self.got + size > self.max_body:
                    raise payload_too_large(self.max_body)
                data = self._data(size)
                if len(data) < size:
                    raise bad_framing(f"the connection ended inside a chunk ({self.got} bytes read)")
                parts.append(data)
                end = self._data(2, count=False)
                if end != b"\r\n":
                    raise bad_framing(f"a chunk of {size} bytes is not followed by CRLF (got {end!r})")
            self._trailers()
        except TimeoutError:
            raise ApiError(408, "invalid_request_error", f"timed out reading the chunked request body ({self.got} "
                           f"bytes in {self.seconds:g} s)") from None
        return b"".join(parts)

    def _trailers(self) -> None:
        """The trailer section after the last chunk: `name: value` lines up to an empty one, dropped (no field of
        a request is taken from them)."""
        total = 0
        while line := self._line("trailer"):
            total += len(line) + 2
            if total > MAX_TRAILERS:
                raise bad_framing(f"trailers over {MAX_TRAILERS} bytes")
            if b":" not in line:
                raise bad_framing(f"trailer line {line[:40]!r} is not a header field")

    def _arm(self) -> None:
        """The socket waits at most until the deadline; TimeoutError once it has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        self.sock.settimeout(left)

    def _data(self, n: int, count: bool = True) -> bytes:
        """n bytes, or fewer if the connection ends first. `count`: they are body bytes (not framing)."""
        parts, got = [], 0
        while got < n:
            self._arm()
            data = self.rfile.read1(min(n - got, 1 << 16))
            if not data:
                break
            parts.append(data)
            got += len(data)
            if count:
                self.got += len(data)
        return b"".join(parts)

    def _line(self, what: str) -> bytes:
        """One line of chunked framing without its CRLF (a bare LF ends it too, as RFC 9112 allows); 400 if it is
        over MAX_LINE bytes or the connection ends inside it."""
        buf = b""
        while True:
            self._arm()
            data = self.rfile.peek(1)  # what is buffered, after at most one read of the socket
            if not data:
                raise bad_framing(f"the connection ended inside a {what} line")
            nl = data.find(b"\n")
            buf += self.rfile.read(nl + 1 if nl >= 0 else len(data))  # all of it buffered: no further wait
            if len(buf) > MAX_LINE:
                raise bad_framing(f"a {what} line over {MAX_LINE} bytes")
            if nl >= 0:
                return buf[:-2] if buf.endswith(b"\r\n") else buf[:-1]
