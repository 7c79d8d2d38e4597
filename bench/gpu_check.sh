#!/usr/bin/env bash
# One prepared GPU check for a 16-core machine with one NVIDIA GPU (< 10 minutes including the build):
#   1. build the package with CUDA for the local GPU only (sm from nvidia-smi) in its own build dir;
#   2. run bench/gpu_check.py: logits GPU path vs CPU path, then prefill/decode tokens/s of stock-graph Q4_K_M
#      with -ot exps=CPU vs ours (WQ on the GPU, sidecar on the CPU) at r = 0, 1, 2, k and UMIA, each with the
#      residual work after the GPU's (overlap off) and overlapped with it (auto), with the overlap timing, and
#      with a per-expert WQ cache of about half the experts (misses on the CPU), with its hit rate, also under the
#      runtime's rapidmoe (refreshed) and lru (on-demand loading) cache policies, with experts copied per token;
#   3. the markdown table lands in $OUT (or bench/out/gpu-check/gpu_check.md).
# Fails fast without a GPU. `bench/gpu_check.sh --cpu` skips the CUDA build and runs the driver with -ngl 0 on
# tiny sizes against the installed package (what tests/test_gpu_check.py runs).
# Stock reference: our build on the plain Q4_K_M file. With no sidecar every hook returns its input, so the
# graph is stock llama.cpp's (tests/test_split_routing.py checks bit equality with a stock build); building a
# second, unpatched llama.cpp with CUDA would not fit the 10 minutes.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
RESULTS="${OUT:-$ROOT/bench/out/gpu-check}"
mkdir -p "$RESULTS"
start=$(date +%s)
if [ "${1:-}" = "--cpu" ]; then
    shift
    exec python bench/gpu_check.py --cpu --size tiny --n-layer 0 --prompt 32 --gen 8 --threads 2 \
        --workdir "$RESULTS" "$@"
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L | grep -q GPU \
    || { echo "gpu_check: no NVIDIA GPU here (nvidia-smi finds none); use --cpu for the dry run" >&2; exit 3; }
command -v nvcc >/dev/null || { echo "gpu_check: nvcc not found" >&2; exit 3; }
SM="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')"
JOBS="$(nproc)"
echo "gpu_check: $(nvidia-smi -L | head -1), sm_$SM, $JOBS cores"

# 1. build: one architecture keeps ggml-cuda's many template instances within minutes on 16 cores;
#    no build isolation (offline machines: scikit-build-core, nanobind must be installed already)
export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$SM -DGGML_NATIVE=on ${CMAKE_ARGS:-}"
export CMAKE_BUILD_PARALLEL_LEVEL="$JOBS"
python -m pip install --no-build-isolation --no-deps -C build-dir=build/gpu-check . > "$RESULTS/build.log" 2>&1 \
    || { tail -30 "$RESULTS/build.log"; echo "gpu_check: build failed (log: $RESULTS/build.log)" >&2; exit 1; }
python -c "import rapidmoe, llama_cpp; assert llama_cpp.llama_supports_gpu_offload(), 'no GPU offload in the build'"
echo "gpu_check: build $(( $(date +%s) - start )) s"

# 2-3. correctness and speed (about 4 minutes with the defaults: 12-layer bench qwen3moe, 4 GB F16)
python bench/gpu_check.py --workdir "$RESULTS" --threads "$JOBS" "$@"
echo "gpu_check: total $(( $(date +%s) - start )) s; table: $RESULTS/gpu_check.md"
