"""tests/conftest.py's CI guard, run on a small suite of its own: with CI set, a skip fails (a test's, a fixture's, a
whole module's, each with its reason) unless CI_LEGITIMATE_SKIPS lists the reason; without CI nothing changes; an
xfail stays an xfail and one that passes fails (xfail_strict)."""
from __future__ import annotations

import pytest
from testkit import ROOT

pytest_plugins = ["pytester"]

SUITE = {
    "test_a": '''
import pytest

def test_skips():
    pytest.skip("needs something CI has")

def test_legitimate():
    pytest.skip("stock llama-server not built (python tools/stock_llama.py llama-server)")

@pytest.mark.skipif(True, reason="a GPU may be present")
def test_legitimate_mark():
    pass

@pytest.fixture
def needs():
    pytest.skip("a fixture's skip")

def test_fixture_skips(needs):
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_known_failure():
    assert False

def test_passes():
    pass
''',
    "test_b": '''
import pytest
pytest.importorskip("no_such_module_h4")

def test_never_collected():
    pass
''',
}


def _run(pytester: pytest.Pytester, ci: str | None) -> pytest.RunResult:
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makeini("[pytest]\nxfail_strict = true\n")
    pytester.makepyfile(**SUITE)
    env = {"CI": ci} if ci is not None else {}
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CI", raising=False)
        for k, v in env.items():
            mp.setenv(k, v)
        return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA")


def test_without_ci_skips_stay_skips(pytester: pytest.Pytester) -> None:
    res = _run(pytester, None)
    res.assert_outcomes(passed=1, skipped=5, xfailed=1)


@pytest.mark.parametrize("ci", ["true", "1"])
def test_under_ci_a_skip_fails_unless_listed(pytester: pytest.Pytester, ci: str) -> None:
    res = _run(pytester, ci)
    res.assert_outcomes(passed=1, skipped=2, xfailed=1, failed=2, errors=1)
    out = res.stdout.str()
    for reason in ("needs something CI has", "a fixture's skip", "could not import 'no_such_module_h4'"):
        assert f"skipped under CI (CI={ci}): {reason}" in out, out
    assert "test_b.py::module_skipped_under_CI" in out


def test_ci_false_is_not_ci(pytester: pytest.Pytester) -> None:
    _run(pytester, "false").assert_outcomes(passed=1, skipped=5, xfailed=1)
