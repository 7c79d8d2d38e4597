#!/usr/bin/env bash
# CUDA build check of the patched tree, also on a machine with nvcc but no GPU and no driver (this project's
# development machines). It builds what `CMAKE_ARGS="-DGGML_CUDA=on" pip install .` builds -- the root CMakeLists
# (vendor/llama.cpp with our patches applied by src/rapidmoe_ggml/fetch_upstream.py, our code inside libllama, the
# nanobind module rapidmoe._core, rpc-server) -- with -DGGML_CUDA=ON for one GPU architecture, links it, installs
# it next to the Python sources into $BUILD_DIR/site and imports it there (tools/cuda_import_check.py --site): on a
# machine without a GPU the CUDA backend must load, report no device, and leave the CPU backend working (a short
# generation runs, compared with the interpreter's own CPU-only install of rapidmoe -- normal or editable -- when it
# has one; without one the comparison is skipped and the summary says so).
#
# Usage: tools/cuda_build_check.sh            (build dir kept: a second run only rebuilds what changed)
# Env:
#   CUDA_ARCH   CMAKE_CUDA_ARCHITECTURES, default 90 (H100/H200). Others: 86 (RTX 30xx, A10/A40), 89 (RTX 40xx, L4,
#               L40), 80 (A100), 120 (RTX 50xx), "native" (the GPUs of the building machine), or a list "86;89".
#               Each architecture adds its own compile of every kernel: keep to the GPUs you run on.
#   JOBS        parallel compile jobs (default: nproc)
#   BUILD_DIR   default build/cuda (outside git; bench/gpu_check.sh reuses it)
#   CUBLAS_ROOT a folder with include/cublas_v2.h and lib/libcublas.so.N; default: the CUDA toolkit's own cuBLAS,
#               else the nvidia-cublas wheel installed for `python`, else that wheel pip-installed (--target) into
#               $BUILD_DIR/nvidia-wheels, its version matched to nvcc's (CUDA 13.0 -> nvidia-cublas 13.0.*, CUDA 12.x
#               -> nvidia-cublas-cu12 12.x.*)
#   FA_QUANTS   GGML_CUDA_FA_QUANTS, default f16-f16 (our KV cache type; fewer FlashAttention template instances)
#   EXTRA_CMAKE_ARGS  more -D options
# Writes $BUILD_DIR/build_check.json (times, versions, result) and $BUILD_DIR/logs/*.log.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$ROOT/build/cuda}"
ARCH="${CUDA_ARCH:-90}"
JOBS="${JOBS:-$(nproc)}"
FA_QUANTS="${FA_QUANTS:-f16-f16}"
PY="${PYTHON:-python3}"
LOGS="$BUILD_DIR/logs"
mkdir -p "$LOGS"
say() { echo "cuda_build_check: $*" >&2; }
die() { say "FAILED: $*"; exit 1; }
t0=$(date +%s)
phase_t=()

command -v nvcc >/dev/null || die "nvcc not found (install the CUDA toolkit, or PyPI's nvidia-cuda-nvcc)"
NVCC_TOP="$(nvcc -dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)"
CUDA_VER="$(nvcc --version | sed -n 's/.*release \([0-9]*\.[0-9]*\),.*/\1/p')"
CUDA_MAJOR="${CUDA_VER%%.*}"; CUDA_MINOR="${CUDA_VER#*.}"
CUDA_HOME="${CUDA_HOME:-$(readlink -f "${NVCC_TOP:-$(dirname "$(command -v nvcc)")/..}")}"
[ -f "$CUDA_HOME/include/cuda.h" ] || die "cuda.h not found under CUDA_HOME=$CUDA_HOME"
say "nvcc $CUDA_VER at $CUDA_HOME, architecture(s) $ARCH, $JOBS jobs, build dir $BUILD_DIR"

# 1. cuBLAS (headers + libcublas.so.N, libcublasLt.so.N)
find_cublas() {  # prints a folder holding include/cublas_v2.h and lib*/libcublas.so.*
    local d
    for d in "${CUBLAS_ROOT:-}" "$CUDA_HOME" "$CUDA_HOME/targets/x86_64-linux" \
             "$("$PY" -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu'"$CUDA_MAJOR"'"))' 2>/dev/null)" \
             "$("$PY" -c 'import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__ or nvidia.cublas.__path__[0]))' 2>/dev/null)" \
             "$BUILD_DIR/nvidia-wheels/nvidia/cu$CUDA_MAJOR" "$BUILD_DIR/nvidia-wheels/nvidia/cublas"; do
        [ -n "$d" ] && [ -f "$d/include/cublas_v2.h" ] && ls "$d"/lib*/libcublas.so* >/dev/null 2>&1 && { echo "$d"; return 0; }
    done
    return 1
}
CUBLAS="$(find_cublas || true)"
if [ -z "$CUBLAS" ]; then
    if [ "$CUDA_MAJOR" -ge 13 ]; then spec="nvidia-cublas==${CUDA_MAJOR}.${CUDA_MINOR}.*"; else spec="nvidia-cublas-cu${CUDA_MAJOR}==${CUDA_MAJOR}.${CUDA_MINOR}.*"; fi
    say "no cuBLAS found: pip install --target $BUILD_DIR/nvidia-wheels '$spec'"
    "$PY" -m pip install -q --no-deps --target "$BUILD_DIR/nvidia-wheels" "$spec" > "$LOGS/pip-cublas.log" 2>&1 \
        || die "pip install $spec (see $LOGS/pip-cublas.log)"
    CUBLAS="$(find_cublas)" || die "the $spec wheel has no include/cublas_v2.h + lib/libcublas.so"
fi
CUBLAS_LIB="$(ls "$CUBLAS"/lib*/libcublas.so* | sort | head -1)"
CUBLASLT_LIB="$(ls "$CUBLAS"/lib*/libcublasLt.so* | sort | head -1)"
CUBLAS_VERSION="$(sed -n 's/^#define CUBLAS_VER_\(MAJOR\|MINOR\|PATCH\) *\([0-9]*\).*/\2/p' "$CUBLAS/include/cublas_api.h" | paste -sd.)"
say "cuBLAS $CUBLAS_VERSION: $CUBLAS_LIB"
phase_t+=("cublas=$(( $(date +%s) - t0 ))")

# 2. the driver library libcuda.so.1 ships with the NVIDIA driver. Linking needs one: the toolkit's stub, the
#    installed driver's, or -- on a machine with neither -- one generated here from cuda.h (every cu* entry point
#    answers CUDA_ERROR_NO_DEVICE). The generated stub is only put on LD_LIBRARY_PATH by this script's import step;
#    a real driver is always found first where there is one.
DRIVER=""; STUB_DIR=""
for f in "$CUDA_HOME/lib64/stubs/libcuda.so" "$CUDA_HOME/targets/x86_64-linux/lib/stubs/libcuda.so" \
         "$(ldconfig -p 2>/dev/null | sed -n 's/.*libcuda\.so\.1 (libc6,x86-64) => //p' | head -1)"; do
    [ -n "$f" ] && [ -f "$f" ] && { DRIVER="$f"; break; }
done
if [ -z "$DRIVER" ]; then
    STUB_DIR="$BUILD_DIR/driver-stub"
    DRIVER="$STUB_DIR/libcuda.so"
    if [ ! -f "$DRIVER" ] || [ "$DRIVER" -ot "$CUDA_HOME/include/cuda.h" ]; then
        mkdir -p "$STUB_DIR"
        gcc -E -P -I"$CUDA_HOME/include" "$CUDA_HOME/include/cuda.h" > "$STUB_DIR/cuda_pp.h"
        "$PY" - "$STUB_DIR/cuda_pp.h" "$STUB_DIR/libcuda_stub.c" <<'PY'
import re, sys
names = sorted(set(re.findall(r"\bCUresult\s+(cu[A-Za-z0-9_]+)\s*\(", open(sys.argv[1]).read())))
assert len(names) > 100, f"only {len(names)} driver entry points found in cuda.h"
with open(sys.argv[2], "w") as f:
    f.write("/* generated by tools/cuda_build_check.sh: libcuda.so.1 without a driver; every call fails */\n")
    f.writelines(f"int {n}(void) {{ return 100; /* CUDA_ERROR_NO_DEVICE */ }}\n" for n in names)
PY
        gcc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o "$DRIVER" "$STUB_DIR/libcuda_stub.c"
        ln -sf libcuda.so "$STUB_DIR/libcuda.so.1"
    fi
    say "no NVIDIA driver here: linking against a generated stub $DRIVER"
fi
phase_t+=("driver=$(( $(date +%s) - t0 ))")

# 3. configure the package's own CMakeLists (as scikit-build-core does), CUDA on
NB_DIR="$("$PY" -m nanobind --cmake_dir)" || die "nanobind is not installed for $PY"
PKG_VERSION="$("$PY" - "$ROOT/pyproject.toml" <<'PY'
import re, sys
m = re.search(r'^version\s*=\s*"([^"]+)"', open(sys.argv[1]).read(), re.M)
print(m.group(1) if m else "0")
PY
)"
# shellcheck disable=SC2086
cmake -S "$ROOT" -B "$BUILD_DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DPython_EXECUTABLE="$(command -v "$PY")" -Dnanobind_DIR="$NB_DIR" -DSKBUILD_PROJECT_VERSION="$PKG_VERSION" \
    -DCMAKE_INSTALL_PREFIX="$BUILD_DIR/site" \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_FA_QUANTS="$FA_QUANTS" \
    -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" -DCUDAToolkit_ROOT="$CUDA_HOME" \
    -DCUDA_cublas_LIBRARY="$CUBLAS_LIB" -DCUDA_cublasLt_LIBRARY="$CUBLASLT_LIB" -DCUDA_cuda_driver_LIBRARY="$DRIVER" \
    -DCMAKE_CUDA_FLAGS="-I$CUBLAS/include" -DCMAKE_CXX_FLAGS="-I$CUBLAS/include" \
    ${EXTRA_CMAKE_ARGS:-} > "$LOGS/configure.log" 2>&1 || { tail -30 "$LOGS/configure.log" >&2; die "configure (see $LOGS/configure.log)"; }
grep -q "CUDA Toolkit found" "$LOGS/configure.log" || die "configure did not find the CUDA toolkit (see $LOGS/configure.log)"
phase_t+=("configure=$(( $(date +%s) - t0 ))")

# 4. compile and link: the libraries, _core (its stub generator imports it: the driver stub must be loadable), rpc-server
export LD_LIBRARY_PATH="${STUB_DIR:+$STUB_DIR:}${LD_LIBRARY_PATH:-}"
n_cu="$(ninja -C "$BUILD_DIR/build" -t targets all 2>/dev/null | grep -c '\.cu\.o:' || true)"
say "compiling ($n_cu CUDA objects in the graph; log: $LOGS/build.log)"
tb=$(date +%s)
ninja -C "$BUILD_DIR/build" -j "$JOBS" > "$LOGS/build.log" 2>&1 || { grep -B2 -A20 -m3 "error" "$LOGS/build.log" >&2 || tail -40 "$LOGS/build.log" >&2; die "build (see $LOGS/build.log)"; }
t_build=$(( $(date +%s) - tb ))
phase_t+=("build=$(( $(date +%s) - t0 ))")
LIBCUDA_SO="$(find "$BUILD_DIR/build" -name 'libggml-cuda.so' | head -1)"
[ -n "$LIBCUDA_SO" ] || die "libggml-cuda.so was not built"

# 5. install next to the Python sources and import from there; env.sh sets what a process needs to use this build
#    (PYTHONPATH, cuBLAS's folder -- the installed libraries' RPATH is $ORIGIN only -- and the driver stub if any)
CUBLAS_LIBDIR="$(dirname "$CUBLAS_LIB")"
cat > "$BUILD_DIR/env.sh" <<ENV
# generated by tools/cuda_build_check.sh: source it to run the CUDA build in $BUILD_DIR/site
export PYTHONPATH="$BUILD_DIR/site\${PYTHONPATH:+:\$PYTHONPATH}"
export LD_LIBRARY_PATH="$CUBLAS_LIBDIR${STUB_DIR:+:$STUB_DIR}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
ENV
rm -rf "$BUILD_DIR/site"
cmake --install "$BUILD_DIR/build" --component rapidmoe > "$LOGS/install.log" 2>&1 || die "install (see $LOGS/install.log)"
tar -C "$ROOT/python" --exclude=__pycache__ -cf - rapidmoe | tar -C "$BUILD_DIR/site" -xf -
[ -x "$BUILD_DIR/site/rapidmoe/bin/rpc-server" ] || die "rpc-server missing from the install"
(. "$BUILD_DIR/env.sh" && exec "$PY" "$ROOT/tools/cuda_import_check.py" --site "$BUILD_DIR/site" \
    --json "$BUILD_DIR/import_check.json") \
    > "$LOGS/import.log" 2>&1 || { tail -30 "$LOGS/import.log" >&2; die "import (see $LOGS/import.log)"; }
t_end=$(date +%s)
phase_t+=("import=$(( t_end - t0 ))")

so_mb=$(( $(stat -L -c %s "$LIBCUDA_SO") / 1048576 ))
"$PY" - "$BUILD_DIR/build_check.json" <<PY
import json, os, sys, tempfile
phases = dict(p.split("=") for p in "${phase_t[*]}".split())
rec = {"ok": True, "cuda": "$CUDA_VER", "cublas": "$CUBLAS_VERSION", "arch": "$ARCH", "jobs": $JOBS,
       "fa_quants": "$FA_QUANTS", "cuda_objects": int("${n_cu:-0}" or 0), "driver_stub": bool("$STUB_DIR"),
       "libggml_cuda_mb": $so_mb, "build_s": $t_build, "total_s": $(( t_end - t0 )),
       "phases_cumulative_s": {k: int(v) for k, v in phases.items()},
       "import": json.load(open("$BUILD_DIR/import_check.json"))}
fd, tmp = tempfile.mkstemp(dir=os.path.dirname(sys.argv[1]))
with os.fdopen(fd, "w") as f:
    json.dump(rec, f, indent=1)
os.replace(tmp, sys.argv[1])
PY
say "OK: sm_$ARCH, nvcc $CUDA_VER, cuBLAS $CUBLAS_VERSION; compile+link ${t_build}s, total $(( t_end - t0 ))s;" \
    "libggml-cuda.so ${so_mb} MB; import: $(cat "$LOGS/import.log" | tail -1)"
