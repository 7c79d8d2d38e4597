"""bench/gpu_check.sh without a GPU: it refuses clearly, and its driver's CPU dry run (same steps, -ngl 0, tiny
sizes) runs end to end and writes its table, with the "GPU" path equal to the CPU path. The CUDA build's import
check (tools/cuda_import_check.py) and gpu_check's --site, with a CPU-only build installed in a folder of its own
standing in for the CUDA build, next to each kind of install: this interpreter's own (editable in development), a
normal one (the package in site-packages beside numpy), and none (the comparison skipped, and said so)."""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
from testkit import ROOT

import rapidmoe


def _stage_site(dst: Path) -> Path:
    """This interpreter's rapidmoe (its compiled parts over its Python sources) installed into dst/rapidmoe, as
    tools/cuda_build_check.sh installs the CUDA build into build/cuda/site: the CUDA build's stand-in."""
    from rapidmoe._runtime import _core  # noqa: PLC0415 - the compiled parts (the module imports without them)

    for src in (Path(rapidmoe.__file__).parent, Path(_core.__file__).parent):
        shutil.copytree(src, dst / "rapidmoe", symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _venv(dst: Path, package: Path | None) -> Path:
    """A venv with this interpreter's packages (linked) but not its rapidmoe; `package` copied into its
    site-packages as `pip install .` puts it. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dst)], check=True, timeout=120)
    py = dst / "bin" / "python"
    sp = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip())
    for d in [*site.getsitepackages(), site.getusersitepackages()]:
        for e in Path(d).glob("*") if Path(d).is_dir() else []:
            if "rapidmoe" not in e.name and not (sp / e.name).exists():
                (sp / e.name).symlink_to(e)
    if package is not None:
        shutil.copytree(package, sp / "rapidmoe", symlinks=True)
    return py


@pytest.fixture(scope="module")
def setups(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """(the stand-in's install prefix, {set-up: python}) for the three kinds of install."""
    tmp = tmp_path_factory.mktemp("cuda-site")
    stand_in = _stage_site(tmp / "site")
    return stand_in, {"own": Path(sys.executable), "normal": _venv(tmp / "venv-normal", stand_in / "rapidmoe"),
                      "none": _venv(tmp / "venv-none", None)}


def _env(stand_in: Path) -> dict[str, str]:
    """What build/cuda/env.sh sets: the build first on PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(stand_in), *filter(None, [os.environ.get("PYTHONPATH")])]))


@pytest.mark.native
@pytest.mark.slow
def test_import_check_from_each_kind_of_install(setups: tuple[Path, dict[str, Path]], tmp_path: Path) -> None:
    """The build in --site is the one imported; the reference run gets the interpreter's own install (equal logits:
    the stand-in is the same build) and never the build, or says there is none."""
    stand_in, pythons = setups
    for kind, py in pythons.items():
        out = tmp_path / f"{kind}.json"
        p = subprocess.run([str(py), str(ROOT / "tools" / "cuda_import_check.py"), "--site", str(stand_in),
                            "--expect-backend", "CPU", "--json", str(out)], capture_output=True, text=True,
                           env=_env(stand_in), timeout=600)
        assert p.returncode == 0, (kind, p.stdout[-2000:], p.stderr[-2000:])
        res = json.loads(out.read_text())
        assert Path(res["module"]).parent == stand_in / "rapidmoe", (kind, res["module"])
        assert res["backends"]["CPU"] == 1 and res["expect_backend"] == "CPU"
        ref = res["reference"]
        if kind == "none":
            assert "no install of rapidmoe" in ref["skipped"], ref
            assert "comparison skipped: " in p.stdout.splitlines()[-1]
        else:
            assert ref["equal"] is True and ref["max_abs_diff"] == 0.0, (kind, ref)
            assert stand_in not in Path(ref["module"]).resolve().parents, (kind, ref)
            assert "equal to the CPU-only install" in p.stdout.splitlines()[-1]
        if kind == "normal":
            assert py.parent.parent in Path(ref["module"]).parents, ref  # the copy in the venv's site-packages
    # the CUDA check proper (the default) refuses the CPU-only stand-in, naming what is missing
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "cuda_import_check.py"), "--site", str(stand_in)],
                       capture_output=True, text=True, env=_env(stand_in), timeout=300)
    assert p.returncode == 1 and "libggml-cuda.so from" in p.stderr and "is not loaded" in p.stderr, p.stderr[-500:]
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "cuda_import_check.py"), "--site", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "holds no rapidmoe package" in p.stderr


@pytest.mark.native
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["own", "none"])
def test_gpu_check_runs_the_build_in_site(setups: tuple[Path, dict[str, Path]], kind: str, tmp_path: Path) -> None:
    """gpu_check --site imports the build there, also ahead of an editable install's import hook (which PYTHONPATH
    alone does not beat), and records it."""
    stand_in, pythons = setups
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu", "--site", str(stand_in),
                        "--sections", "stock", "--budget-s", "0"], capture_output=True, text=True,
                       env=dict(_env(stand_in), OUT=str(tmp_path), PYTHON=str(pythons[kind])), timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    meta = json.loads((tmp_path / "gpu_check.json").read_text())["meta"]
    assert Path(meta["rapidmoe"]) == stand_in / "rapidmoe"


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU may be present")
def test_fails_fast_without_a_gpu(tmp_path: Path) -> None:
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True,
                       env=dict(os.environ, OUT=str(tmp_path)), timeout=30)
    assert p.returncode == 3 and "no NVIDIA GPU" in p.stderr


@pytest.mark.native
@pytest.mark.slow
def test_cpu_dry_run(tmp_path: Path) -> None:
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu"], capture_output=True, text=True,
                       env=dict(os.environ, OUT=str(tmp_path)), timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    md = (tmp_path / "gpu_check.md").read_text()
    assert "stock Q4_K_M, -ngl 99 -ot exps=CPU" in md and "ours UMIA" in md
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert all(c["rel_gpu_vs_cpu"] == 0.0 for c in res["checks"])  # -ngl 0: the same computation
    assert res["tolerance"] == 0.0 and all(c["ok"] for c in res["checks"])
    assert sum(bool(c.get("yardstick")) for c in res["checks"]) == 1  # stock's GPU-vs-CPU difference sets the tolerance
    status = {s["name"]: s["status"] for s in res["sections"]}
    assert [status[n] for n in ("exactness", "stock", "ours", "cache")] == ["done"] * 4, status
    assert [status[n] for n in ("concurrent", "streaming", "umia-gpu")] == ["done"] * 3, status
    assert res["meta"]["gpu"].startswith("none") and res["meta"]["sizes"] == res["sizes"] and res["meta"]["total_s"] > 0
    assert all(r["decode_tps"] > 0 and r["prefill_tps"] > 0 for r in res["runs"])
    # ours twice per r: overlap off (no begin/join pairs) and forced on (-ngl 0 would not overlap on "auto")
    ours = [r for r in res["runs"] if "overlap" in r]
    assert {r["overlap"] for r in ours} == {"off", "on"}
    assert all((r["overlap_pairs"] > 0) == (r["overlap"] == "on") for r in ours)
    variants = [c["variant"] for c in res["checks"]]
    assert sum("overlap off" in v for v in variants) == sum("overlap on" in v for v in variants) == 4
    # the planner's per-expert cache realized with --gpu-mem's function (on the CPU device in the dry run)
    cache = [r for r in res["runs"] if "per-expert WQ cache" in r["variant"]]
    assert len(cache) == 1 and 0 < cache[0]["cache_hit_rate"] < 1
    assert any("per-expert WQ cache" in c["variant"] for c in res["checks"])
    # the same cache under the runtime's rapidmoe and lru policies: equal logits (checked above), hit rates, copies
    pol = {r["cache_policy"]: r for r in res["runs"] if "cache_policy" in r}
    assert set(pol) == {"rapidmoe", "lru", "moepic", "lru-sync"}
    assert all(0 < pol[p]["cache_hit_rate"] <= 1 for p in ("rapidmoe", "lru", "lru-sync"))
    assert pol["lru"]["cache_copies_per_token"] > 0 and pol["rapidmoe"]["cache_copies_per_token"] >= 0
    # moepic (the dry run's 256-wide Q2_K experts cannot split: every needed expert fetched whole) and the copies'
    # bytes and wait per token of the two GPU-centric policies
    assert all(pol[p]["cache_mb_per_token"] > 0 and pol[p]["cache_wait_ms_per_token"] >= 0
               for p in ("lru", "lru-sync", "moepic"))
    assert sum("policy)" in c["variant"] for c in res["checks"]) == 3
    # concurrent hits/misses/residuals vs serial, prefill streaming on vs off, UMIA calibrated on the device's
    # measured terms vs fixed r: each exact against the CPU path (rel 0 above) and timed
    conc = {r["cache_concurrency"]: r for r in res["runs"] if "cache_concurrency" in r}
    assert set(conc) == {"serial", "concurrent"}
    assert conc["serial"]["overlap_pairs"] == 0 < conc["concurrent"]["overlap_pairs"]
    assert {c["cache_concurrency"] for c in res["checks"] if "cache_concurrency" in c} == {"serial", "concurrent"}
    stream = {r["prefill_streaming"]: r for r in res["runs"] if "prefill_streaming" in r}
    assert set(stream) == {"on", "off"} and stream["off"]["stream_min_batch"] == 0
    assert 0 < stream["on"]["stream_min_batch"] <= 32 and stream["on"]["stream_threshold"] > 0
    umia = [r for r in res["runs"] if "umia" in r]
    assert [r["umia"] for r in umia] == ["gpu-calibrated", "fixed", "fixed"]
    assert umia[0]["device_latency"]["source"] == "measured on CPU" and umia[0]["predicted_decode_ms"] > 0
    assert sum("umia" in c for c in res["checks"]) == 3


@pytest.mark.native
@pytest.mark.slow
def test_sections_and_time_budget(tmp_path: Path) -> None:
    """--sections picks sections (an unknown one is a usage error); sections that would start after --budget-s are
    recorded as skipped, not run; a failed exactness check (here: none ran) would exit 1."""
    run = ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu"]
    env = dict(os.environ, OUT=str(tmp_path))
    p = subprocess.run([*run, "--sections", "exactness,nope"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "unknown section 'nope'" in p.stderr
    p = subprocess.run([*run, "--sections", "stock,umia-gpu", "--budget-s", "0"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {s["name"]: s["status"] for s in res["sections"]}
    assert status["stock"] == status["umia-gpu"] == "skipped (time budget)" and status["ours"] == "not selected"
    assert res["runs"] == [] and res["checks"] == []
