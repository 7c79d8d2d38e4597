#!/usr/bin/env python3
"""Stands in for `llama-server` in llama.cpp's own server test-suite: stock llama-server of the pin, on our model.

The reference run of run.py: the same suite, the same model ($RAPIDMOE_UPSTREAM_MODEL, the tiny synthetic model
the run of ours gets) and the same flags, so a test that fails here fails because of the model, not the server.
Only the model flags change: the suite's --hf-repo/--hf-file/--model-url/--model name models it downloads (nothing
can be downloaded here), and they are replaced by `-m $RAPIDMOE_UPSTREAM_MODEL`. `--threads 1` comes first (a
test's own --threads overrides it), as llama_server_shim.py gives ours. The binary is $RAPIDMOE_STOCK_SERVER.
"""
from __future__ import annotations

import os
import sys

MODEL_FLAGS = {"--hf-repo", "-hfr", "--hf-file", "-hff", "--model-url", "-mu", "--model", "-m"}


def stock_args(argv: list[str], model: str) -> list[str]:
    """llama-server's arguments for the suite's argv: its model flags replaced by `-m model`, all else as given."""
    out = ["--threads", "1"]
    i = 0
    while i < len(argv):
        if argv[i] in MODEL_FLAGS:
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return [*out, "-m", model]


def main(argv: list[str]) -> int:
    binary = os.environ["RAPIDMOE_STOCK_SERVER"]
    os.execv(binary, [binary, *stock_args(argv, os.environ["RAPIDMOE_UPSTREAM_MODEL"])])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
