#!/usr/bin/env python3
"""The stack llama.cpp's regex pre-tokenizer needs per character of a run (docs/fuzzing.md, rapidmoe.tokenize_stack).

For each vocab GGUF and each kind of run, the smallest thread stack that tokenizes N characters of it, found by a
binary search over fresh processes (an overflow kills the process), printed per character:
  python tools/pretokenizer_stack.py [--n 40000] [--kinds letters,punct,...] VOCAB.gguf...
  python tools/pretokenizer_stack.py --relabel deepseek-v3,gpt-4o \
      --from vendor/llama.cpp/models/ggml-vocab-deepseek-llm.gguf
(--relabel: copies of --from with only `tokenizer.ggml.pre` changed, written to a temporary folder.)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

KINDS = {"letters": "a", "upper": "A", "aA": "aA", "digits": "1", "punct": "[", "dollar": "$", "space": " ",
         "tab": "\t", "newline": "\n", "crlf": "\r\n", "punct_nl": "!\n", "word_space": "a ", "mark": "e\u0301",
         "cjk": "\u4e2d"}
LOW, HIGH = 64 << 10, 1 << 30


def child(vocab: str, kind: str, n: int, stack: int) -> None:
    from rapidmoe._runtime import llama_cpp  # noqa: PLC0415 - only in the child

    llm = llama_cpp.Llama(vocab, vocab_only=True, verbose=False)
    text = (KINDS[kind] * n)[:n].encode()
    threading.stack_size(stack)  # the stock tokenize (not rapidmoe.Llama's, which would move it to a bigger stack)
    t = threading.Thread(target=lambda: llm.tokenize(text, add_bos=False))
    t.start()
    t.join()
    print("ok")


def fits(vocab: Path, kind: str, n: int, stack: int) -> bool:
    r = subprocess.run([sys.executable, __file__, "--child", str(vocab), kind, str(n), str(stack)],
                       capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip().endswith("ok")


def smallest_stack(vocab: Path, kind: str, n: int) -> int:
    """0 when LOW is enough, else the smallest stack found (within 1/16 or 64 KiB)."""
    if fits(vocab, kind, n, LOW):
        return 0
    lo, hi = LOW, HIGH
    while hi - lo > max(lo // 16, 1 << 16):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(vocab, kind, n, mid) else (mid, hi)
    return hi


def relabel(src: Path, pres: list[str], out: Path) -> list[Path]:
    import gguf  # noqa: PLC0415

    from rapidmoe.ggufio import GGUFFile, copy_metadata  # noqa: PLC0415

    reader = GGUFFile(src)
    paths = []
    for pre in pres:
        path = out / f"ggml-vocab-pre-{pre}.gguf"
        w = gguf.GGUFWriter(path, arch=str(reader.get("general.architecture")))
        copy_metadata(reader, w, skip_prefixes=("tokenizer.ggml.pre",))
        w.add_string("tokenizer.ggml.pre", pre)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(path)
    return paths


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("vocabs", nargs="*", type=Path)
    ap.add_argument("--n", type=int, default=40_000, help="characters per run")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    ap.add_argument("--relabel", default="", help="pre-tokenizer types to try on copies of --from")
    ap.add_argument("--from", dest="src", type=Path, help="the vocab GGUF --relabel copies")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"unknown kinds {bad}; known: {', '.join(KINDS)}")
    with tempfile.TemporaryDirectory() as tmp:
        vocabs = list(args.vocabs)
        if args.relabel:
            if args.src is None:
                ap.error("--relabel needs --from")
            vocabs += relabel(args.src, args.relabel.split(","), Path(tmp))
        if not vocabs:
            ap.error("no vocab given")
        for v in vocabs:
            row = {k: round(smallest_stack(v, k, args.n) / args.n) for k in kinds}
            print(v.name, json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
