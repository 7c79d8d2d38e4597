"""The sanitizer build's environment for fuzz children: its libllama and extension first, libasan and libubsan
preloaded into Python (which is not built with them), tools/asan_build.sh makes the build."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .harness import base_env


def runtime(lib: str) -> str:
    """The compiler's path of a sanitizer runtime (libasan.so, libubsan.so)."""
    out = subprocess.run(["gcc", f"-print-file-name={lib}"], capture_output=True, text=True, check=True).stdout
    path = out.strip()
    if not os.path.isabs(path):
        raise FileNotFoundError(f"gcc has no {lib}: install the sanitizer runtimes (libasan, libubsan)")
    return os.path.realpath(path)


def asan_env(build: Path) -> dict[str, str]:
    """Children load rapidmoe from the sanitizer build's site directory (asan_build.sh installs it there)."""
    site = (build / "site").resolve()
    if not (site / "rapidmoe").is_dir():
        raise FileNotFoundError(f"{site} has no rapidmoe: run tools/asan_build.sh first")
    env = base_env([runtime("libasan.so"), runtime("libubsan.so")])
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    return env
