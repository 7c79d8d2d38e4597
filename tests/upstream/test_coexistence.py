"""RapidMoE and llama-cpp-python in one environment, installed in either order: neither overwrites a file of the
other (every file each distribution's RECORD lists still has its recorded hash), rapidmoe runs on its private ctypes
layer (`rapidmoe._llama_cpp`) and libllama, and `import llama_cpp` is llama-cpp-python's.

llama-cpp-python is built from the pinned sdist in vendor/downloads with its native build switched off
(CMAKE_ARGS=-DLLAMA_BUILD=OFF): the same Python files, no compile. Our wheel is packed from this installation (the
installed files, plus the package sources for an editable install): no rebuild either. Each order gets a fresh venv
whose dependencies (numpy, typer, ...) come from this interpreter's site-packages through a .pth path entry."""
from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata as md
import importlib.util
import io
import json
import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from testkit import PIN, ROOT
from testkit import PINNED_SDIST as SDIST

# native: the wheel it packs is the installed build (rapidmoe._core, libllama)
pytestmark = [pytest.mark.slow, pytest.mark.native,
              pytest.mark.skipif(not SDIST.exists(), reason="the build has not downloaded the pinned sdist")]


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _pack_our_wheel(out: Path, extra: dict[str, bytes] | None = None) -> Path:
    """A wheel of the installed rapidmoe: its installed files (native libraries, the private ctypes layer, data) and,
    for an editable install, the Python sources it redirects to (plus `extra` files, for the negative control)."""
    dist = md.distribution("rapidmoe")
    base = Path(str(dist.locate_file("")))
    files: dict[str, bytes] = {}
    for f in dist.files or []:
        name = str(f)
        if name.startswith("..") or "__pycache__" in name or name.startswith("_editable_") or ".dist-info/" in name:
            continue
        files[name] = (base / name).read_bytes()
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable"):
        src = ROOT / "python" / "rapidmoe"
        for p in src.rglob("*"):
            if p.is_file() and "__pycache__" not in p.parts:
                files["rapidmoe/" + p.relative_to(src).as_posix()] = p.read_bytes()
    assert any(n.startswith("rapidmoe/_core") for n in files), "the installed rapidmoe has no native module"
    files.update(extra or {})
    info = f"rapidmoe-{dist.version}.dist-info"
    files[f"{info}/METADATA"] = (dist.read_text("METADATA") or "").encode()
    files[f"{info}/WHEEL"] = (dist.read_text("WHEEL") or "").encode()
    files[f"{info}/entry_points.txt"] = (dist.read_text("entry_points.txt") or "").encode()
    tag = next(line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
               if line.startswith("Tag:"))
    path = out / f"rapidmoe-{dist.version}-{tag}.whl"
    record = io.StringIO()
    w = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in sorted(files.items()):
            z.writestr(name, data)
            w.writerow([name, _record_hash(data), len(data)])
        w.writerow([f"{info}/RECORD", "", ""])
        z.writestr(f"{info}/RECORD", record.getvalue())
    return path


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("wheels")
    ours = _pack_our_wheel(out)
    env = dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF")
    # where the build backend is installed, build without fetching the build requirements
    iso = ["--no-build-isolation"] if importlib.util.find_spec("scikit_build_core") is not None else []
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *iso, "-q", "-w", str(out), str(SDIST)],
                   env=env, check=True, capture_output=True, timeout=600)
    theirs = next(out.glob("llama_cpp_python-*.whl"))
    return ours, theirs


CHECK = r"""
import base64, hashlib, importlib.metadata as md, json, os, sys
from pathlib import Path

def intact(name):
    dist = md.distribution(name)
    bad = []
    for f in dist.files:
        if f.hash is None or str(f).startswith(".."):
            continue
        p = Path(str(dist.locate_file(f)))
        got = (base64.urlsafe_b64encode(hashlib.sha256(p.read_bytes()).digest()).rstrip(b"=").decode()
               if p.exists() else None)
        if got != f.hash.value:
            bad.append(str(f))
    return len(dist.files), bad

out = {"rapidmoe": intact("rapidmoe"), "llama_cpp_python": intact("llama_cpp_python")}
import rapidmoe
from rapidmoe import Llama, llama_cpp as ours
llm = Llama(sys.argv[1], n_ctx=64, n_threads=2, verbose=False)
text = llm.create_completion("Hello", max_tokens=4, temperature=0.0)["choices"][0]["text"]
llm.close()
out["ours"] = [ours.__name__, ours.__file__, bool(text)]
os.environ["LLAMA_CPP_LIB_PATH"] = str(Path(ours.__file__).parent / "lib")  # theirs has no libllama of its own
import llama_cpp
out["theirs"] = [llama_cpp.__name__, llama_cpp.__file__, llama_cpp.__version__]
print(json.dumps(out))
"""


ALONE_OURS = r"""
import sys
from rapidmoe import Llama
llm = Llama(sys.argv[1], n_ctx=64, n_threads=2, verbose=False)
assert llm.create_completion("Hello", max_tokens=2, temperature=0.0)["choices"][0]["text"] is not None
llm.close()
"""
ALONE_THEIRS = r"""
import importlib.util
spec = importlib.util.find_spec("llama_cpp")
assert spec is not None and spec.origin is not None and "rapidmoe" not in spec.origin, spec
"""


def _install_and_check(first: Path, second: Path, model: Path, tmp_path: Path) -> dict[str, list[object]]:
    theirs_whl = first if first.name.startswith("llama_cpp_python") else second
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip())
    pip = [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q"]
    for whl in (first, second):
        subprocess.run([*pip, str(whl)], check=True, capture_output=True, timeout=300)
    # dependencies from this interpreter, after the installs (pip must not see this interpreter's own rapidmoe) and
    # after the venv's own packages on sys.path (a path entry: this interpreter's .pth files are not run)
    (purelib / "zz_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LLAMA_CPP_LIB_PATH")}
    res = subprocess.run([str(py), "-c", CHECK, str(model)], capture_output=True, text=True, timeout=300,
                         env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    got: dict[str, list[object]] = json.loads(res.stdout.strip().splitlines()[-1])
    got["purelib"] = [str(purelib)]
    # and either one uninstalled leaves the other whole
    for gone, left_check in (("llama_cpp_python", ALONE_OURS), ("rapidmoe", ALONE_THEIRS)):
        subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "uninstall", "-y", "-q", gone],
                       check=True, capture_output=True, timeout=300)
        res = subprocess.run([str(py), "-c", left_check, str(model)], capture_output=True, text=True, timeout=300,
                             env=env, cwd=tmp_path)
        got[f"without {gone}"] = [res.returncode == 0 and not (purelib / gone.replace("_python", "")).exists(),
                                  res.stderr[-1500:]]
        if gone == "llama_cpp_python":
            subprocess.run([*pip, str(theirs_whl)], check=True, capture_output=True, timeout=300)
    return got


@pytest.mark.parametrize("order", ["rapidmoe-first", "llama-cpp-python-first"])
def test_both_install_orders(order: str, wheels: tuple[Path, Path], tiny_qwen: Path, tmp_path: Path) -> None:
    ours, theirs = wheels
    first, second = (ours, theirs) if order == "rapidmoe-first" else (theirs, ours)
    got = _install_and_check(first, second, tiny_qwen, tmp_path)
    purelib = Path(str(got["purelib"][0]))
    for dist in ("rapidmoe", "llama_cpp_python"):
        n, bad = got[dist]
        assert isinstance(n, int) and n > 10 and not bad, f"{order}: files of {dist} were overwritten: {bad}"
    name, path, generated = got["ours"]
    assert name == "rapidmoe._llama_cpp" and Path(str(path)).is_relative_to(purelib / "rapidmoe") and generated
    name, path, version = got["theirs"]
    assert name == "llama_cpp" and Path(str(path)).is_relative_to(purelib / "llama_cpp") and version == PIN["version"]
    for gone in ("llama_cpp_python", "rapidmoe"):
        ok, err = got[f"without {gone}"]
        assert ok, f"{order}: uninstalling {gone} broke the other: {err}"


def test_the_check_sees_a_clash(wheels: tuple[Path, Path], tiny_qwen: Path, tmp_path: Path) -> None:
    """Negative control: a rapidmoe wheel that also ships a top-level `llama_cpp` (as versions before the private
    layer did) and llama-cpp-python installed after it: the check reports rapidmoe's overwritten files."""
    _, theirs = wheels
    ctypes_layer = Path(md.distribution("rapidmoe").locate_file("rapidmoe/_llama_cpp"))  # type: ignore[arg-type]
    extra = {f"llama_cpp/{p.relative_to(ctypes_layer).as_posix()}": p.read_bytes()
             for p in ctypes_layer.glob("*.py")}
    old = _pack_our_wheel(tmp_path, extra)
    got = _install_and_check(old, theirs, tiny_qwen, tmp_path)
    _, bad = got["rapidmoe"]
    assert any(str(b).startswith("llama_cpp/") for b in bad), got["rapidmoe"]  # type: ignore[attr-defined]
