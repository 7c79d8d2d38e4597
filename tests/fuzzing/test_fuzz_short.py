"""CI's short, seeded fuzz run (docs/fuzzing.md): tens to a few hundred inputs of every target, about a minute and a
half on two cores, failing on any crash, sanitizer report, hang, traceback, failure without the one error line, or
half-written output. The seed and counts are fixed, so CI tries the same inputs every time (a finding reproduces
from its record); the long runs of docs/fuzzing.md try other seeds. The inputs must reach the deep paths too, or the run
would pass by finding nothing: the test checks that they did (llama.cpp's loader, the sidecar's C++ attach,
generation, every operator)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fuzz.campaign import run_campaign, run_http
from fuzz.harness import base_env
from fuzz.mutate_gguf import MODEL_OPS, SIDECAR_OPS
from fuzz.targets import Bases

pytestmark = pytest.mark.native

SEED = 24
# Each count covers every mutator kind its target draws with this seed, with margin (measured on this seed: the
# model target's 26 operators by input 47 and its 5 commands by input 16, the sidecar's 22 operators by input 70,
# the policy target's 12 JSON/text operators by input 18, imatrix/frequency/trace theirs by inputs 141/171/156). A
# model input runs the model (about a second each on two busy cores), a reader input about a tenth of that.
# An operator change that leaves one out of the model run fails the ops assertion below by name: raise the count.
PLAN = [("model", 80), ("sidecar", 70), ("imatrix", 200), ("frequency", 200), ("policy", 50), ("trace", 200)]
# the model inputs that run `convert` (9 with the default preset, 2 with cpu-fast on this seed: most are refused in
# one line at once, one that converts takes a few seconds); the default preset inspects the file before it picks one
CONVERT_SHARE = 0.15
MODEL_COMMANDS = {"run", "run --trace", "inspect", "convert", "convert cpu-fast"}
N_HTTP = 150


def test_short_fuzz_run(fuzz_bases: Bases, tmp_path: Path) -> None:
    s = run_campaign(fuzz_bases, PLAN, seed=SEED, out=tmp_path, jobs=2, env=base_env(), convert_share=CONVERT_SHARE)
    report = json.dumps({"counts": s.to_json()["counts"], "findings": s.findings}, indent=1)[:20000]
    assert not s.findings, f"fuzz findings (replay: python tools/fuzz_run.py --replay RECORD):\n{report}"
    for target, n in PLAN:
        c = s.counts[target]
        assert sum(c.values()) == n and c["clean_error"] > 0 and c["ok"] > 0, (target, c)
    errors = {t: " | ".join(e) for t, e in s.errors.items()}
    assert "llama.cpp could not load" in errors["model"], errors["model"]  # mutants got past our checks
    assert "cannot attach" in errors["sidecar"], errors["sidecar"]  # re-signed sidecars reached the C++ loader
    assert set(s.ops["model"]) == set(MODEL_OPS), set(MODEL_OPS) - set(s.ops["model"])
    assert set(s.kinds["model"]) == MODEL_COMMANDS, s.kinds["model"]  # every command, `convert` with both presets
    assert {"side_rename", "side_type", "side_shape", "side_meta"} <= set(s.ops["sidecar"]) <= set(SIDECAR_OPS)


def test_short_http_fuzz_run(tiny_qwen: Path, tmp_path: Path) -> None:
    s = run_http(tiny_qwen, N_HTTP, seed=SEED, out=tmp_path, env=base_env())
    assert not s.findings, json.dumps(s.findings, indent=1)[:20000]
    assert set(s.ops["http"]) == {"framing", "headers", "body", "slow", "vanish", "get"}, s.ops["http"]
    c = s.counts["http"]
    assert c["status_2xx"] > 0 and c["status_4xx"] > 0, c  # requests answered, and malformed ones refused
