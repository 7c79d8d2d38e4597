"""Run a fuzz campaign (docs/fuzzing.md): `python tools/fuzz_run.py --targets model,sidecar --n 100 --seed 1`.

--asan DIR runs the children on the sanitizer build (tools/asan_build.sh) with libasan and libubsan preloaded;
--replay FILE.json runs a kept finding again in a fresh process and prints its verdict. Exit status 1 when a
campaign had findings.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from fuzz.asan import asan_env
from fuzz.campaign import keep, replay, run_campaign, run_http
from fuzz.harness import base_env
from fuzz.targets import TARGETS, prepare_bases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}, http")
    ap.add_argument("--n", default="100", help="cases per target: N, or target=N,... (e.g. model=5000,policy=2000)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--start", type=int, default=0, help="first case index")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("build/fuzz/run"))
    ap.add_argument("--bases", type=Path, default=Path("build/fuzz/bases"), help="where the base files are made")
    ap.add_argument("--subprocess", action="store_true", help="a fresh process per case (slower; no fork server)")
    ap.add_argument("--convert-share", type=float, default=0.02, help="share of model cases that run convert")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--asan", type=Path, default=None, help="the sanitizer build's directory (tools/asan_build.sh)")
    ap.add_argument("--replay", type=Path, default=None, help="a finding's JSON record: run it again")
    ap.add_argument("--keep", type=Path, default=None,
                    help="with --replay: write the finding as a regression input to this path (the tests replay it)")
    ap.add_argument("--expect", default="", help="with --keep: a piece of the error line the fixed code prints")
    a = ap.parse_args()

    bases = prepare_bases(a.bases)
    env = asan_env(a.asan) if a.asan is not None else base_env()
    if a.replay is not None:
        record = json.loads(a.replay.read_text())
        verdict, stderr = replay(bases, record, a.out / "replay", env, a.timeout)
        print(stderr[-4000:], file=sys.stderr)
        print(f"{verdict.outcome.value}: {verdict.detail}")
        if a.keep is not None:
            if verdict.outcome.value != "clean_error" or a.expect not in verdict.detail:
                print(f"not kept: the fixed code should give a clean error with {a.expect!r}", file=sys.stderr)
                return 1
            a.keep.write_text(json.dumps(keep(record, a.expect, record.get("found", "")), indent=1) + "\n")
        return 1 if verdict.outcome.is_finding else 0
    targets = a.targets.split(",")
    counts = dict(kv.split("=") for kv in a.n.split(",")) if "=" in a.n else dict.fromkeys(targets, a.n)
    plan = [(t, int(counts.get(t, 0))) for t in targets if t != "http"]
    log = lambda m: print(time.strftime("%H:%M:%S"), m, flush=True)  # noqa: E731
    n_findings = 0
    if "http" in targets:
        hs = run_http(bases.model, int(counts.get("http", 0)), seed=a.seed, out=a.out, env=env, start=a.start,
                      timeout=a.timeout * (3 if a.asan else 1), progress=log)
        print(json.dumps({"seconds": round(hs.seconds), "counts": {t: dict(c) for t, c in hs.counts.items()},
                          "findings": hs.n_findings}, indent=1))
        n_findings += hs.n_findings
    if not plan:
        return 1 if n_findings else 0
    summary = run_campaign(bases, plan, seed=a.seed, out=a.out, jobs=a.jobs, fork=not a.subprocess, env=env,
                           timeout=a.timeout * (3 if a.asan else 1), start=a.start, convert_share=a.convert_share,
                           progress=log)
    print(json.dumps({"seconds": round(summary.seconds), "counts": {t: dict(c) for t, c in summary.counts.items()},
                      "findings": summary.n_findings}, indent=1))
    shallow = [t for t, c in summary.counts.items() if sum(c.values()) >= 20 and len(summary.errors.get(t, {})) <= 1
               and not c["ok"]]
    for t in shallow:  # a long run that tried nothing past one check would say "0 findings" (seen: sidecar)
        only = next(iter(summary.errors.get(t, {})), "")
        print(f"fuzz_run: every {t} case ended in the same error ({only!r}): its inputs did not reach the code "
              "under test; a failed run", file=sys.stderr)
    return 1 if summary.n_findings + n_findings or shallow else 0


if __name__ == "__main__":
    sys.exit(main())
