#!/usr/bin/env python3
"""Run the pinned llama.cpp's own server test-suite (tools/server/tests) against stock llama-server and against
`rapidmoe-cli serve`, on the same model with the same flags, and write both outcomes side by side.

The suite is copied out of vendor/ (left untouched) and model downloads are switched off (upstream_plugin.py).
`llama-server` is replaced by stock_server_shim.py (stock llama-server of the pin, built into build/stock/ by
tools/stock_llama.py, on our tiny synthetic model) or by llama_server_shim.py (ours, on the same model). A test
that fails on both fails because of the model or the sandbox (no downloads); one that passes on stock and fails on
ours is an incompatibility, fixed or explained in known.py (a feature we refuse by name, or a known difference);
results.md marks one without a reason "not explained". Each run's outcomes go to outcomes/<server>.json beside
this file, and results.md is rendered from them: a run of one server is shown beside the other's last run of the
same selection.
Usage: python tests/server_upstream/run.py [--server both|stock|ours] [--stock-bin PATH] [--render-only] [pytest
args, e.g. unit/test_tokenize.py]   (needs: requests, openai; `pip install ".[test]" requests`; wget and filelock are
stubbed in where they are not installed)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # known.py as server_upstream.known, the name mypy gives it
from server_upstream.known import reason  # noqa: E402  (after the sys.path change)

SUITE = ROOT / "vendor" / "llama.cpp" / "tools" / "server" / "tests"
OUTCOMES = HERE / "outcomes"
SERVERS = ("stock", "ours")
SHIMS = {"stock": HERE / "stock_server_shim.py", "ours": HERE / "llama_server_shim.py"}
DEFAULT_ARGS = ["unit"]


@dataclass(frozen=True)
class Case:
    """One test's outcome on one server: passed, failed or skipped, with the first line of why."""

    file: str
    test: str
    outcome: str
    why: str


@dataclass(frozen=True)
class Run:
    """One server's run of the suite: the pytest selection it ran, how long it took, and every test's outcome."""

    server: str
    args: list[str]
    seconds: float
    cases: list[Case]
    merged: list[str] = field(default_factory=list)  # the pytest arguments of later runs merged in (--merge)
    only: str = ""  # which tests of the selection ran, when not all (--stock-passed)

    def save(self, suffix: str = "") -> Path:
        OUTCOMES.mkdir(exist_ok=True)
        path = OUTCOMES / f"{self.server}{suffix}.json"
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @staticmethod
    def load(server: str, suffix: str = "") -> Run | None:
        path = OUTCOMES / f"{server}{suffix}.json"
        if not path.exists():
            return None
        d = json.loads(path.read_text())
        return Run(d["server"], d["args"], d["seconds"], [Case(**c) for c in d["cases"]], d.get("merged", []),
                   d.get("only", ""))

    def merge(self, later: Run) -> Run:
        """This run with `later`'s outcomes in place of its own for the tests `later` ran (a rerun of a few files)."""
        new = {(c.file, c.test): c for c in later.cases}
        cases = [new.pop((c.file, c.test), c) for c in self.cases] + list(new.values())
        return Run(self.server, self.args, self.seconds, cases, [*self.merged, " ".join(later.args)], self.only)


def _model(work: Path) -> Path:
    sys.path.insert(0, str(ROOT / "python"))
    from rapidmoe.paths import vocab_dir  # noqa: PLC0415  (after the sys.path change)
    from rapidmoe.synthetic import spec_for, write_model  # noqa: PLC0415

    path = work / "tiny-qwen3moe.gguf"
    write_model(spec_for("qwen3moe", "tiny", seed=0), path, vocab_dir())
    return path


def _stock_server(given: str | None) -> Path:
    """The stock llama-server binary: the one given, else the pin's, built (once, cached) into build/stock/."""
    if given:
        return Path(given).resolve()
    sys.path.insert(0, str(ROOT / "tools"))
    from stock_llama import build_stock  # noqa: PLC0415  (after the sys.path change)

    print("building stock llama-server into build/stock/ (reused once built)", flush=True)
    return build_stock(["llama-server"]) / "llama-server"


def _reason(case: ET.Element) -> tuple[str, str]:
    for kind in ("failure", "error", "skipped"):
        el = case.find(kind)
        if el is not None:
            msg = (el.get("message") or el.text or "").strip().splitlines()
            out = "".join(x.text or "" for x in case.iter() if x.tag in ("system-out", "system-err"))
            refused = re.search(r"not supported by rapidmoe-cli serve: (\S+)", out)
            unknown = re.search(r"error: invalid argument: (\S+)", out)  # llama-server's answer to a flag it lacks
            flag = refused or unknown
            first = f"server flag {flag.group(1)} not supported" if flag else (msg[0] if msg else "")
            return ("skipped" if kind == "skipped" else "failed"), first[:160]
    return "passed", ""


def run_suite(server: str, args: list[str], model: Path, work: Path, stock_bin: Path | None, slow: bool = False,
              tests_only: list[str] | None = None) -> Run:
    """Run the copied suite with `llama-server` replaced by `server`'s shim; every test's outcome from JUnit XML.
    `slow`: only the tests marked slow (the suite runs them with SLOW_TESTS=1); `tests_only`: these node ids instead
    of `args` (which the run still records as its selection)."""
    tests = work / "tools" / "server" / "tests"  # same depth as upstream: ../../../models/templates resolves
    if tests.exists():
        shutil.rmtree(tests)
    shutil.copytree(SUITE, tests)
    paths = [str(HERE)]
    if any(importlib.util.find_spec(m) is None for m in ("wget", "filelock")):
        paths.append(str(HERE / "stubs"))  # after HERE, and only when missing: an installed package wins
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(SHIMS[server]), "RAPIDMOE_UPSTREAM_MODEL": str(model),
           "LLAMA_CACHE": str(work / "cache"),
           "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
    if slow:
        env["SLOW_TESTS"] = "1"
    if stock_bin is not None:
        env["RAPIDMOE_STOCK_SERVER"] = str(stock_bin)
    junit = work / f"junit-{server}.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", "upstream_plugin", "-p", "no:cacheprovider", "-q", "-m",
           "slow" if slow else "not slow", "-o", "junit_logging=all", f"--junitxml={junit}",
           *(tests_only if tests_only is not None else args)]
    print(f"[{server}] {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=tests, env=env)
    seconds = time.monotonic() - t0
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, why = _reason(case)
        cases.append(Case(case.get("classname", "").replace("unit.", ""), case.get("name", ""), outcome, why))
    only = f"only the {len(tests_only)} tests that passed on stock" if tests_only is not None else ""
    return Run(server, args, round(seconds, 1), cases, only=only)


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def _totals(run: Run) -> str:
    c = Counter(x.outcome for x in run.cases)
    return f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"


def render(runs: dict[str, Run], slow: bool = False) -> str:
    """results.md: totals per server, the cross-count, the tests that pass on stock and fail on ours, every test."""
    args = next(iter(runs.values())).args
    cmd = f"python tests/server_upstream/run.py {'--slow ' if slow else ''}{' '.join(args)}"
    which = "only the tests marked slow, with SLOW_TESTS=1" if slow else "tests marked slow deselected"
    merged = [f"{name}: `{' '.join(run.args)}`, then `{m}` run again and merged in (--merge)"
              for name, run in runs.items() for m in run.merged]
    merged += [f"{name} ran {run.only} (--stock-passed)" for name, run in runs.items() if run.only]
    lines = ["# llama.cpp server test-suite: stock llama-server and `rapidmoe-cli serve`", "",
             *([f"Selections: {'; '.join(merged)}.", ""] if merged else []),
             f"Command: `{cmd}` ({which}). Both servers run the same suite on the same model "
             "(the tiny synthetic qwen3moe, seed 0: the suite's own models are downloads) with the same flags; "
             "stock is llama-server of the pinned llama.cpp, unpatched (build/stock/).", "",
             "| server | passed | failed | skipped | of | minutes |", "|---|---|---|---|---|---|"]
    for name, run in runs.items():
        c = Counter(x.outcome for x in run.cases)
        lines.append(f"| {name} | {c['passed']} | {c['failed']} | {c['skipped']} | {len(run.cases)} | "
                     f"{run.seconds / 60:.1f} |")
    keys: dict[tuple[str, str], None] = {}
    by: dict[str, dict[tuple[str, str], Case]] = {}
    for name, run in runs.items():
        by[name] = {(x.file, x.test): x for x in run.cases}
        keys.update(dict.fromkeys(by[name]))
    missing = Case("", "", "-", "")
    if set(runs) == set(SERVERS):
        stock, ours = by["stock"], by["ours"]
        pair = Counter((stock.get(k, missing).outcome, ours.get(k, missing).outcome) for k in keys)
        kinds = ["passed", "failed", "skipped", "-"]
        lines += ["", "Tests by outcome on stock (rows) and on ours (columns):", "",
                  "| stock \\ ours | passed | failed | skipped | not run |", "|---|---|---|---|---|"]
        for s in kinds:
            if any(pair[(s, o)] for o in kinds):
                lines.append(f"| {s if s != '-' else 'not run'} | " + " | ".join(str(pair[(s, o)]) for o in kinds)
                             + " |")
        regress = [k for k in keys if stock.get(k, missing).outcome == "passed"
                   and ours.get(k, missing).outcome != "passed"]
        why = {k: reason(*k) for k in regress}
        unexplained = sum(1 for k in regress if not why[k])
        lines += ["", f"## Pass on stock, fail on ours: {len(regress)} ({unexplained} not explained)", "",
                  "The reason of each is in known.py beside this file (docs/server.md, \"Results of llama.cpp's "
                  "server test-suite\", lists them): a feature refused by name, or a known difference.",
                  "", "| file | test | ours | first line of our failure | reason |", "|---|---|---|---|---|"]
        lines += [f"| {k[0]} | `{_cell(k[1])}` | {ours.get(k, missing).outcome} | {_cell(ours.get(k, missing).why)} | "
                  f"{_cell(why[k]) or '**not explained**'} |" for k in regress]
        better = [k for k in keys if ours.get(k, missing).outcome == "passed"
                  and stock.get(k, missing).outcome != "passed"]
        lines += ["", f"## Pass on ours, fail on stock: {len(better)}", "",
                  "| file | test | first line of stock's failure |", "|---|---|---|"]
        lines += [f"| {k[0]} | `{_cell(k[1])}` | {_cell(stock.get(k, missing).why)} |" for k in better]
    names = list(runs)
    lines += ["", "## Every test", "", "| file | test | " + " | ".join(names) + " | "
              + " | ".join(f"first line of the failure on {n}" for n in names) + " |",
              "|---|---|" + "---|" * (2 * len(names))]
    for k in keys:
        got = [by[n].get(k, missing) for n in names]
        lines.append(f"| {k[0]} | `{_cell(k[1])}` | " + " | ".join(g.outcome for g in got) + " | "
                     + " | ".join(_cell(g.why) for g in got) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                 epilog="Every other argument goes to pytest (default: unit).")
    ap.add_argument("--server", choices=["both", *SERVERS], default="both",
                    help="which server to run the suite against (default both); results.md shows the other's last "
                         "run beside it when that run had the same pytest arguments")
    ap.add_argument("--stock-bin", default=None,
                    help="a stock llama-server binary to use instead of building the pin's into build/stock/")
    ap.add_argument("--slow", action="store_true",
                    help="run only the tests marked slow (SLOW_TESTS=1); outcomes in outcomes/<server>-slow.json and "
                         "results-slow.md")
    ap.add_argument("--merge", action="store_true",
                    help="merge this run's outcomes into the server's last run (tests run again replace theirs), "
                         "for a rerun of a few files after a full run")
    ap.add_argument("--stock-passed", action="store_true",
                    help="with --server ours: run only the tests that passed in stock's last run of the selection "
                         "(the others cannot pass on stock and fail on ours), as when the slow tests are long on ours")
    ap.add_argument("--render-only", action="store_true",
                    help="run nothing: write results.md again from the last runs in outcomes/ (after editing known.py)")
    opts, args = ap.parse_known_args()
    args = args or DEFAULT_ARGS
    servers = [] if opts.render_only else list(SERVERS) if opts.server == "both" else [opts.server]
    stock_bin = _stock_server(opts.stock_bin) if "stock" in servers else None
    runs: dict[str, Run] = {}
    suffix = "-slow" if opts.slow else ""
    with tempfile.TemporaryDirectory(prefix="upstream-server-tests-") as tmp:
        work = Path(tmp)
        if not servers:
            print("--render-only: nothing run")
        (work / "models").symlink_to(SUITE.parent.parent.parent / "models")
        model = _model(work) if servers else work
        for server in servers:
            only = None
            if opts.stock_passed and server == "ours":
                ref = Run.load("stock", suffix)
                if ref is None or ref.args != args:
                    print(f"--stock-passed: no stock run of `{' '.join(args)}`", file=sys.stderr)
                    return 1
                only = [f"unit/{c.file}.py::{c.test}" for c in ref.cases if c.outcome == "passed"]
            run = run_suite(server, args, model, work, stock_bin, opts.slow, only)
            print(f"[{server}] {_totals(run)} in {run.seconds / 60:.1f} min", flush=True)
            before = Run.load(server, suffix) if opts.merge else None
            if before is not None:
                run = before.merge(run)
                args = run.args
            print(f"[{server}] outcomes in {run.save(suffix)}", flush=True)
            runs[server] = run
    for other in SERVERS:  # the other server's last run of the same selection, shown beside this one
        last = Run.load(other, suffix) if other not in runs else None
        if last is not None and last.args == args:
            runs[other] = last
    ordered = {s: runs[s] for s in SERVERS if s in runs}
    if not ordered:
        print(f"no runs of `{' '.join(args)}` in {OUTCOMES}", file=sys.stderr)
        return 1
    out = HERE / f"results{suffix}.md"
    out.write_text(render(ordered, opts.slow))
    print(f"see {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
