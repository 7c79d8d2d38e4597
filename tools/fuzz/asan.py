"""The sanitizer build's environment (tools/asan_build.sh makes the build): libasan and libubsan preloaded into
Python (which is not built with them), build/asan/site first on the path, and the editable install's import hook
told to step aside (scikit-build-core's SKBUILD_EDITABLE_SKIP names the build trees whose hook must not answer)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .harness import base_env

ROOT = Path(__file__).resolve().parents[2]
SUPPRESSIONS = Path(__file__).resolve().with_name("ubsan.supp")


def runtime(lib: str) -> str:
    """The compiler's path of a sanitizer runtime (libasan.so, libubsan.so)."""
    out = subprocess.run(["gcc", f"-print-file-name={lib}"], capture_output=True, text=True, check=True).stdout
    path = out.strip()
    if not os.path.isabs(path):
        raise FileNotFoundError(f"gcc has no {lib}: install the sanitizer runtimes (libasan, libubsan)")
    return os.path.realpath(path)


def asan_env(build: Path) -> dict[str, str]:
    site = (build / "site").resolve()
    if not list((site / "rapidmoe").glob("_core*.so")):
        raise FileNotFoundError(f"{site} has no sanitized rapidmoe: run tools/asan_build.sh first")
    env = base_env([runtime("libasan.so"), runtime("libubsan.so")])
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    trees = [str(p) for p in sorted((ROOT / "build").glob("cp*"))]  # the editable install's build-dir
    env["SKBUILD_EDITABLE_SKIP"] = os.pathsep.join(trees)
    env["UBSAN_OPTIONS"] += f":suppressions={SUPPRESSIONS}"  # known findings not fixed yet (the file says which)
    return env
