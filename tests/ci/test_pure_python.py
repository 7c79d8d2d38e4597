"""The pure-Python parts (policies, planner, frontier and latency fits, GGUF reader, synthetic models) import and pass
without the compiled parts: their tests run in a subprocess where rapidmoe._core and the ctypes layer cannot be
imported (as in a checkout without a build), with the tests marked `native` deselected.

Which test modules run there is derived, not listed: in that subprocess a probe imports every test_*.py under tests/
(in every subject's folder: tests/cache/, tests/server/, ...); a module that reaches a blocked name while it imports
(at its top, or through what it imports) needs the build and is left out; every other one runs, so a test that needs
the build without importing it at its module's top must carry the `native` marker or fail here. A module whose import
fails for any other reason fails this test."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from testkit import ROOT

TESTS = ROOT / "tests"
# the parts the README promises work without a build: their test modules (paths under tests/) must stay among the
# derived ones
ALWAYS_PURE = {"conversion/test_synthetic.py", "conversion/test_ggufio.py", "placement/test_placement.py",
               "umia/test_umia.py", "umia/test_umia_calibration.py", "ci/test_gpu_check.py"}
MIN_PASSED = 120  # measured: 142 (the derived modules' tests not marked native)

# imported first in the subprocess (PYTHONPATH): the compiled parts behave as if they were never built
BLOCKER = '''
import importlib.abc, importlib.machinery, sys

class _Missing(importlib.abc.Loader):
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r} (no native build)", name=spec.name)

    def exec_module(self, module):
        pass

class _NoNative(importlib.abc.MetaPathFinder):
    NAMES = ("rapidmoe._core", "rapidmoe._llama_cpp", "llama_cpp")
    asked = []  # the blocked names imports asked for, in order (the probe reads it)

    def find_spec(self, name, path=None, target=None):
        if name in self.NAMES or name.startswith(tuple(n + "." for n in self.NAMES)):
            self.asked.append(name)
            return importlib.machinery.ModuleSpec(name, _Missing())
        return None

sys.meta_path.insert(0, _NoNative())
'''


# run in the blocked subprocess: sorts the test_*.py under tests/ (but this file) by whether they import without the
# build; each is named by its path under tests/ and imported by its name with its folder on sys.path, as pytest's
# default (prepend) import mode does
PROBE = '''
import importlib, json, sys, traceback
from pathlib import Path

import pytest

tests = Path(sys.argv[1])
sys.path.insert(0, str(tests))
import conftest  # noqa: F401 - its sys.path entries, as under pytest

blocker = next(f for f in sys.meta_path if type(f).__name__ == "_NoNative")
found = {"pure": [], "native": {}, "broken": {}}
for p in sorted(tests.rglob("test_*.py")):
    name = p.relative_to(tests).as_posix()
    if name == sys.argv[2]:
        continue
    if str(p.parent) not in sys.path:
        sys.path.insert(0, str(p.parent))
    blocker.asked.clear()
    try:
        importlib.import_module(p.stem)
    except pytest.skip.Exception:  # a module-level skip: pytest reports it
        found["pure"].append(name)
    except Exception:
        if blocker.asked:
            found["native"][name] = blocker.asked[0]
        else:
            found["broken"][name] = traceback.format_exc(limit=4)
    else:
        found["pure"].append(name)
print(json.dumps(found))
'''


@pytest.mark.slow
def test_pure_tests_pass_without_the_native_module(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "RAPIDMOE_CACHE": str(tmp_path / "cache")}
    probe = subprocess.run([sys.executable, "-c", "import rapidmoe\ntry:\n    rapidmoe.Llama\nexcept ImportError as e:"
                            "\n    print('blocked:', e)"], env=env, capture_output=True, text=True, timeout=60)
    assert "blocked:" in probe.stdout and "_llama_cpp" in probe.stdout, probe.stdout + probe.stderr
    this = Path(__file__).resolve().relative_to(TESTS).as_posix()
    sort = subprocess.run([sys.executable, "-c", PROBE, str(TESTS), this], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert sort.returncode == 0, sort.stdout[-3000:] + sort.stderr[-3000:]
    found = json.loads(sort.stdout.strip().splitlines()[-1])
    assert not found["broken"], f"test modules that fail to import without the build: {found['broken']}"
    assert ALWAYS_PURE <= set(found["pure"]), f"need the build now: {sorted(ALWAYS_PURE - set(found['pure']))}"
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not native",
                          *[str(TESTS / f) for f in found["pure"]]],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    tail = f"ran {found['pure']}\n" + res.stdout[-3000:] + res.stderr[-2000:]
    assert res.returncode == 0, tail
    passed = re.search(r"(\d+) passed", res.stdout)
    assert passed and int(passed.group(1)) >= MIN_PASSED, tail
