#!/usr/bin/env python3
"""Whether a change left conversion and inference bit for bit as they were: for a refactoring that must change no
behaviour.

`record` (at the commit before the change) and `compare` (after it, with the package rebuilt) convert two tiny
synthetic models (qwen3moe and deepseek2, `rapidmoe-cli make-model --size tiny`) with every preset that needs no
importance matrix, and take the sha256 of every converted file and of the logits of one prompt at r = 0, 1 and 2
for each pair; `compare` prints the keys that differ from the record, or IDENTICAL, and exits 1 on a difference.
About a minute on 2 cores; a record compared with a rerun of itself is identical (the conversion and the CPU
kernels are deterministic).

Usage: python tools/behaviour_check.py record DIR
       python tools/behaviour_check.py compare DIR [--work WORKDIR]
DIR holds the source models and record.json; converted files go to WORKDIR (default DIR/work-MODE).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

PRESETS = ("cpu", "cpu-fast", "cpu-q8", "refine", "refine-hq", "refine-q8", "dense")
ARCHS = ("qwen3moe", "deepseek2")
PROMPT = "Once upon a time, in a small village by the sea, there lived"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cli(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "rapidmoe.cli", *args], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"rapidmoe-cli {' '.join(args)} failed: {(r.stderr or r.stdout)[-400:]}")


def _logits(wq: Path, wr: Path, r: int) -> str:
    from rapidmoe import Llama  # noqa: PLC0415  (the compiled part: only where a model runs)

    llm = Llama(str(wq), residual_path=str(wr), n_critical=r, n_ctx=256, n_threads=2, logits_all=True,
                verbose=False, seed=0)
    try:
        tokens = llm.tokenize(PROMPT.encode())
        llm.eval(tokens)
        return _sha(np.asarray(llm.scores[: len(tokens)], dtype=np.float32).tobytes())
    finally:
        llm.close()


def fingerprints(models: Path, work: Path) -> dict[str, Any]:
    """{arch/src: the source's sha256, arch/preset: {files: {name: sha256}, logits_rR: sha256}}."""
    out: dict[str, Any] = {}
    models.mkdir(parents=True, exist_ok=True)
    for arch in ARCHS:
        src = models / f"{arch}-tiny.gguf"
        if not src.exists():
            _cli("make-model", "--arch", arch, "--size", "tiny", "-o", str(src))
        out[f"{arch}/src"] = _sha(src.read_bytes())
        for preset in PRESETS:
            od = work / f"{arch}-{preset}"
            _cli("convert", str(src), "-o", str(od), "--preset", preset, "--threads", "2", "--force")
            entry: dict[str, Any] = {"files": {f.name: _sha(f.read_bytes()) for f in sorted(od.glob("*.gguf"))}}
            wq, wr = next(od.glob("*.wq.gguf")), next(od.glob("*.wr.gguf"))
            for r in (0, 1, 2):
                entry[f"logits_r{r}"] = _logits(wq, wr, r)
            out[f"{arch}/{preset}"] = entry
            print(arch, preset, "done", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("record", "compare"))
    ap.add_argument("dir", type=Path, help="folder of the source models and record.json")
    ap.add_argument("--work", type=Path, help="where the converted files go (default DIR/work-MODE)")
    a = ap.parse_args()
    got = fingerprints(a.dir, a.work or a.dir / f"work-{a.mode}")
    if a.mode == "record":
        (a.dir / "record.json").write_text(json.dumps(got, indent=1, sort_keys=True))
        print(f"recorded {len(got)} entries in {a.dir / 'record.json'}")
        return 0
    base = json.loads((a.dir / "record.json").read_text())
    diff = {k: {"record": base.get(k), "now": got.get(k)} for k in sorted(set(base) | set(got))
            if base.get(k) != got.get(k)}
    print(json.dumps(diff, indent=1) if diff else "IDENTICAL: every converted file and every logit")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
