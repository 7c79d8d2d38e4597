#!/usr/bin/env python3
"""Copy llama-cpp-python's Python layer (vendor/llama_cpp_py/llama_cpp) to DEST as the private package
`rapidmoe._llama_cpp` (stdlib only: CMake runs it at configure time).

The layer imports itself by its top-level name (`import llama_cpp.llama_cpp as llama_cpp`, `from llama_cpp.x import
...`); shipped as `llama_cpp` it would be the very package the llama-cpp-python distribution installs, and the two
would overwrite each other. Here every such import names `rapidmoe._llama_cpp` instead, and the library search no
longer follows LLAMA_CPP_LIB_PATH (that variable is llama-cpp-python's: ours always loads the libraries beside it,
RapidMoE's patched build). Anything left that still names the top-level package stops the build, so a pin bump that
adds a new import form fails here instead of importing the other distribution at run time.
"""
from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

PRIVATE = "rapidmoe._llama_cpp"

# (pattern, replacement), applied line by line in this order
REWRITES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^(\s*)import llama_cpp$"), rf"\1import {PRIVATE} as llama_cpp"),
    (re.compile(r"^(\s*)import llama_cpp\.([\w.]+)( as \w+)?$"), rf"\1import {PRIVATE}.\2\3"),
    (re.compile(r"^(\s*)from llama_cpp((?:\.[\w.]+)?) import "), rf"\1from {PRIVATE}\2 import "),
    (re.compile(r'os\.environ\.get\("LLAMA_CPP_LIB_PATH"\)'), "None  # rapidmoe: always the libraries beside it"),
]
# what must not survive the rewrite
LEFTOVER = re.compile(r'^\s*(import|from)\s+llama_cpp\b|LLAMA_CPP_LIB_PATH')


class LayerError(RuntimeError):
    pass


def rewrite(text: str, name: str) -> str:
    out = []
    for i, line in enumerate(text.splitlines(keepends=True), 1):
        body = line.rstrip("\r\n")
        for pat, rep in REWRITES:
            body = pat.sub(rep, body)
        if LEFTOVER.search(body):
            raise LayerError(f"{name}:{i}: cannot make this private: {body.strip()!r} (extend REWRITES in {__file__})")
        out.append(body + line[len(line.rstrip("\r\n")):])
    return "".join(out)


def write_layer(src: Path, dest: Path) -> int:
    """Write the rewritten package to dest (replaced as a whole: temp folder + rename); returns the files written."""
    if not (src / "__init__.py").is_file():
        raise LayerError(f"{src} is not llama-cpp-python's llama_cpp package (no __init__.py)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".pylayer-", dir=dest.parent))
    try:
        n = 0
        for f in sorted(src.rglob("*")):
            if f.is_dir() or "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            rel = f.relative_to(src)
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            if f.suffix == ".py":
                (tmp / rel).write_text(rewrite(f.read_text(encoding="utf-8"), str(rel)), encoding="utf-8")
            else:
                shutil.copyfile(f, tmp / rel)
            n += 1
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
        return n
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {Path(__file__).name} SRC_LLAMA_CPP_PACKAGE DEST", file=sys.stderr)
        return 2
    try:
        n = write_layer(Path(argv[0]), Path(argv[1]))
    except LayerError as e:
        print(f"rapidmoe: error: {e}", file=sys.stderr)
        return 1
    print(f"rapidmoe: llama-cpp-python's Python layer as {PRIVATE} ({n} files) in {argv[1]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
