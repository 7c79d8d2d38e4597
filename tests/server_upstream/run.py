#!/usr/bin/env python3
"""Run the pinned llama.cpp's own server test-suite (tools/server/tests) against `rapidmoe-cli serve`.

The suite is copied out of vendor/ (left untouched), `llama-server` is replaced by llama_server_shim.py on the
tiny model, model downloads are switched off (upstream_plugin.py), and every test's outcome with the first line
of its failure is written to results.md beside this file.
Usage: python tests/server_upstream/run.py [pytest args, e.g. unit/test_tokenize.py]   (needs: requests, wget,
filelock, openai; `pip install ".[test]" requests wget filelock`)
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SUITE = ROOT / "vendor" / "llama.cpp" / "tools" / "server" / "tests"


def _model(work: Path) -> Path:
    sys.path.insert(0, str(ROOT / "python"))
    from rapidmoe.paths import vocab_dir  # noqa: PLC0415
    from rapidmoe.synthetic import spec_for, write_model  # noqa: PLC0415

    path = work / "tiny-qwen3moe.gguf"
    write_model(spec_for("qwen3moe", "tiny", seed=0), path, vocab_dir())
    return path


def _reason(case: ET.Element) -> tuple[str, str]:
    for kind in ("failure", "error", "skipped"):
        el = case.find(kind)
        if el is not None:
            msg = (el.get("message") or el.text or "").strip().splitlines()
            out = "".join(x.text or "" for x in case.iter() if x.tag in ("system-out", "system-err"))
            refused = re.search(r"not supported by rapidmoe-cli serve: (\S+)", out)
            first = f"server flag {refused.group(1)} not supported" if refused else (msg[0] if msg else "")
            return ("skipped" if kind == "skipped" else "failed"), first[:160]
    return "passed", ""


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="upstream-server-tests-") as tmp:
        work = Path(tmp)
        tests = work / "tools" / "server" / "tests"  # same depth as upstream: ../../../models/templates resolves
        shutil.copytree(SUITE, tests)
        (work / "models").symlink_to(SUITE.parent.parent.parent / "models")
        env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(HERE / "llama_server_shim.py"),
               "RAPIDMOE_UPSTREAM_MODEL": str(_model(work)), "LLAMA_CACHE": str(work / "cache"),
               "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        junit = work / "junit.xml"
        args = sys.argv[1:] or ["unit"]
        cmd = [sys.executable, "-m", "pytest", "-p", "upstream_plugin", "-p", "no:cacheprovider", "-q", "-m",
               "not slow", "-o", "junit_logging=all", f"--junitxml={junit}", *args]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, cwd=tests, env=env)
        rows = []
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome, why = _reason(case)
            rows.append((case.get("classname", "").replace("unit.", ""), case.get("name", ""), outcome, why))
    counts = Counter(r[2] for r in rows)
    lines = ["# llama.cpp server test-suite against `rapidmoe-cli serve`", "",
             f"Command: `python tests/server_upstream/run.py {' '.join(args)}` (tests marked slow deselected).", "",
             f"**{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped** "
             f"of {len(rows)}.", "", "| file | test | outcome | first line of the failure |", "|---|---|---|---|"]
    lines += [f"| {c} | `{n}` | {o} | {w.replace('|', '/')} |" for c, n, o, w in rows]
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped; "
          f"see {HERE / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
