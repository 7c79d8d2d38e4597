#!/usr/bin/env bash
# The sanitizer build (docs/fuzzing.md), in one command: rapidmoe's libllama, ggml and _core compiled with
# AddressSanitizer + UndefinedBehaviorSanitizer (RelWithDebInfo) into build/asan, apart from the normal build:
#   build/asan/cmake          the CMake tree (incremental on a second run)
#   build/asan/site/rapidmoe  this checkout's Python sources (symlinks: they stay current) + the sanitized binaries
# Python itself is not sanitized: tools/fuzz/asan.py preloads libasan and libubsan into it and puts build/asan/site
# first (the editable install's finder told to step aside).
#
#   tools/asan_build.sh           # build: ~15-20 min of both cores the first time (runs under nice -n 15)
#   tools/asan_build.sh --test    # then the sanitized subset of the tests (fuzz regressions, abort message, engine safety,
#                                 # long lines)
#   python tools/fuzz_run.py --asan build/asan --targets model,sidecar --n 500
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=build/asan
ASAN=$(gcc -print-file-name=libasan.so)
UBSAN=$(gcc -print-file-name=libubsan.so)
for lib in "$ASAN" "$UBSAN"; do
    [[ "$lib" == /* ]] || { echo "asan_build: gcc has no sanitizer runtime ($lib): install libasan and libubsan" >&2; exit 1; }
done

if [[ "${1:-}" == "--test" ]]; then
    shift
    # -s: a report printed inside pytest's captured stderr by a test that then dies would be lost (the run would end
    # with nothing printed); uncaptured, it reaches the log, which is searched for reports afterwards
    LOG="$OUT/test.log"
    rc=0
    env $(python3 -c 'import sys; sys.path.insert(0, "tools"); from fuzz.asan import asan_env; from pathlib import Path
e = asan_env(Path("build/asan"))
print(" ".join(f"{k}={e[k]}" for k in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS", "PYTHONPATH", "SKBUILD_EDITABLE_SKIP")))') \
        nice -n 15 python3 -m pytest -q -s -p no:cacheprovider "${@:-tests/fuzzing/test_fuzz_regressions.py}" \
        tests/engine/test_abort_message.py tests/engine/test_engine_safety.py tests/engine/test_long_lines.py 2>&1 | tee "$LOG" || rc=$?
    if grep -q "ERROR: AddressSanitizer\|runtime error:\|UndefinedBehaviorSanitizer" "$LOG"; then
        echo "asan_build: sanitizer reports in $LOG:" >&2
        grep "SUMMARY\|runtime error:" "$LOG" | sort | uniq -c >&2
        rc=1
    fi
    exit "$rc"
fi

SAN="-fsanitize=address,undefined -fno-omit-frame-pointer"
mkdir -p "$OUT"
rm -rf "$OUT/install"
# its own copy of the pinned, patched llama.cpp (build/asan/vendor, from the checkout's tarball when there is one):
# a normal build preparing vendor/ again at the same time cannot change the sources under this one
SDIST="vendor/downloads/$(python3 -c 'import json; print(json.load(open("src/rapidmoe_ggml/upstream.json"))["sdist"])')"
[[ -f "$SDIST" ]] && export RAPIDMOE_UPSTREAM_SDIST="$PWD/$SDIST"
# the build's own Python steps import the sanitized _core (nanobind's stubgen): the runtimes preloaded for them (and
# so for the compilers too, which are not instrumented: only the allocator checks apply to them, the mismatch ones off)
LD_PRELOAD="$ASAN:$UBSAN" CMAKE_BUILD_PARALLEL_LEVEL=2 \
ASAN_OPTIONS=detect_leaks=0:verify_asan_link_order=0:alloc_dealloc_mismatch=0:new_delete_type_mismatch=0 \
nice -n 15 python3 -m pip install -q --no-build-isolation --no-deps --target "$OUT/install" \
    -C build-dir="$OUT/cmake" -C cmake.build-type=RelWithDebInfo \
    -C cmake.define.RAPIDMOE_VENDOR_DIR="$PWD/$OUT/vendor" \
    -C cmake.define.CMAKE_C_FLAGS="$SAN" -C cmake.define.CMAKE_CXX_FLAGS="$SAN" \
    -C cmake.define.CMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" \
    -C cmake.define.CMAKE_MODULE_LINKER_FLAGS="-fsanitize=address,undefined" \
    -C cmake.define.CMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" .

# the overlay: every Python file of the checkout by symlink, the compiled parts from the sanitized install
SITE="$OUT/site/rapidmoe"
rm -rf "$OUT/site"
mkdir -p "$SITE"
for p in python/rapidmoe/*; do
    ln -s "$PWD/$p" "$SITE/$(basename "$p")"
done
for p in "$OUT"/install/rapidmoe/*; do
    name=$(basename "$p")
    [[ -e "$SITE/$name" ]] && continue  # a source file or package: the checkout's
    cp -a "$p" "$SITE/$name"
done
echo "asan_build: $SITE ($(ls "$SITE"/_core*.so))"
