#!/usr/bin/env python3
"""Stands in for `llama-server` in llama.cpp's own server test-suite: maps its flags to `rapidmoe-cli serve`.

The model is always $RAPIDMOE_UPSTREAM_MODEL (the tests' --hf-repo models cannot be downloaded here). Flags for
features we do not have (embeddings, LoRA, draft models, ...) make the shim exit with status 2 and a message,
so those tests fail at server start and are recorded as not applicable.
"""
from __future__ import annotations

import os
import sys

VALUE = {"--port": "--port", "--host": "--host", "--temp": "--temp", "--seed": "--seed", "--ctx-size": "-c",
         "--parallel": "--parallel", "--n-predict": "--n-predict", "--alias": "--alias", "--api-key": "--api-key",
         "--batch-size": "--batch-size", "--threads": "--threads", "--chat-template": "--chat-template",
         "--chat-template-file": "--chat-template-file", "--n-gpu-layers": "-ngl", "--tags": "--tags",
         "--pooling": "--pooling", "--embd-normalize": "--embd-normalize", "--reasoning-format": "--reasoning-format",
         "--reasoning": "--reasoning", "--chat-template-kwargs": "--chat-template-kwargs",
         "--cors-origins": "--cors-origins"}
FLAG = {"--metrics": "--metrics", "--slots": "--slots", "--no-slots": "--no-slots", "--no-ui": "--no-ui",
        "--embedding": "--embedding", "--embeddings": "--embedding", "--jinja": "--jinja", "--no-jinja": "--no-jinja"}
# --ubatch-size: ours is --batch-size (the suite sets both alike)
IGNORED_VALUE = {"--hf-repo", "--hf-file", "--ubatch-size", "-ctk", "-ctv", "-fa", "--model-url", "--cache-ram"}
IGNORED_FLAG = {"--offline", "--no-mmproj", "--cont-batching", "--kv-unified", "--swa-full", "--no-cache-idle-slots",
                "--verbose"}


def main(argv: list[str]) -> int:
    model = os.environ["RAPIDMOE_UPSTREAM_MODEL"]
    # llama-server's defaults where ours differ: /metrics off unless --metrics
    out = [sys.executable, "-m", "rapidmoe.cli", "serve", model, "--threads", "1", "--no-metrics"]
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in VALUE:
            out += [VALUE[a], argv[i + 1]]
            i += 2
        elif a in FLAG:
            out.append(FLAG[a])
            i += 1
        elif a in IGNORED_VALUE:
            i += 2
        elif a in IGNORED_FLAG:
            i += 1
        else:
            print(f"llama_server_shim: not supported by rapidmoe-cli serve: {a}", file=sys.stderr)
            return 2
    os.execv(out[0], out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
