#!/usr/bin/env bash
# The Python packages bench/gpu_check.sh needs that the GPU machine's image (Python 3.12, PyTorch's venv;
# /work/.library/device/KINDS.md lists what it has) lacks, downloaded here as wheels into .whl/ (git-ignored via
# .git/info/exclude) to travel with the working tree (`carry: [".whl"]`): gguf (the pin's gguf-py) and diskcache.
# Everything else the package imports (numpy, typer, tqdm, jinja2, typing-extensions, pyyaml, requests) and
# builds with (cmake, ninja, nanobind, nvcc, nvidia-cublas) is on that image.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_17_x86_64 --platform any -d .whl "gguf==0.19.0" "diskcache>=5.6.1"
ls -la .whl
