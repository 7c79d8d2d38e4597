#!/usr/bin/env bash
# One prepared GPU check for a machine with one NVIDIA GPU (e.g. an H200 machine: 16 cores, no network), < 10 minutes:
#   1. CUDA build of the patched tree for this GPU's architecture only (tools/cuda_build_check.sh: cuBLAS from the
#      toolkit or the installed nvidia-cublas wheel; build dir build/cuda is reused when it is still there, so a
#      second call on a warm machine only relinks what changed); its import check runs on the GPU;
#   2. bench/gpu_check.py with that build (--site build/cuda/site: ahead of an installed rapidmoe, normal or
#      editable; it refuses a build that sees no CUDA device): exactness GPU path vs CPU path,
#      prefill/decode tok/s of stock -ngl 99 -ot exps=CPU vs ours (all WQ on the GPU at r and UMIA, overlap off/on;
#      the static half-WQ per-expert cache and its rapidmoe/lru policies), then the concurrent cached layers,
#      prefill streaming and GPU-calibrated UMIA; one Markdown + JSON report in $OUT.
#
# Usage: bench/gpu_check.sh [--build-only | --no-build] [gpu_check.py options, e.g. --sections exactness,stock]
#        bench/gpu_check.sh --cpu [--site DIR]   the dry run without a GPU: same driver, -ngl 0, tiny sizes, the
#                                     installed package or the build in DIR (tests/ci/test_gpu_check.py)
# On a GPU machine without network access (nothing can be fetched there): carry the Python packages its image lacks as wheels in .whl/
# (bench/gpu_check_wheels.sh makes them here); this script installs them into a private folder. The build takes
# a few minutes on 16 cores (docs/execution.md): with the 10-minute limit per call, run `--build-only` first
# and the check right after it (the machine stays warm for 30 s and keeps build/cuda).
# Exit status: 3 no GPU / no nvcc; 1 build, import or an exactness check failed; 0 otherwise.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
RESULTS="${OUT:-$ROOT/bench/out/gpu-check}"
mkdir -p "$RESULTS"
start=$(date +%s)
PY="${PYTHON:-python3}"
if [ "${1:-}" = "--cpu" ]; then
    shift
    exec "$PY" bench/gpu_check.py --cpu --size tiny --n-layer 0 --prompt 32 --gen 8 --threads 2 \
        --workdir "$RESULTS" "$@"
fi
mode=all
case "${1:-}" in --build-only) mode=build; shift ;; --no-build) mode=bench; shift ;; esac
command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q GPU \
    || { echo "gpu_check: no NVIDIA GPU here (nvidia-smi finds none); use --cpu for the dry run" >&2; exit 3; }
command -v nvcc >/dev/null || { echo "gpu_check: nvcc not found" >&2; exit 3; }
SM="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.[:space:]')"
JOBS="$(nproc)"
echo "gpu_check: $(nvidia-smi -L | head -1), sm_$SM, $JOBS cores, $($PY --version)"

# 0. Python packages the package needs and the machine may lack: from carried wheels (.whl/), never the network
missing="$("$PY" - <<'PY'
import importlib.util
need = {"numpy": "numpy", "typer": "typer", "tqdm": "tqdm", "gguf": "gguf", "typing_extensions": "typing-extensions",
        "diskcache": "diskcache", "jinja2": "jinja2", "nanobind": "nanobind"}
print(" ".join(d for m, d in need.items() if importlib.util.find_spec(m) is None))
PY
)"
if [ -n "$missing" ]; then
    if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site \
            "$ROOT"/.whl/*.whl > "$RESULTS/wheels.log" 2>&1 || { cat "$RESULTS/wheels.log" >&2; exit 1; }
        export PYTHONPATH="/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
        echo "gpu_check: installed carried wheels for: $missing"
    else
        echo "gpu_check: missing Python packages: $missing; carry them as wheels in .whl/ (bench/gpu_check_wheels.sh)" >&2
        exit 1
    fi
fi

# 1. build (reused when build/cuda is there); its log and summary come back with the report
if [ "$mode" != bench ]; then
    if ! CUDA_ARCH="$SM" JOBS="$JOBS" PYTHON="$PY" bash tools/cuda_build_check.sh 2> "$RESULTS/cuda_build.log"; then
        tail -40 "$RESULTS/cuda_build.log" >&2
        tail -60 build/cuda/logs/build.log > "$RESULTS/cuda_build_tail.log" 2>/dev/null || true
        echo "gpu_check: CUDA build failed (logs: $RESULTS/cuda_build.log, build/cuda/logs/)" >&2
        exit 1
    fi
    tail -1 "$RESULTS/cuda_build.log"
    cp build/cuda/build_check.json "$RESULTS/"
    echo "gpu_check: build $(( $(date +%s) - start )) s"
    [ "$mode" = build ] && exit 0
fi
[ -f build/cuda/env.sh ] || { echo "gpu_check: no CUDA build in build/cuda (run without --no-build)" >&2; exit 1; }
# shellcheck disable=SC1091
. build/cuda/env.sh  # cuBLAS's folder on LD_LIBRARY_PATH; --site makes the CUDA build win over any installed rapidmoe

# 2. correctness and speed (12-layer bench qwen3moe, 4 GB F16; the sections' budget keeps it within the call)
rc=0
WORK="${GPU_CHECK_WORK:-$ROOT/bench/out/gpu-check-work}"  # the models (GBs): not in $OUT, which comes back
"$PY" bench/gpu_check.py --site build/cuda/site --workdir "$WORK" --out "$RESULTS/gpu_check.md" --threads "$JOBS" \
    --build-info build/cuda/build_check.json "$@" || rc=$?
echo "gpu_check: total $(( $(date +%s) - start )) s; report: $RESULTS/gpu_check.md, $RESULTS/gpu_check.json"
exit $rc
