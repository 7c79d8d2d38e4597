"""The pinned upstream: tarball verification, deterministic patching, and a patch set that still applies."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("fetch_upstream", ROOT / "src/rapidmoe_ggml/fetch_upstream.py")
assert spec is not None and spec.loader is not None
fetch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fetch)

SDIST = ROOT / "vendor" / "downloads" / fetch.load_pin()["sdist"]
needs_sdist = pytest.mark.skipif(not SDIST.exists(), reason="the build has not downloaded the pinned sdist")


def test_pin_is_complete() -> None:
    pin = fetch.load_pin()
    assert pin["package"] == "llama-cpp-python"
    assert len(pin["sha256"]) == 64 and int(pin["sha256"], 16) >= 0
    assert pin["sdist"] == f"llama_cpp_python-{pin['version']}.tar.gz"


def test_patches_are_numbered_and_explained() -> None:
    patches = fetch.patch_files()
    assert patches, "the patch set is empty"
    for p in patches:
        assert p.name[:4].isdigit() and p.name[4] == "-", p.name
        head = p.read_text().split("\n---", 1)[0]
        assert "What:" in head and "Why:" in head, f"{p.name} lacks a What:/Why: header"


@needs_sdist
def test_patch_set_applies_to_fresh_pin(tmp_path: Path) -> None:
    fetch.extract_pristine(SDIST, tmp_path)
    fetch.apply_patches(tmp_path / "llama.cpp", fetch.patch_files())
    # every line a patch adds is now in the file it patches
    for p in fetch.patch_files():
        target = None
        for line in p.read_text().splitlines():
            if line.startswith("+++ b/"):
                target = (tmp_path / "llama.cpp" / line[6:]).read_text()
            elif line.startswith("+") and line[1:].strip() and target is not None:
                assert line[1:] in target, f"{p.name}: {line[1:]!r} missing after applying"


@needs_sdist
def test_broken_patch_is_named(tmp_path: Path) -> None:
    fetch.extract_pristine(SDIST, tmp_path)
    bad = tmp_path / "9999-does-not-apply.patch"
    bad.write_text("--- a/src/llama.cpp\n+++ b/src/llama.cpp\n@@ -1,1 +1,1 @@\n-no such line here\n+x\n")
    with pytest.raises(fetch.UpstreamError, match="9999-does-not-apply.patch no longer applies"):
        fetch.apply_patches(tmp_path / "llama.cpp", [bad])


def test_wrong_hash_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "fake.tar.gz"
    fake.write_bytes(b"not the pinned tarball")
    monkeypatch.setenv("RAPIDMOE_UPSTREAM_SDIST", str(fake))
    with pytest.raises(fetch.UpstreamError, match="sha256"):
        fetch.ensure_sdist(tmp_path / "vendor")
    # the bad file is moved aside, never left under the pinned name
    assert not (tmp_path / "vendor" / "downloads" / fetch.load_pin()["sdist"]).exists()


@needs_sdist
def test_prepare_is_idempotent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vendor = tmp_path / "vendor"
    (vendor / "downloads").mkdir(parents=True)
    shutil.copyfile(SDIST, vendor / "downloads" / SDIST.name)
    tree = fetch.prepare(vendor)
    stamp = tree / fetch.STAMP_NAME
    assert json.loads(stamp.read_text())["patches"][0][0] == fetch.patch_files()[0].name
    before = stamp.stat().st_mtime_ns
    marker = tree / "untouched"
    marker.write_text("x")
    fetch.prepare(vendor)  # no re-extract, no re-patch
    assert marker.exists() and stamp.stat().st_mtime_ns == before
