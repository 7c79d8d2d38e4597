"""Shared fixtures: tiny synthetic models (made once per session) and the stock llama.cpp reference build; a
session-end check that no test left a process running."""
from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

ARCHS = ("qwen3moe", "deepseek2")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The all-architecture sweep (tests/test_archs.py) runs only when asked for by name: -m arch_sweep."""
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
    from rapidmoe.paths import vocab_dir as find

    try:
        return find()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def _make(model_dir: Path, vocab_dir: Path, arch: str, dtype: str) -> Path:
    from rapidmoe.synthetic import spec_for, write_model

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
    from rapidmoe.resplit import convert, get_preset

    done: dict[tuple[str, str], tuple[Path, Path, Path]] = {}

    def make(arch: str, preset: str = "cpu") -> tuple[Path, Path, Path]:
        if (arch, preset) not in done:
            src = _make(model_dir, vocab_dir, arch, "f16")
            res = convert(src, model_dir / f"split-{arch}-{preset}", get_preset(preset), progress=False)
            done[arch, preset] = (src, res.wq_path, res.wr_path)
        return done[arch, preset]

    return make


@pytest.fixture(scope="session")
def stock_bin() -> Path:
    """Folder with STOCK (unpatched) libllama of the same pin; built on first use, reused after."""
    from stock_llama import build_stock

    return build_stock(["llama"])
