"""Running one input through a real entry point and saying what happened.

Outcomes: ok (exit 0), clean_error (exit 1 with exactly one `rapidmoe-cli: error: ...` line and no traceback), and
the findings: crash (a signal; an abort that printed llama.cpp's message is still a crash), hang (past the timeout),
traceback (a Python exception escaped), sanitizer (an AddressSanitizer/UBSan report), bad_error (a failure without
the one error line), half_written (an output file left incomplete or where the command failed).

Two runners with the same interface: ForkRunner (forkserver.py: imports once, forks per input) for volume, and
SubprocessRunner (a fresh `python -m rapidmoe.cli` per input) for reproducing a finding exactly as a user runs it.
"""
from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

TOOLS = Path(__file__).resolve().parent.parent
ERROR_PREFIX = "rapidmoe-cli: error: "
SANITIZER_MARKS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:", "UndefinedBehaviorSanitizer",
                   "AddressSanitizer:DEADLYSIGNAL")


class Outcome(str, enum.Enum):
    ok = "ok"
    clean_error = "clean_error"
    crash = "crash"
    hang = "hang"
    traceback = "traceback"
    sanitizer = "sanitizer"
    bad_error = "bad_error"
    half_written = "half_written"

    @property
    def is_finding(self) -> bool:
        return self not in (Outcome.ok, Outcome.clean_error)


@dataclass(frozen=True)
class Run:
    """What a runner observed."""

    rc: int  # negative: killed by that signal
    timed_out: bool
    stdout: str
    stderr: str
    elapsed: float


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    detail: str  # the error line, the signal, the exception's last line, the sanitizer's summary


def _last_line(text: str, mark: str) -> str:
    lines = [ln for ln in text.splitlines() if mark in ln]
    return lines[-1].strip() if lines else ""


def classify(run: Run, output_problem: str | None = None) -> Verdict:
    """The outcome of a run; output_problem: what the caller found wrong with the command's output files."""
    err = run.stderr
    for mark in SANITIZER_MARKS:
        if mark in err:
            summary = _last_line(err, "SUMMARY:") or _last_line(err, mark)
            return Verdict(Outcome.sanitizer, summary)
    if run.timed_out:
        return Verdict(Outcome.hang, f"no exit after {run.elapsed:.0f} s")
    if run.rc < 0:
        try:
            name = signal.Signals(-run.rc).name
        except ValueError:
            name = f"signal {-run.rc}"
        said = _last_line(err, "llama.cpp aborted")
        return Verdict(Outcome.crash, name + (f" ({said})" if said else " (nothing printed)"))
    if "Traceback (most recent call last)" in err:
        lines = [ln for ln in err.splitlines() if ln and not ln.startswith(" ")]
        return Verdict(Outcome.traceback, lines[-1] if lines else "traceback")
    if output_problem is not None:
        return Verdict(Outcome.half_written, output_problem)
    if run.rc == 0:
        return Verdict(Outcome.ok, "")
    errors = [ln for ln in err.splitlines() if ln.startswith(ERROR_PREFIX)]
    if run.rc == 1 and len(errors) == 1:
        return Verdict(Outcome.clean_error, errors[0][len(ERROR_PREFIX):])
    tail = err.strip().splitlines()[-1:] or ["(no stderr)"]
    return Verdict(Outcome.bad_error, f"exit {run.rc}, {len(errors)} error lines: {tail[0][:300]}")


def base_env(asan: Sequence[str] = ()) -> dict[str, str]:
    """The children's environment: tools/ importable, unbuffered, and with `asan` (paths of the sanitizer
    runtimes) preloaded with the options a fuzz run needs (no leak check: Python's own allocations never free)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAPIDMOE_PROG": "rapidmoe-cli"}
    env["PYTHONPATH"] = os.pathsep.join([str(TOOLS), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("RAPIDMOE_DEBUG", None)
    if asan:
        env["LD_PRELOAD"] = ":".join(asan)
        env["ASAN_OPTIONS"] = ("detect_leaks=0:abort_on_error=0:halt_on_error=1:allocator_may_return_null=1:"
                               "hard_rss_limit_mb=6000:detect_odr_violation=0:verify_asan_link_order=0")
        env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    elif "libasan" not in env.get("LD_PRELOAD", ""):  # (inherited from tools/asan_build.sh --test: ASan's RSS cap)
        # an input that makes a reader allocate without bound fails here (an address-space limit: not under ASan,
        # whose shadow memory reserves terabytes)
        env["RAPIDMOE_FUZZ_MEM_MB"] = "6000"
    return env


class SubprocessRunner:
    """`python -m rapidmoe.cli ARGS` (or a reader target) in a fresh process."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env

    def run(self, argv: Sequence[str], timeout: float, cwd: Path | None = None) -> Run:
        if argv[:1] == ["--reader"]:
            cmd = [sys.executable, "-c", "import sys; from fuzz.readers import run_reader; "
                   "sys.exit(run_reader(sys.argv[1], sys.argv[2]))", *argv[1:]]
        else:
            cmd = [sys.executable, "-m", "rapidmoe.cli", *argv]
        t0 = time.monotonic()
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                             cwd=cwd or self.workdir, env=self.env, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            timed_out = True
        return Run(p.returncode, timed_out, out.decode(errors="replace"), err.decode(errors="replace"),
                   time.monotonic() - t0)

    def close(self) -> None:
        pass


class ForkRunner:
    """A forkserver.py process: one child per input; restarted if it dies."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir.resolve()  # the server runs in it: a relative path would be taken from there
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.env = {**env, "RAPIDMOE_FUZZ_STDERR": str(self.workdir / "child.stderr")}
        self.proc: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        log: IO[bytes] = open(self.workdir / "server.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", "fuzz.forkserver"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=log, text=True, env=self.env, cwd=self.workdir)
        log.close()
        return p

    def run(self, argv: Sequence[str], timeout: float, cwd: Path | None = None) -> Run:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        out_path = self.workdir / "child.stdout"
        req = {"argv": list(argv), "cwd": str(cwd or self.workdir), "timeout": timeout, "stdout": str(out_path)}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server died: {(self.workdir / 'server.log').read_text()[-2000:]}")
        rep = json.loads(line)
        return Run(int(rep["rc"]), bool(rep["timed_out"]), _read(out_path), _read(self.workdir / "child.stderr"),
                   float(rep["elapsed"]))

    def close(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def _read(p: Path) -> str:
    try:
        return p.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return ""


Runner = ForkRunner | SubprocessRunner
