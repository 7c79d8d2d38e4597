"""A fuzz campaign: cases of some targets, run by a few workers (each with its own runner and directory), every
verdict counted, every finding kept as a JSON record (its recipe, command, outcome, the end of its stderr) that
`tools/fuzz_run.py --replay` and the regression tests remake the input from.
"""
from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .harness import ForkRunner, Outcome, Runner, SubprocessRunner, Verdict, classify
from .targets import Bases, Case, make_case, materialize

BASE_TIMEOUT = 60.0  # seconds for one `run` of the tiny model; scaled per case kind and for sanitizer builds


@dataclass
class Summary:
    counts: dict[str, Counter[str]] = field(default_factory=dict)  # target -> outcome -> n
    ops: dict[str, Counter[str]] = field(default_factory=dict)  # target -> operator -> n (what the inputs exercised)
    kinds: dict[str, Counter[str]] = field(default_factory=dict)  # target -> command kind (Case.kind) -> n
    errors: dict[str, Counter[str]] = field(default_factory=dict)  # target -> first words of the error line -> n
    findings: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, case: Case, verdict: Verdict) -> None:
        self.counts.setdefault(case.target, Counter())[verdict.outcome.value] += 1
        for op in case.recipe.get("ops", []):
            self.ops.setdefault(case.target, Counter())[op] += 1
        if case.kind:
            self.kinds.setdefault(case.target, Counter())[case.kind] += 1
        if verdict.outcome == Outcome.clean_error:
            words = " ".join(w for w in verdict.detail.split()[:6] if "/" not in w)
            self.errors.setdefault(case.target, Counter())[words] += 1

    def to_json(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 1),
                "counts": {t: dict(c) for t, c in self.counts.items()},
                "findings": self.findings,
                "ops": {t: dict(c) for t, c in self.ops.items()},
                "kinds": {t: dict(c) for t, c in self.kinds.items()},
                "errors": {t: dict(c.most_common(40)) for t, c in self.errors.items()}}

    @property
    def n_findings(self) -> int:
        return len(self.findings)


def run_case(runner: Runner, bases: Bases, case: Case, workdir: Path, timeout: float) -> tuple[Verdict, str]:
    """Write the case's input, run it, classify; (verdict, stderr)."""
    materialize(bases, case.recipe, workdir)
    argv = [a.replace("{wq}", str(bases.wq)) for a in case.argv]
    run = runner.run(argv, timeout * case.timeout_scale, cwd=workdir)
    problem = case.check(workdir, run.rc) if case.check is not None and not run.timed_out and run.rc >= 0 else None
    return classify(run, problem), run.stderr


def run_campaign(bases: Bases, plan: Sequence[tuple[str, int]], *, seed: int, out: Path, jobs: int = 2,
                 fork: bool = True, env: dict[str, str], timeout: float = BASE_TIMEOUT, start: int = 0,
                 convert_share: float = 0.02, progress: Callable[[str], None] | None = None) -> Summary:
    """Run `n` cases of each (target, n) in plan, indices start.. start+n-1, on `jobs` workers."""
    out = out.resolve()  # the fork servers chdir into each case's directory: its path must not be relative
    out.mkdir(parents=True, exist_ok=True)
    summary = Summary()
    lock = threading.Lock()
    queue = [(t, i) for t, n in plan for i in range(start, start + n)]
    t0 = time.monotonic()

    failed: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            work(w)
        except BaseException as e:  # noqa: BLE001 - the harness's own bug: raised again in the caller's thread
            failed.append(e)
            queue.clear()

    def work(w: int) -> None:
        wd = out / f"worker{w}"
        wd.mkdir(exist_ok=True)
        runner: Runner = ForkRunner(wd / "fs", env) if fork else SubprocessRunner(wd, env)
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    target, index = queue.pop(0)
                case = make_case(bases, target, seed, index, convert_share)
                verdict, stderr = run_case(runner, bases, case, wd, timeout)
                with lock:
                    summary.add(case, verdict)
                    done = sum(sum(c.values()) for c in summary.counts.values())
                    if verdict.outcome.is_finding:
                        rec = {"target": target, "index": index, "seed": seed, "argv": case.argv,
                               "outcome": verdict.outcome.value, "detail": verdict.detail, "recipe": case.recipe,
                               "stderr_tail": stderr[-3000:]}
                        summary.findings.append(rec)
                        (out / "findings").mkdir(exist_ok=True)
                        (out / "findings" / f"{target}-{seed}-{index}.json").write_text(json.dumps(rec, indent=1))
                        if progress:
                            progress(f"FINDING {target} #{index}: {verdict.outcome.value}: {verdict.detail}")
                    if progress and done % 100 == 0:
                        progress(f"{done} cases, {summary.n_findings} findings, {time.monotonic() - t0:.0f} s")
        finally:
            runner.close()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(jobs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if failed:
        raise failed[0]
    summary.seconds = time.monotonic() - t0
    (out / "summary.json").write_text(json.dumps(summary.to_json(), indent=1))
    return summary


def replay(bases: Bases, record: dict[str, Any], workdir: Path, env: dict[str, str],
           timeout: float = BASE_TIMEOUT) -> tuple[Verdict, str]:
    """A kept finding run again, in a fresh process as a user would run it."""
    workdir.mkdir(parents=True, exist_ok=True)
    case = make_case(bases, record["target"], record["seed"], record["index"])
    case.recipe = record["recipe"]
    case.argv = record["argv"]
    return run_case(SubprocessRunner(workdir, env), bases, case, workdir, timeout)


def run_http(model: Path, n: int, *, seed: int, out: Path, env: dict[str, str], start: int = 0,
             timeout: float = 60.0, progress: Callable[[str], None] | None = None) -> Summary:
    """n HTTP cases against one server on `model`; a server that died is a finding and is started again."""
    from .http_target import Server, make_case, run_case  # noqa: PLC0415

    out.mkdir(parents=True, exist_ok=True)
    summary = Summary()
    t0 = time.monotonic()
    n_server = 0

    def start_server() -> Server:
        nonlocal n_server
        n_server += 1
        return Server(model, out / f"server{n_server}.log", env)

    server = start_server()
    try:
        for i in range(start, start + n):
            case = make_case(seed, i)
            v = run_case(server, case, timeout)
            c = summary.counts.setdefault("http", Counter())
            c["finding" if v.finding else f"status_{v.status // 100}xx" if v.status > 0 else "no_reply"] += 1
            summary.ops.setdefault("http", Counter())[case.kind] += 1
            if v.finding:
                rec = {"target": "http", "index": i, "seed": seed, "kind": case.kind, "note": case.note,
                       "detail": v.detail, "request": [c.decode("latin-1")[:2000] for c in case.chunks]}
                summary.findings.append(rec)
                if progress:
                    progress(f"FINDING http #{i} ({case.kind}: {case.note}): {v.detail[:300]}")
                if server.proc.poll() is not None:
                    server = start_server()
            if progress and (i - start + 1) % 100 == 0:
                progress(f"http: {i - start + 1} cases, {summary.n_findings} findings, {time.monotonic() - t0:.0f} s")
    finally:
        rc = server.stop()
        if rc not in (0, -15):
            summary.findings.append({"target": "http", "detail": f"server exit status {rc} at shutdown"})
    summary.seconds = time.monotonic() - t0
    (out / "summary-http.json").write_text(json.dumps(summary.to_json(), indent=1))
    return summary


def keep(record: dict[str, Any], expect: str, found: str) -> dict[str, Any]:
    """A finding as a regression input (tests/fuzzing/regressions/): its recipe and command, what the fuzz run
    found before the fix, and the piece of the one error line the fixed code prints."""
    return {"target": record["target"], "seed": record["seed"], "index": record["index"], "argv": record["argv"],
            "recipe": record["recipe"], "found": found or f"{record['outcome']}: {record['detail']}",
            "expect": expect}
