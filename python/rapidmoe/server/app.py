"""The HTTP layer: stdlib ThreadingHTTPServer, one thread per connection, talking to the one engine thread.

Here: binding, a cap on open connections, deadlines for a request's headers and for its body, a keep-alive idle
timeout, body size limit, Content-Length or chunked request bodies (read in body.py), HEAD answered as GET without
the body, JSON errors for malformed requests (never http.server's HTML page), `Retry-After` on every 503 and
`x-should-retry: false` on every 501, API key (constant-time), 503 while loading, CORS, chunked SSE writes,
disconnect detection, one log line per request. The route table is routes.py, the endpoints api/ (one module per
API family); inference is engine.py.
"""
from __future__ import annotations

import hmac
import io
import logging
import os
import select
import signal
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from .._runtime import llama_cpp as lc
from ..errors import ModelFileError, RapidMoEError
from ..llama import Llama
from ..modelfile import require_moe
from ..umia import load_policy
from . import anthropic, legacy_chat, routes, sse
from .api import native, page
from .api.serving import AppState, Reply, Request, Stream
from .body import BodyReader
from .chat import CHATML, ChatTemplate
from .config import ServerConfig
from .engine import Engine
from .errors import ApiError, authentication, invalid_request, not_found, payload_too_large, unavailable
from .pooling import pooling_type

log = logging.getLogger(__name__)

PUBLIC = {"/health", "/v1/health", *page.WEB_FILES}  # no API key
# needed (as in llama-server): health and the chat page, which asks for the key itself


RETRY_AFTER = "1"  # seconds, on every 503 (busy, loading, shutting down)


def status_headers(code: int) -> list[tuple[str, str]]:
    """Headers every answer with this status carries, however it is written: `Retry-After` on every 503;
    `x-should-retry: false` on every 501 (a feature this server lacks or has switched off: the openai SDK retries
    every 5xx unless this header says false, and a retry gets the same answer)."""
    if code == 503:
        return [("Retry-After", RETRY_AFTER)]
    if code == 501:
        return [("x-should-retry", "false")]
    return []


def _is_localhost(origin: str) -> bool:
    """An Origin whose host is localhost, 127.0.0.1 or ::1 (llama-server's origin_is_localhost)."""
    try:
        return urlsplit(origin).hostname in ("localhost", "127.0.0.1", "::1")
    except ValueError:
        return False


def _raw_reply(err: ApiError) -> bytes:
    """A whole JSON error answer, to write straight to a socket that is closed after it (where no handler
    answers: the accepting thread, the header watchdog)."""
    body = err.to_bytes()
    head = [f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}", "Content-Type: application/json; charset=utf-8",
            *(f"{k}: {v}" for k, v in status_headers(err.status)), "Connection: close", f"Content-Length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class _HeaderDeadlines:
    """A connection's request line and headers must arrive within a deadline (a client trickling bytes resets
    the socket timeout at every byte, not this). One thread checks armed connections every 0.1 s; at the deadline
    it answers 408 and shuts the socket down (the handler thread is then reading, never writing)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[socket.socket, float] = {}
        self._thread = threading.Thread(target=self._run, name="rapidmoe-header-deadlines", daemon=True)
        self._thread.start()

    def arm(self, conn: socket.socket, seconds: float) -> None:
        with self._lock:
            self._armed[conn] = time.monotonic() + seconds

    def disarm(self, conn: socket.socket) -> bool:
        """False if the deadline already fired (the connection is being closed)."""
        with self._lock:
            return self._armed.pop(conn, None) is not None

    def _run(self) -> None:
        while True:
            time.sleep(0.1)
            now = time.monotonic()
            with self._lock:
                late = [c for c, d in self._armed.items() if d < now]
                for conn in late:
                    del self._armed[conn]
                    try:
                        conn.sendall(_raw_reply(ApiError(408, "invalid_request_error",
                                                         "timed out reading the request headers")))
                    except OSError:
                        pass
                    try:
                        conn.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    state: AppState

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], max_connections: int) -> None:
        super().__init__(address, handler)
        self.max_connections = max_connections
        self.deadlines = _HeaderDeadlines()
        self._conn_lock = threading.Lock()
        self.n_connections = 0  # open connections (each has a thread)
        self.n_active = 0  # requests between reading their body and the end of their answer

    def process_request(self, request: Any, client_address: Any) -> None:
        """Beyond max_connections, answer 503 at once on the accepting thread and close, without a thread."""
        with self._conn_lock:
            full = self.n_connections >= self.max_connections
            if not full:
                self.n_connections += 1
        if not full:
            super().process_request(request, client_address)
            return
        log.warning("connection from %s refused: %d connections open (--max-connections)", client_address[0],
                    self.max_connections)
        self.state.requests.add("other", 503)
        try:
            request.settimeout(0.05)
            try:
                request.recv(65536)  # what the client already sent, so closing does not reset our answer
            except OSError:
                pass
            request.sendall(_raw_reply(unavailable(
                f"too many connections (at most {self.max_connections} open)")))
            request.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._conn_lock:
                self.n_connections -= 1

    def active(self, delta: int) -> None:
        with self._conn_lock:
            self.n_active += delta

    def handle_error(self, request: Any, client_address: Any) -> None:  # keep tracebacks in our log
        log.debug("connection error from %s", client_address, exc_info=True)  # noqa: LOG014 - called in an except


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    raw_requestline: bytes  # set by http.server before parse_request
    connection: socket.socket  # the accepted TCP socket (typeshed types socketserver's attribute Any)
    rfile: io.BufferedReader  # socketserver's makefile("rb", -1): buffered, with peek (typeshed: BufferedIOBase)
    server_version = "rapidmoe"
    sys_version = ""
    _reading_headers = False  # the header deadline is armed (from the request's start until its headers are in)

    def do_GET(self) -> None:  # http.server's naming
        self._handle("GET")

    def do_HEAD(self) -> None:  # GET's status and headers, without the body
        self._handle("HEAD")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_OPTIONS(self) -> None:  # CORS preflight, answered without auth like llama-server
        self.send_response(200)
        self._cors()
        self.send_header("Access-Control-Allow-Methods", "GET, HEAD, POST, OPTIONS")  # the methods there are
        self.send_header("Access-Control-Allow-Headers", "*")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - we log one line per request ourselves
        pass

    def handle_one_request(self) -> None:
        """Wait at most --keepalive-timeout for a request to start, and --header-timeout for its headers."""
        config = self.server.state.config
        self._sent = False  # a status line went out for this request
        self.connection.settimeout(config.keepalive_timeout)
        self._reading_headers = True
        self.server.deadlines.arm(self.connection, config.header_timeout)
        try:
            super().handle_one_request()
        finally:
            self._headers_in()

    def _headers_in(self) -> bool:
        """Stop the header deadline (the headers are in, or were refused); False if it fired first: the watchdog
        answered 408 and this request must write nothing more. True once the headers were read."""
        if not self._reading_headers:
            return True
        self._reading_headers = False
        return self.server.deadlines.disarm(self.connection)

    def parse_request(self) -> bool:
        words = str(self.raw_requestline, "iso-8859-1").split()
        if len(words) == 2 or (len(words) == 3 and words[2].startswith("HTTP/0.")):  # no version, or an explicit
            # HTTP/0.9: http.server would serve it without a status line (after waiting for headers that never come)
            self.command, self.request_version = "", "HTTP/1.1"
            self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
            self.send_error(400, "bad request line: no HTTP version (HTTP/0.9 is not supported)")
            return False
        ok = super().parse_request()  # its errors (bad syntax, 505, 431) go through send_error, which disarms
        if not self._headers_in():
            self.close_connection = True  # the deadline fired while the headers came in: already answered 408
            return False
        if ok:
            self.connection.settimeout(self.timeout)
        return ok

    def send_response(self, code: int, message: str | None = None) -> None:
        """The status line, then the headers its status always carries (status_headers)."""
        super().send_response(code, message)
        for k, v in status_headers(code):
            self.send_header(k, v)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (a garbage request line, bad headers, a line or headers too long, an unknown
        method) answered with llama-server's JSON error body instead of an HTML page; the connection is closed.
        Nothing is written if the header deadline fired first (its 408 is the answer)."""
        self.close_connection = True
        if not self._headers_in():
            return
        if self.request_version not in ("HTTP/1.0", "HTTP/1.1"):  # unparsed or 0.9: still a status line
            self.request_version = "HTTP/1.1"
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        type_ = "not_supported_error" if code == 501 else "server_error" if code >= 500 else "invalid_request_error"
        body = ApiError(code, type_, message or phrase).to_bytes()
        log.info("bad request from %s: %d %s", self.client_address[0], code, message or phrase)
        self.server.state.requests.add("other", code)
        self.send_response(code)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self._sent = True
        if self.command != "HEAD":
            self.wfile.write(body)

    # ---- one request ----

    def _handle(self, method: str) -> None:
        t0 = time.perf_counter()
        path = urlsplit(self.path).path
        st = self.server.state
        status, n_tokens = 500, 0
        self.server.active(1)
        try:
            reply = self._dispatch(method, path, st)
            if isinstance(reply, Stream):
                status = self._send_stream(reply)
                n_tokens = reply.n_tokens[0]
            else:
                status, n_tokens = reply.status, reply.n_tokens
                if status == 499:  # the client left before the answer
                    self.close_connection = True
                else:
                    self._send(reply)
        except ApiError as e:
            if path in routes.ANTHROPIC_PATHS:  # Anthropic's clients read their own error shape
                e = anthropic.error(e)
            status = e.status
            if self._sent:  # never a second status line: the answer is cut, the connection closed
                log.error("%s %s: %s after the headers were sent", method, path, e.message)
                self.close_connection = True
            else:
                self._send(Reply(e.status, e.to_bytes()))
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            status = 499
            self.close_connection = True
        except Exception:
            log.exception("%s %s: internal error", method, path)
            status = 500
            if self._sent:
                self.close_connection = True
            else:
                try:
                    err = ApiError(500, "server_error", "internal server error")
                    if path in routes.ANTHROPIC_PATHS:
                        err = anthropic.error(err)
                    self._send(Reply(500, err.to_bytes()))
                except OSError:
                    self.close_connection = True
        finally:
            self.server.active(-1)
            route = path if path in routes.GET or path in routes.POST else "other"
            st.requests.add(route, status)
            log.info("%s %s %d %d tokens %.1f ms", method, path, status, n_tokens, 1e3 * (time.perf_counter() - t0))

    def _dispatch(self, method: str, path: str, st: AppState) -> Reply | Stream:
        body = self._read_body(st)  # any method's: a body left unread would be taken for the next request
        if st.closing:
            self.close_connection = True
            raise unavailable("server shutting down")
        if not st.ready:
            raise unavailable("Loading model")
        if st.config.api_keys and path not in PUBLIC:
            self._check_key(st.config.api_keys)
        if self.headers.get("X-Conversation-Id") is not None:  # llama-server's resumable streams
            raise ApiError(501, "not_supported_error", "resumable streams (the X-Conversation-Id header, /v1/stream) "
                           "are not supported by this server")
        if method == "HEAD":  # GET's answer without the body (_send; no GET route streams)
            method = "GET"
        table = routes.GET if method == "GET" else routes.POST
        handler = table.get(path)
        if handler is None:
            other = routes.POST if method == "GET" else routes.GET
            if path in other:
                raise ApiError(405, "invalid_request_error", f"{method} is not allowed on {path}")
            raise not_found("File Not Found")
        return handler(st, Request(method, path + ("?" + urlsplit(self.path).query if "?" in self.path
                                                   else ""), body, self._gone))

    def _read_body(self, st: AppState) -> bytes:
        """The body as its headers frame it: chunked, Content-Length or none; within --body-timeout and --max-body
        (body.py). Any error closes the connection: the unread rest must not be taken for the next request."""
        try:
            reader = BodyReader(self.rfile, self.connection, st.config.body_timeout, st.config.max_body)
            codings = [c.strip().lower() for v in self.headers.get_all("Transfer-Encoding") or () for c in v.split(",")]
            if codings:
                self._check_codings(codings)
                return reader.chunked()
            raw = self.headers.get("Content-Length", "0")
            try:
                n = int(raw)
            except ValueError:
                raise invalid_request(f"bad Content-Length: {raw!r}") from None
            if n < 0:
                raise invalid_request(f"bad Content-Length: {raw!r}")
            if n > st.config.max_body:
                raise payload_too_large(st.config.max_body)
            return reader.exactly(n)
        except ApiError:
            self.close_connection = True
            raise
        finally:
            self.connection.settimeout(self.timeout)

    def _check_codings(self, codings: list[str]) -> None:
        """Transfer-Encoding must be `chunked` alone (RFC 9112 §6.1/§6.3): chunked not last leaves the body's end
        unknown (400), a coding before it is one this server does not decode (501), and Content-Length beside it
        is a conflict (400: proxies disagree on which wins)."""
        if codings[-1] != "chunked":
            raise invalid_request(f"Transfer-Encoding {', '.join(codings)!r}: the body's length cannot be known "
                                  "(chunked must be the last transfer coding)")
        if len(codings) > 1:
            raise ApiError(501, "not_supported_error", f"Transfer-Encoding {', '.join(codings)!r}: only chunked "
                           "request bodies are supported (no other transfer coding)")
        if self.headers.get("Content-Length") is not None:
            raise invalid_request("a request with both Transfer-Encoding and Content-Length")

    def _check_key(self, keys: tuple[str, ...]) -> None:
        given = self.headers.get("Authorization") or self.headers.get("X-Api-Key") or ""
        if given.startswith("Bearer "):
            given = given[len("Bearer "):]
        ok = False
        for k in keys:  # compare with every key, so timing tells nothing about which or how much matched
            ok |= hmac.compare_digest(given.encode(), k.encode())
        if not ok:
            raise authentication()

    def _gone(self) -> bool:
        """True if the client closed its side (readable with nothing to read)."""
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            if not r:
                return False
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    # ---- writing ----

    def _cors(self) -> None:
        """llama-server's CORS answer for --cors-origins: "*" echoes the Origin, "localhost" echoes a localhost one
        only, anything else is sent as given."""
        origin = self.headers.get("Origin")
        allowed = self.server.state.config.cors_origins
        if allowed == "*":
            self.send_header("Access-Control-Allow-Origin", origin or "*")
        elif allowed == "localhost":
            if origin and _is_localhost(origin):
                self.send_header("Access-Control-Allow-Origin", origin)
        else:
            self.send_header("Access-Control-Allow-Origin", allowed)
        if origin:
            self.send_header("Access-Control-Allow-Credentials", "true")

    def _send(self, r: Reply) -> None:
        self.send_response(r.status)
        self._cors()
        self.send_header("Content-Type", r.content_type)
        self.send_header("Content-Length", str(len(r.body)))
        for k, v in r.headers.items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self._sent = True
        if self.command != "HEAD":
            self.wfile.write(r.body)
        self.wfile.flush()

    def _send_stream(self, s: Stream) -> int:
        self.send_response(200)
        self._cors()
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._sent = True
        status = 200
        try:
            try:
                for data in s.chunks:
                    self.wfile.write(b"%x\r\n%b\r\n" % (len(data), data))
                    self.wfile.flush()
            except OSError:
                raise
            except Exception:  # a bug while streaming: an error event ends the stream (one status line only)
                log.exception("error while streaming")
                s.on_abort()
                status = 500
                self.close_connection = True
                data = sse.error_event(ApiError(500, "server_error", "internal server error").body())
                self.wfile.write(b"%x\r\n%b\r\n" % (len(data), data))
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            return status
        except (TimeoutError, BrokenPipeError, ConnectionResetError, OSError):
            s.on_abort()
            self.close_connection = True
            return 499
        finally:
            close = getattr(s.chunks, "close", None)
            if close is not None:
                close()


def _load(config: ServerConfig, st: AppState) -> Llama:
    """Load the model (HTTP already answering 503), then hand the engine to the routes."""
    info = require_moe(config.model)
    threads = config.threads or engine_threads()
    policy = None
    if config.policy is not None:  # checked before the model loads: a bad file fails fast
        if config.residual is None:
            raise RapidMoEError("--policy needs --residual (a UMIA policy picks critical experts of a split model)")
        policy = load_policy(config.policy)
    try:
        llm = Llama(config.model, n_ctx=config.ctx_size, n_batch=config.n_batch, n_ubatch=config.n_batch,
                    n_threads=threads, n_threads_batch=threads, n_gpu_layers=config.n_gpu_layers,
                    n_cpu_moe=config.n_cpu_moe, override_tensor=list(config.override_tensor) or None,
                    rpc_servers=list(config.rpc_servers) or None, tensor_split=list(config.tensor_split) or None,
                    expert_cache=config.expert_cache,
                    residual_path=config.residual, n_critical=config.n_critical, overlap=config.overlap,
                    flash_attn=config.flash_attn,
                    n_seq_max=config.parallel, trace=config.trace, pooling_type=pooling_type(config.pooling),
                    verbose=config.verbose)
    except RapidMoEError:
        raise
    except ValueError as e:
        raise ModelFileError(f"llama.cpp could not load {config.model} ({info.architecture}): {e}") from e
    if policy is not None:
        try:
            llm.set_policy(policy)
        except Exception:
            llm.close()
            raise
    md = llm.metadata
    template = config.chat_template or md.get("tokenizer.chat_template") or CHATML
    if config.jinja and template == "chatml":  # the one built-in name llama-server's Jinja path takes
        template = CHATML
    if not config.jinja and not legacy_chat.supported(template):
        llm.close()
        raise RapidMoEError("--no-jinja: llama.cpp has no built-in format for this chat template; give "
                            f"--chat-template NAME ({', '.join(legacy_chat.builtin_names())}) or drop --no-jinja")
    bos = _token_text(llm, llm.token_bos()) if llm.token_bos() >= 0 else ""
    eos = _token_text(llm, llm.token_eos()) if llm.token_eos() >= 0 else ""
    st.template = ChatTemplate(template, bos, eos, jinja=config.jinja, kwargs=dict(config.chat_template_kwargs),
                               add_bos=bool(lc.llama_vocab_get_add_bos(llm.vocab)),
                               add_eos=bool(lc.llama_vocab_get_add_eos(llm.vocab)))
    st.add_bos = md.get("tokenizer.ggml.add_bos_token", "true") != "false"
    st.model_meta = native.model_meta(llm, str(config.model))
    st.engine = Engine(llm, n_parallel=config.parallel, queue_size=config.queue_size, n_batch=config.n_batch,
                       queue_timeout=config.queue_timeout, embeddings=config.embeddings)
    log.info("model loaded: %s (%s), %d slots x %d tokens of context", config.model, info.architecture,
             config.parallel, st.engine.n_ctx_slot)
    return llm


def _token_text(llm: Llama, token: int) -> str:
    """A token's text as the vocabulary holds it (the chat template's bos_token and eos_token)."""
    return str(lc.llama_vocab_get_text(llm.vocab, token).decode("utf-8"))


def engine_threads() -> int:
    """Default compute threads: all cores but one. ggml's threads spin while they wait for work; if they take
    every core, the HTTP threads (Python, needing the GIL) are descheduled between tokens and each token waits
    for them (measured on 2 cores: 87 ms per token with 2 threads, 4 ms with 1)."""
    return max(1, (os.cpu_count() or 2) - 1)


def make_server(config: ServerConfig) -> tuple[_Server, AppState]:
    handler = type("ConfiguredHandler", (Handler,), {"timeout": config.timeout})
    try:
        server = _Server((config.host, config.port), handler, config.max_connections)
    except OSError as e:
        raise RapidMoEError(f"cannot listen on {config.host}:{config.port}: {e.strerror or e}") from None
    server.state = AppState(config)
    return server, server.state


def run_server(config: ServerConfig, stop: threading.Event | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or `stop` is set); the socket answers 503 while the model loads."""
    server, st = make_server(config)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    http = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="rapidmoe-http",
                            daemon=True)
    http.start()
    host, port = server.server_address[:2]
    log.warning("listening on http://%s:%d (loading %s)", host, port, config.model)
    llm = None
    try:
        llm = _load(config, st)
        log.warning("ready: http://%s:%d", host, port)
        stop.wait()
    finally:
        st.closing = True  # new requests: 503
        server.shutdown()
        server.server_close()
        if st.engine is not None:
            st.engine.close()  # aborts a running decode; requests in flight get 503
        t0 = time.monotonic()  # their HTTP threads may still use the model (tokenizing): wait for them
        while server.n_active and time.monotonic() - t0 < config.timeout:
            time.sleep(0.02)
        if llm is not None and server.n_active:
            log.warning("%d requests still answering after %.0f s: the model is not freed", server.n_active,
                        config.timeout)
        elif llm is not None:
            llm.close()
