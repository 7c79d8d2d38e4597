"""Constants the test modules share, defined once (fixtures live in conftest.py). Pure Python: imports neither the
compiled parts nor rapidmoe, so every test module may import it, the no-build run (ci/test_pure_python.py) included."""
from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent

# Under tools/asan_build.sh --test (AddressSanitizer preloaded): its shadow memory, redzones and quarantine add tens
# of MB of RSS, so the resident-memory checks do not apply; and every program started with this environment gets the
# preload too (chromedriver exits at once), so such programs are started without it
# (sanitizer_free_env).
SANITIZED = "libasan" in os.environ.get("LD_PRELOAD", "")


def sanitizer_free_env() -> dict[str, str]:
    """This process's environment without the sanitizer preload: for programs that are not ours (a browser)."""
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}

# The prompt the engine tests tokenize (repeated_text(n) where they need more tokens).
TEXT = b"The mixture of experts routes every token to a few experts; the rest of the network is dense."


def repeated_text(n: int) -> bytes:
    """TEXT n times, each followed by a space: the prompt of the tests that need more tokens."""
    return (TEXT + b" ") * n


def ggml_cpu_counter(name: str) -> int:
    """A counter our CPU ops export from ggml-cpu (rapidmoe_moe_sum_count, rapidmoe_tiny_run_count), read from the
    copy of the library this process loaded: dlopen of another name of the file (libggml-cpu.so for the engine's
    libggml-cpu.so.0) would load a second copy with counters of its own."""
    loaded = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
              if "/libggml-cpu.so" in line}
    assert len(loaded) == 1, loaded
    fn = getattr(ctypes.CDLL(loaded.pop()), name)
    fn.restype = ctypes.c_longlong
    return int(fn())


# The server tests' greedy sampling (request fields), spread into a request: {**GREEDY, "n": 2}
GREEDY = {"temperature": 0}

# The CPU-vs-stand-in comparisons use preset cpu-q8: its non-expert matrices are Q8_0, which x86 CPUs run with
# the same kernel in both processes when it stays plain (conftest's plain_q8_0: patch 0016 repacks Q8_0 here, the
# stand-in's CPU backend has no repacked layouts). The cpu preset's Q4_K attention is repacked
# on this CPU and not on the stand-in (its CPU backend keeps the plain layout): two kernels with different
# summation orders, which a random-weight model amplifies past any tolerance that would still catch a bug.
EXACT_PRESET = "cpu-q8"


def _load_fetch_upstream() -> ModuleType:
    """src/rapidmoe_ggml/fetch_upstream.py (the build's pin and patch tool; not an installed module)."""
    spec = importlib.util.spec_from_file_location("fetch_upstream", ROOT / "src/rapidmoe_ggml/fetch_upstream.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


fetch_upstream = _load_fetch_upstream()
# The pinned llama-cpp-python (src/rapidmoe_ggml/upstream.json) and its sdist as the build downloads it: a pin bump
# moves every test that uses it along.
PIN: dict[str, str] = fetch_upstream.load_pin()
PINNED_SDIST = ROOT / "vendor" / "downloads" / PIN["sdist"]
