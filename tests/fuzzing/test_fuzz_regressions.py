"""Every input the fuzzing found a bug with, kept small (tests/fuzzing/regressions/: the recipe that remakes it from
the default model, its conversion or a reader seed), run again the way a user runs it (a fresh `rapidmoe-cli`
process): each must now end as one `rapidmoe-cli: error:` line that says what is wrong. `found` in each file says
what the fuzz run saw before the fix (docs/fuzzing.md lists them)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fuzz.campaign import replay
from fuzz.harness import Outcome, base_env
from fuzz.targets import Bases

pytestmark = pytest.mark.native

KEPT = sorted((Path(__file__).parent / "regressions").glob("*.json"))


def test_every_finding_kept_has_its_input() -> None:
    assert len(KEPT) >= 10
    for p in KEPT:
        rec = json.loads(p.read_text())
        assert rec["expect"] and rec["found"] and ("edits" in rec["recipe"] or "bytes" in rec["recipe"]), p.name


@pytest.mark.parametrize("path", KEPT, ids=[p.stem for p in KEPT])
def test_kept_input_is_a_clean_error(path: Path, fuzz_bases: Bases, tmp_path: Path) -> None:
    rec = json.loads(path.read_text())
    verdict, stderr = replay(fuzz_bases, rec, tmp_path, base_env(), timeout=120)
    assert verdict.outcome == Outcome.clean_error, (rec["found"], verdict, stderr[-2000:])
    assert rec["expect"] in verdict.detail, (verdict.detail, stderr[-2000:])
