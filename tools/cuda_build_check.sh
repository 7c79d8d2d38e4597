#!/usr/bin/env bash
# Compile check of the CUDA sources our patches touch, on a machine with nvcc but no GPU (and no cuBLAS):
# configures the patched vendor/llama.cpp with -DGGML_CUDA=ON in its own build dir (build/cuda-check, never the
# package's build dir) and compiles ggml-cuda.cu (patch 0002 edits its supports_op) plus a few kernels the MoE
# path uses. cuBLAS headers/libraries come from PyPI's nvidia-cublas wheel matching nvcc's major version,
# unpacked (not installed) into the build dir. Nothing is linked or run; no GPU is needed.
# Usage: tools/cuda_build_check.sh [extra .cu object names under ggml/src/ggml-cuda/, e.g. mmq.cu]
# Env: CUDA_ARCH (default 90), JOBS (default 2).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SRC="$ROOT/vendor/llama.cpp"
OUT="$ROOT/build/cuda-check"
ARCH="${CUDA_ARCH:-90}"
JOBS="${JOBS:-2}"
command -v nvcc >/dev/null || { echo "cuda_build_check: nvcc not found" >&2; exit 2; }
[ -f "$SRC/CMakeLists.txt" ] || { echo "cuda_build_check: $SRC missing: build the package once (it fetches and patches the pin)" >&2; exit 2; }
grep -q "GGML_MUL_MAT_ID_MASKED_PARAM" "$SRC/ggml/src/ggml-cuda/ggml-cuda.cu" || { echo "cuda_build_check: patch 0002 is not applied in $SRC" >&2; exit 2; }
CUDA_MAJOR="$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')"
mkdir -p "$OUT"
start=$(date +%s)

# 1. cuBLAS from PyPI: nvidia-cublas (CUDA 13: the nvidia/cu13 layout) or nvidia-cublas-cu12
CUBLAS="$OUT/cublas"
if [ ! -f "$CUBLAS/.done" ]; then
    if [ "$CUDA_MAJOR" -ge 13 ]; then spec="nvidia-cublas>=${CUDA_MAJOR}.0,<$((CUDA_MAJOR + 1)).0"; else spec="nvidia-cublas-cu${CUDA_MAJOR}"; fi
    ls "$OUT"/wheels/nvidia_cublas*.whl >/dev/null 2>&1 || python -m pip download --no-deps -q "$spec" -d "$OUT/wheels"
    rm -rf "$CUBLAS" && mkdir -p "$CUBLAS"
    python - "$OUT/wheels" "$CUBLAS" <<'PY'
import sys, zipfile, pathlib
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
whl = sorted(src.glob("nvidia_cublas*.whl"))[-1]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        p = pathlib.PurePosixPath(n)
        if "include" in p.parts or "lib" in p.parts:
            sub = "include" if "include" in p.parts else "lib"
            out = dst / sub / p.name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(z.read(n))
PY
    for l in cublas cublasLt; do ln -sf "lib$l.so.$CUDA_MAJOR" "$CUBLAS/lib/lib$l.so"; done
    touch "$CUBLAS/.done"
fi
# the driver library (libcuda) comes with an NVIDIA driver, absent here; CMake wants a file for CUDA::cuda_driver
# at generate time only (nothing is linked), so an empty stub stands in when the toolkit has no stubs/libcuda.so
DRIVER="$(ls "$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"/lib64/stubs/libcuda.so 2>/dev/null || true)"
if [ -z "$DRIVER" ]; then
    DRIVER="$OUT/stub/libcuda.so"
    mkdir -p "$OUT/stub" && [ -f "$DRIVER" ] || cc -shared -o "$DRIVER" -x c /dev/null
fi
t_cublas=$(( $(date +%s) - start ))

# 2. configure: CUDA on, one architecture, libraries only
cmake -S "$SRC" -B "$OUT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DGGML_NATIVE=OFF -DGGML_CUDA_NCCL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DCUDA_cublas_LIBRARY="$CUBLAS/lib/libcublas.so" -DCUDA_cublasLt_LIBRARY="$CUBLAS/lib/libcublasLt.so" -DCUDA_cuda_driver_LIBRARY="$DRIVER" \
    -DCMAKE_CUDA_FLAGS="-I$CUBLAS/include" -DCMAKE_CXX_FLAGS="-I$CUBLAS/include" > "$OUT/configure.log"
t_cfg=$(( $(date +%s) - start ))

# 3. compile: ggml-cuda.cu (patched supports_op) and the kernels of the MoE path
objs=(ggml-cuda.cu getrows.cu binbcast.cu "$@")
targets=()
for o in "${objs[@]}"; do targets+=("ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/$o.o"); done
printf '%s\n' "${targets[@]}"
ninja -C "$OUT/build" -j "$JOBS" "${targets[@]}"
end=$(date +%s)
echo "cuda_build_check: OK: compiled ${objs[*]} for sm_$ARCH with nvcc $CUDA_MAJOR" \
     "(cuBLAS ${t_cublas}s, configure $((t_cfg - t_cublas))s, compile $((end - start - t_cfg))s, total $((end - start))s)"
