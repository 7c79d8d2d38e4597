"""Shared fixtures: tiny synthetic models (made once per session), the stock llama.cpp reference build, a local
rpc-server; a session-end check that no test left a process running; under CI, a skip that should not happen there
fails (CI_LEGITIMATE_SKIPS). Shared constants: tests/testkit.py."""
from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Generator, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from rapidmoe.paths import vocab_dir as find_vocab_dir
from rapidmoe.resplit import convert, get_preset
from rapidmoe.synthetic import spec_for, write_model

if TYPE_CHECKING:
    from rapidmoe.rpc import RPCServer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ARCHS = ("qwen3moe", "deepseek2")

# Under CI (the environment variable CI set, as our CI runs .ci/run: CI=true) a test or module that skips FAILS
# instead, with its reason, unless the reason starts with one of these keys: the skips that are legitimate there.
# Everything else CI provides (the test extra, Chromium and chromedriver, the pinned sdist and vendor/llama.cpp from
# the build, llama.cpp's vocab GGUFs, ../shared/models, Linux), so any other skip there would hide a test that
# silently stopped running. xfail is not a skip here: pyproject's xfail_strict fails an unexpected pass.
CI_LEGITIMATE_SKIPS = {
    "stock llama-server not built": "tests/server/test_server_choices.py compares with stock llama-server, a 10-minute "
                                    "build (python tools/stock_llama.py llama-server) that CI does not do",
    "a GPU may be present": "tests/ci/test_gpu_check.py's no-GPU path cannot run on a machine with nvidia-smi",
    "no repacked Q2_K layout on this CPU": "our build repacks Q2_K on x86 only where the CPU reports AVX2 or "
                                           "AVX-512 (patch 0006)",
}


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _forbidden_skip(rep: pytest.TestReport | pytest.CollectReport) -> str | None:
    """The reason of a skip CI must not take (None: not a skip, not CI, an xfail, or a legitimate skip)."""
    if not rep.skipped or hasattr(rep, "wasxfail") or not _ci():
        return None
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    reason = reason.removeprefix("Skipped: ")
    return None if reason.startswith(tuple(CI_LEGITIMATE_SKIPS)) else reason


def _ci_message(reason: str) -> str:
    return (f"skipped under CI (CI={os.environ.get('CI')}): {reason}\nCI must run this; if the skip is legitimate "
            "there, add its reason to CI_LEGITIMATE_SKIPS in tests/conftest.py, saying why")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    outcome = yield
    rep: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    reason = _forbidden_skip(rep)
    if reason is not None:
        rep.outcome = "failed"
        rep.longrepr = _ci_message(reason)


class _SkippedUnderCI(pytest.Item):
    """Stands for a test module that skipped as a whole while collected under CI: fails with the skip's reason (a
    failed collection would stop the whole session before any test ran)."""

    def __init__(self, *, reason: str, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.reason = reason

    def runtest(self) -> None:
        pytest.fail(_ci_message(self.reason), pytrace=False)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, self.name


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, None, None]:
    """A module that skips as a whole when imported (pytest.skip(allow_module_level=True), importorskip): the same
    rule, as one failing test in that module's place."""
    outcome = yield
    rep: pytest.CollectReport = outcome.get_result()  # type: ignore[attr-defined]
    reason = _forbidden_skip(rep)
    if reason is not None:
        rep.outcome = "passed"
        rep.longrepr = None
        rep.result = [_SkippedUnderCI.from_parent(collector, name="module_skipped_under_CI", reason=reason)]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The all-architecture sweep (tests/conversion/test_archs.py) runs only when asked for by name: -m arch_sweep."""
    if "arch_sweep" in (config.getoption("markexpr") or ""):
        return
    skipped = [it for it in items if it.get_closest_marker("arch_sweep") is not None]
    if skipped:
        config.hook.pytest_deselected(items=skipped)
        items[:] = [it for it in items if it.get_closest_marker("arch_sweep") is None]


def _live_descendants(root: int) -> dict[int, str]:
    """pid -> command line of every running (not zombie) process below root, from /proc."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended while we looked
            continue
        if fields[0] != "Z":
            parent[int(d.name)] = int(fields[1])
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        p = todo.pop()
        for child in (c for c, pp in parent.items() if pp == p):
            try:
                found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            todo.append(child)
    return found


def _signal(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session", autouse=True)
def no_leaked_processes() -> Iterator[None]:
    """Torn down last: a process a test started and never ended (an RPCServer or a serve without stop(), say) is
    ended here and fails the session by name, rather than living on after it."""
    yield
    if not sys.platform.startswith("linux"):
        return
    # multiprocessing's resource tracker and forkserver stay until this process ends (they wait for EOF on a pipe)
    left = {pid: cmd for pid, cmd in _live_descendants(os.getpid()).items()
            if "multiprocessing.resource_tracker" not in cmd and "multiprocessing.forkserver" not in cmd}
    if not left:
        return
    _signal(left, signal.SIGTERM)
    time.sleep(1.0)
    _signal(left.keys() & _live_descendants(os.getpid()).keys(), signal.SIGKILL)
    pytest.fail("processes left running by the tests (now ended): "
                + "; ".join(f"{pid} {cmd[:200]}" for pid, cmd in sorted(left.items())), pytrace=False)


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    try:
        return find_vocab_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def _make(model_dir: Path, vocab_dir: Path, arch: str, dtype: str) -> Path:
    path = model_dir / f"tiny-{arch}-{dtype}.gguf"
    if not path.exists():
        write_model(spec_for(arch, "tiny", seed=0, dtype=dtype), path, vocab_dir)
    return path


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model(request: pytest.FixtureRequest, model_dir: Path, vocab_dir: Path) -> Path:
    """The tiny F16 model of each architecture."""
    return _make(model_dir, vocab_dir, request.param, "f16")


@pytest.fixture(scope="session")
def tiny_qwen(model_dir: Path, vocab_dir: Path) -> Path:
    return _make(model_dir, vocab_dir, "qwen3moe", "f16")


@pytest.fixture(scope="session")
def make_tiny(model_dir: Path, vocab_dir: Path):  # type: ignore[no-untyped-def]
    """make_tiny(arch, dtype) -> path, cached for the session."""
    return lambda arch, dtype="f16": _make(model_dir, vocab_dir, arch, dtype)


@pytest.fixture(scope="session")
def make_split(model_dir: Path, vocab_dir: Path):  # type: ignore[no-untyped-def]
    """make_split(arch, preset="cpu") -> (F16 source, .wq.gguf, .wr.gguf), converted once per session."""
    done: dict[tuple[str, str], tuple[Path, Path, Path]] = {}

    def make(arch: str, preset: str = "cpu") -> tuple[Path, Path, Path]:
        if (arch, preset) not in done:
            src = _make(model_dir, vocab_dir, arch, "f16")
            res = convert(src, model_dir / f"split-{arch}-{preset}", get_preset(preset), progress=False)
            done[arch, preset] = (src, res.wq_path, res.wr_path)
        return done[arch, preset]

    return make


@pytest.fixture(scope="module")
def rpc(request: pytest.FixtureRequest) -> Iterator[RPCServer]:
    """A local rpc-server (llama.cpp's RPC backend: the stand-in second device), one per test module; the module's
    RPC_THREADS sets its threads (default 1)."""
    from rapidmoe.rpc import RPCServer  # noqa: PLC0415 - the extension (conftest imports without a build)

    with RPCServer(threads=getattr(request.module, "RPC_THREADS", 1)) as srv:
        yield srv


@pytest.fixture
def plain_q8_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q8_0 weights stay plain (RAPIDMOE_Q8_0_REPACK=0, read at each weight load): the rpc-server stand-in's CPU
    backend has no repacked layouts, so with EXACT_PRESET's Q8_0 matrices plain on both sides the same kernel runs
    in both processes (patch 0016 repacks Q8_0 on x86 for speed, which sums in another order)."""
    monkeypatch.setenv("RAPIDMOE_Q8_0_REPACK", "0")


@pytest.fixture(scope="session")
def stock_bin() -> Path:
    """Folder with STOCK (unpatched) libllama of the same pin; built on first use, reused after."""
    from stock_llama import build_stock  # noqa: PLC0415 - tools/, on sys.path from this file's top

    return build_stock(["llama"])
