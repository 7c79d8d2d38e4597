"""llama.cpp's RPC backend: a ggml device in another process (`rpc-server`), reached over TCP.

RapidMoE uses it as a stand-in second device on machines without a GPU: tensors placed on it (`-ngl`, or an
override such as "exps=RPC0[127.0.0.1:50052]") live and are computed in the rpc-server process, so placement,
cross-device copies and the scheduler's splits are exercised exactly as with a GPU. The package ships the
server built from the same pin (rapidmoe/bin/rpc-server); `RPCServer` starts one on a free loopback port, as a
child that ends with this process even when `stop()` is forgotten or the interpreter is killed (`_children`).

Registering a server is what llama.cpp's `--rpc host:port` does: its devices join ggml's device list, once per
process. ggml's RPC client aborts the whole process when an endpoint does not answer, so `register_rpc_servers`
checks with a plain TCP connection first and raises RapidMoEError instead.
"""
from __future__ import annotations

import ctypes
import logging
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import _children
from ._runtime import _core
from .errors import RapidMoEError

log = logging.getLogger(__name__)

# installed next to rapidmoe._core (in an editable install that is site-packages, not the source tree)
RPC_SERVER = Path(_core.__file__).resolve().parent / "bin" / "rpc-server"


@dataclass(frozen=True)
class RPCDevice:
    endpoint: str  # "host:port"
    name: str  # ggml device name, e.g. "RPC0" (numbered in registration order across servers)
    buffer_type: str  # its buffer type name, for tensor overrides: e.g. "RPC0[127.0.0.1:50052]"
    address: int  # ggml_backend_dev_t


_registered: dict[str, list[RPCDevice]] = {}  # endpoint -> its devices, for this process


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' -> (host, port); RapidMoEError for anything else."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RapidMoEError(f"bad RPC server address {endpoint!r}: expected host:port, e.g. 127.0.0.1:50052")
    return host, int(port)


def parse_servers(value: str | Sequence[str] | None) -> list[str]:
    """llama.cpp's `--rpc SERVERS`: "host:port,host:port,..." (or a list of them) -> the endpoints, in order, each
    checked by parse_endpoint; duplicates are refused (one server registers its devices once)."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    out = [e.strip() for e in items if e.strip()]
    if not out:
        raise RapidMoEError(f"no RPC server in {value!r}: expected host:port[,host:port...]")
    for e in out:
        parse_endpoint(e)
    dup = sorted({e for e in out if out.count(e) > 1})
    if dup:
        raise RapidMoEError(f"RPC server {dup[0]} given twice")
    return out


def check_reachable(endpoint: str, timeout: float = 2.0) -> None:
    """Raise RapidMoEError unless something accepts TCP connections at endpoint."""
    host, port = parse_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        raise RapidMoEError(f"RPC server {endpoint} is not reachable: {e}") from None


def register_rpc_servers(endpoints: Sequence[str]) -> list[RPCDevice]:
    """Register the devices of these rpc-servers with ggml (once per endpoint and process); returns them in order."""
    out: list[RPCDevice] = []
    for endpoint in endpoints:
        if endpoint not in _registered:
            check_reachable(endpoint)
            try:
                pairs = _core.rpc_add_server(endpoint)
            except RuntimeError as e:
                raise RapidMoEError(str(e)) from None
            addr = {name: a for name, _, _, reg, a in _core.devices() if reg == "RPC"}
            _registered[endpoint] = [RPCDevice(endpoint, n, b, addr[n]) for n, b in pairs]
            log.info("RPC server %s: devices %s", endpoint, ", ".join(d.buffer_type for d in _registered[endpoint]))
        out.extend(_registered[endpoint])
    return out


def registered_rpc_devices() -> list[RPCDevice]:
    return [d for devs in _registered.values() for d in devs]


def model_devices(rpc: Sequence[RPCDevice]) -> ctypes.Array[ctypes.c_void_p] | None:
    """The NULL-terminated llama_model_params.devices for a model that uses these RPC devices, or None (llama.cpp's
    default) when no RPC server is registered in this process.

    llama.cpp's default takes every registered RPC device (and would talk to servers another Llama registered,
    possibly gone by now); this list holds only `rpc` (first, as llama.cpp orders them) and then the devices the
    default would choose: every GPU, or the integrated GPUs when there is none.
    """
    if not _registered:
        return None
    local = [(t, a) for _, _, t, reg, a in _core.devices() if reg != "RPC" and t in ("gpu", "igpu")]
    gpus = [a for t, a in local if t == "gpu"]
    chosen = [d.address for d in rpc] + (gpus or [a for t, a in local if t == "igpu"])
    arr = (ctypes.c_void_p * (len(chosen) + 1))(*chosen, None)
    return arr


def server_command(host: str = "127.0.0.1", port: int = 50052, threads: int | None = None,
                   devices: str | Sequence[str] | None = None, cache: bool = False,
                   binary: str | os.PathLike[str] | None = None) -> list[str]:
    """The command line of the package's rpc-server (llama.cpp's flags) serving these devices on host:port."""
    exe = Path(binary) if binary is not None else RPC_SERVER
    if not exe.is_file():
        raise RapidMoEError(f"rpc-server not found at {exe}: this build has no RPC backend (RAPIDMOE_RPC=OFF?)")
    parse_endpoint(f"{host}:{port}")
    cmd = [str(exe), "-H", host, "-p", str(port)]
    if threads is not None:
        if threads < 1:
            raise RapidMoEError(f"rpc-server threads must be >= 1, got {threads}")
        cmd += ["-t", str(threads)]
    if devices:
        names = devices.split(",") if isinstance(devices, str) else list(devices)
        known = {name for name, *_ in _core.devices()}
        bad = [d for d in names if d.strip() not in known]
        if bad:
            raise RapidMoEError(f"unknown ggml device {bad[0]!r} for rpc-server (this machine has: "
                                f"{', '.join(sorted(known))})")
        cmd += ["-d", ",".join(d.strip() for d in names)]
    if cache:
        cmd.append("-c")
    return cmd


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RPCServer:
    """A local rpc-server process (the package's own build): `with RPCServer() as srv: srv.endpoint`.

    It serves this machine's CPU (the only ggml device it has here) with `threads` threads. One client at a time.
    The process ends with `stop()`, the `with` block, or this interpreter, whichever comes first: at exit, and on
    Linux also when the interpreter is killed (the rpc-server gets SIGTERM from the kernel, see `_children`).
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, threads: int = 1,
                 binary: str | os.PathLike[str] | None = None, startup_timeout: float = 10.0) -> None:
        exe = Path(binary) if binary is not None else RPC_SERVER
        if not exe.is_file():
            raise RapidMoEError(f"rpc-server not found at {exe}: this build has no RPC backend (RAPIDMOE_RPC=OFF?)")
        self.host = host
        self.port = port if port is not None else _free_port(host)
        self.endpoint = f"{host}:{self.port}"
        self._log = tempfile.TemporaryFile()  # its output (a pipe nobody reads could fill and block it)
        self.proc: subprocess.Popen[bytes] | None = _children.spawn(
            server_command(host, self.port, threads, binary=exe), stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                err = self.output()
                self.stop()
                raise RapidMoEError(f"rpc-server exited at start: {err[-500:]}")
            try:
                with socket.create_connection((host, self.port), timeout=0.5):
                    break
            except OSError as e:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RapidMoEError(
                        f"rpc-server did not listen on {self.endpoint} within {startup_timeout} s") from e
                time.sleep(0.05)
        log.info("rpc-server %d listening on %s", self.proc.pid, self.endpoint)

    def stop(self) -> None:
        """End the server (SIGTERM, SIGKILL after 5 s). A server still running ends with this process (_children)."""
        if self.proc is not None:
            _children.stop(self.proc)
        self.proc = None

    @property
    def device(self) -> RPCDevice:
        """This server's (first) ggml device, registered in this process on first use: its name ("RPC<n>", n
        counting every server registered before it) and buffer type ("RPC<n>[host:port]")."""
        return register_rpc_servers([self.endpoint])[0]

    def output(self) -> str:
        """What the server printed so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace").strip()

    def __enter__(self) -> RPCServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
