"""The fuzz harness's verdicts on programs whose outcome is known (a signal, a hang, a traceback, a clean error, a
failure without the error line, a sanitizer report, a half-written output), through both runners; and on a
known-crashing input: the default model with two equal tokenizer entries, which llama.cpp's loader alone (the
`upstream` target) aborts on while `rapidmoe-cli run` refuses it in one line. A classifier that missed any of these
would let a fuzz run pass that should fail."""
from __future__ import annotations

from pathlib import Path

import pytest
from fuzz.campaign import run_campaign, run_case
from fuzz.harness import ForkRunner, Outcome, Run, SubprocessRunner, base_env, classify
from fuzz.mutate_gguf import keep_data_aligned, replace_string
from fuzz.targets import Bases, Case, model_case

pytestmark = pytest.mark.native

# name: (program run in the case's process, expected outcome, a piece of the verdict's detail)
PROGRAMS = {
    "abort": ("import os; os.abort()", Outcome.crash, "SIGABRT"),
    "segv": ("import ctypes; ctypes.string_at(0)", Outcome.crash, "SIGSEGV"),
    "hang": ("import time; time.sleep(60)", Outcome.hang, "no exit"),
    "traceback": ("raise KeyError('boom')", Outcome.traceback, "KeyError: 'boom'"),
    "clean": ("import sys; print('rapidmoe-cli: error: bad file', file=sys.stderr); sys.exit(1)",
              Outcome.clean_error, "bad file"),
    "two_lines": ("import sys; print('rapidmoe-cli: error: a\\nrapidmoe-cli: error: b', file=sys.stderr); "
                  "sys.exit(1)", Outcome.bad_error, "2 error lines"),
    "silent": ("import sys; sys.exit(3)", Outcome.bad_error, "exit 3"),
    "ok": ("print('fine')", Outcome.ok, ""),
    "asan": ("import sys; print('==1==ERROR: AddressSanitizer: heap-buffer-overflow', file=sys.stderr); "
             "print('SUMMARY: AddressSanitizer: heap-buffer-overflow x.cpp:1', file=sys.stderr); sys.exit(1)",
             Outcome.sanitizer, "SUMMARY: AddressSanitizer"),
}


def _runner(kind: str, tmp_path: Path) -> ForkRunner | SubprocessRunner:
    env = base_env()
    return ForkRunner(tmp_path / "fs", env) if kind == "fork" else SubprocessRunner(tmp_path, env)


@pytest.mark.parametrize("runner_kind", ["fork", "subprocess"])
def test_classifier_on_known_outcomes(runner_kind: str, tmp_path: Path) -> None:
    runner = _runner(runner_kind, tmp_path)
    try:
        for name, (code, outcome, detail) in PROGRAMS.items():
            prog = tmp_path / f"{name}.py"
            prog.write_text(code)
            # the `exec` reader runs the file in the case's process, the way a reader target runs
            run = runner.run(["--reader", "exec", str(prog)], timeout=3 if name == "hang" else 60, cwd=tmp_path)
            v = classify(run)
            assert v.outcome == outcome and detail in v.detail, (name, v, run.stderr[-500:])
    finally:
        runner.close()


def test_output_problems_are_findings() -> None:
    assert classify(Run(0, False, "", "", 1.0), "convert failed but left ['x.wq.gguf']").outcome == Outcome.half_written
    assert classify(Run(1, False, "", "rapidmoe-cli: error: no\n", 1.0)).outcome == Outcome.clean_error
    assert classify(Run(0, False, "", "x.cpp:3:1: runtime error: shift exponent 40\n", 1.0)).outcome == \
        Outcome.sanitizer


def _dup_token_case(bases: Bases, target: str) -> Case:
    """Token 2001 made a copy of token 2000 (plain BPE tokens: nothing else in the vocabulary refers to them)."""
    _, lay = bases.load("model")
    tokens = lay.kv("tokenizer.ggml.tokens")
    assert tokens is not None
    edits = keep_data_aligned(lay, [replace_string(tokens.items[2001], tokens.items[2000].text)])
    recipe = {"base": "model", "file": "mutant.gguf", "ops": ["tok_dup"], "edits": [e.to_json() for e in edits]}
    argv = (["--reader", "llama-load", "mutant.gguf"] if target == "upstream" else
            ["run", "mutant.gguf", "-p", "hi", "-n", "1", "-c", "64", "-t", "1"])
    return Case(target, 0, argv, recipe)


@pytest.mark.parametrize("runner_kind", ["fork", "subprocess"])
def test_known_crashing_input(fuzz_bases: Bases, tmp_path: Path, runner_kind: str) -> None:
    runner = _runner(runner_kind, tmp_path)
    try:
        v, stderr = run_case(runner, fuzz_bases, _dup_token_case(fuzz_bases, "upstream"), tmp_path, 120)
        assert v.outcome == Outcome.crash and "SIGABRT" in v.detail, (v, stderr[-2000:])
        assert "id_to_token.size() == token_to_id.size()" in v.detail, v  # the abort hook's line reached the runner
        v, stderr = run_case(runner, fuzz_bases, _dup_token_case(fuzz_bases, "model"), tmp_path, 120)
        assert v.outcome == Outcome.clean_error and "lists the token" in v.detail, (v, stderr[-2000:])
    finally:
        runner.close()


def test_campaign_records_a_crash(fuzz_bases: Bases, tmp_path: Path) -> None:
    """A campaign finds and records a crash end to end: seeded model mutants that make two tokens equal, loaded by
    llama.cpp alone (the `upstream` target)."""
    dup = [i for i in range(600) if model_case(fuzz_bases, 1, i).recipe["ops"] == ["tok_dup"]][:2]
    assert dup, "no lone tok_dup mutant among the first 600 of seed 1: the mutator's weights changed"
    found = []
    for i in dup:
        s = run_campaign(fuzz_bases, [("upstream", 1)], seed=1, out=tmp_path / f"u{i}", jobs=1, env=base_env(),
                         start=i)
        found += s.findings
        assert (tmp_path / f"u{i}" / "findings" / f"upstream-1-{i}.json").exists()
    assert found and all(f["outcome"] == "crash" for f in found), found
    assert all(f["recipe"]["edits"] for f in found)
