#!/usr/bin/env python3
"""Fetch, verify, extract and patch the pinned llama.cpp (stdlib only: CMake runs it at configure time).

The pin is `upstream.json` beside this file: llama-cpp-python's source distribution on PyPI, whose
`vendor/llama.cpp/` is the llama.cpp we build and whose `llama_cpp/` is the ctypes Python layer we reuse.
Nothing here knows about our C++ or Python code; it only prepares `vendor/`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIN_FILE = HERE / "upstream.json"
PATCH_DIR = HERE / "patches"
STAMP_NAME = ".rapidmoe-stamp.json"


class UpstreamError(RuntimeError):
    """A problem preparing the pinned upstream source; the message says what and what to do."""


def load_pin() -> dict[str, str]:
    return json.loads(PIN_FILE.read_text())


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def patch_files() -> list[Path]:
    """Our patches, in the order they are applied (file names start with a 4-digit number)."""
    return sorted(PATCH_DIR.glob("*.patch"))


def _download(pin: dict[str, str], dest_dir: Path) -> Path:
    """Download the pinned sdist with pip (by package name, from the configured index)."""
    spec = f"{pin['package']}=={pin['version']}"
    with tempfile.TemporaryDirectory(prefix="rapidmoe-dl-", dir=dest_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", pin["package"],
               "--disable-pip-version-check", "-d", tmp, spec]
        print(f"rapidmoe: downloading {spec} (source distribution) with pip", flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / pin["sdist"]
        if proc.returncode != 0 or not got.exists():
            raise UpstreamError(
                f"could not download {spec} with pip (exit {proc.returncode}).\n{proc.stdout[-2000:]}"
                f"{proc.stderr[-2000:]}\nOffline? Put {pin['sdist']} in {dest_dir} or point "
                "RAPIDMOE_UPSTREAM_SDIST at it.")
        final = dest_dir / pin["sdist"]
        os.replace(got, final)
        return final


def ensure_sdist(vendor: Path) -> Path:
    """The verified tarball: reused when present, else taken from RAPIDMOE_UPSTREAM_SDIST or downloaded."""
    pin = load_pin()
    downloads = vendor / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    path = downloads / pin["sdist"]
    if not path.exists():
        given = os.environ.get("RAPIDMOE_UPSTREAM_SDIST")
        if given:
            shutil.copyfile(given, path.with_suffix(".part"))
            os.replace(path.with_suffix(".part"), path)
        else:
            _download(pin, downloads)
    digest = sha256_file(path)
    if digest != pin["sha256"]:
        bad = path.with_name(path.name + ".bad")
        os.replace(path, bad)
        raise UpstreamError(
            f"{pin['sdist']} has sha256 {digest}, but upstream.json pins {pin['sha256']}; "
            f"moved it aside to {bad}. Delete it and re-run the build to download it again.")
    return path


def extract_pristine(sdist: Path, dest: Path) -> None:
    """Extract the sdist's vendor/llama.cpp to dest/llama.cpp and its llama_cpp package to dest/llama_cpp_py."""
    pin = load_pin()
    top = pin["sdist"].removesuffix(".tar.gz")
    wanted = {f"{top}/vendor/llama.cpp/": "llama.cpp/", f"{top}/llama_cpp/": "llama_cpp_py/llama_cpp/"}
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            for src, dst in wanted.items():
                if m.name.startswith(src):
                    rel = m.name[len(src):]
                    parts = rel.split("/")
                    if not rel or ".git" in parts or (dst.startswith("llama_cpp_py") and parts[0] == "server"):
                        break
                    m.name = dst + rel
                    members.append(m)
                    break
        tar.extractall(dest, members=members, filter="data")


def apply_patches(tree: Path, patches: list[Path]) -> None:
    """Apply each patch with GNU patch; a patch that does not apply exactly stops with its name.

    `--fuzz=0`: every context line must match where the hunk says. GNU patch's default fuzz (2) would let a
    hunk whose surroundings changed upstream land somewhere else in a function (build_moe_ffn changes often);
    on a pin bump that must fail here, not produce a graph with a hook in the wrong place.
    """
    if shutil.which("patch") is None:
        raise UpstreamError("the 'patch' program is needed to apply our llama.cpp patches (apt-get install patch)")
    for p in patches:
        cmd = ["patch", "-p1", "--forward", "--batch", "--fuzz=0", "--no-backup-if-mismatch",
               "-d", str(tree), "-i", str(p)]
        dry = subprocess.run([*cmd, "--dry-run"], capture_output=True, text=True)
        if dry.returncode != 0:
            raise UpstreamError(
                f"patch {p.name} no longer applies to llama.cpp {load_pin()['llama_cpp_commit']} "
                f"(llama-cpp-python {load_pin()['version']}):\n{dry.stdout}{dry.stderr}")
        subprocess.run(cmd, check=True, capture_output=True, text=True)


def sync_tree(src: Path, dst: Path) -> None:
    """Make dst a copy of src, rewriting only files whose bytes differ (keeps mtimes: no needless rebuilds)."""
    if not dst.exists():
        os.replace(src, dst)
        return
    stale = {p.relative_to(dst) for p in dst.rglob("*") if p.is_file()}
    for s in src.rglob("*"):
        if not s.is_file():
            continue
        rel = s.relative_to(src)
        d = dst / rel
        stale.discard(rel)
        if d.is_file() and d.stat().st_size == s.stat().st_size and d.read_bytes() == s.read_bytes():
            continue
        d.parent.mkdir(parents=True, exist_ok=True)
        os.replace(s, d)
    for rel in stale:
        (dst / rel).unlink()


def wanted_stamp(sdist_sha: str) -> dict[str, object]:
    return {"sdist_sha256": sdist_sha,
            "patches": [[p.name, sha256_file(p)] for p in patch_files()]}


def prepare(vendor: Path) -> Path:
    """Make vendor/llama.cpp the pinned, patched tree; a no-op when it already is. Returns the tree."""
    pin = load_pin()
    tree = vendor / "llama.cpp"
    stamp_path = tree / STAMP_NAME
    want = wanted_stamp(pin["sha256"])
    if stamp_path.exists() and json.loads(stamp_path.read_text()) == want:
        return tree
    sdist = ensure_sdist(vendor)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=vendor))
    try:
        extract_pristine(sdist, staging)
        apply_patches(staging / "llama.cpp", patch_files())
        (staging / "llama.cpp" / STAMP_NAME).write_text(json.dumps(want, indent=1))
        for name in ("llama.cpp", "llama_cpp_py"):
            sync_tree(staging / name, vendor / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"rapidmoe: prepared llama.cpp {pin['llama_cpp_commit']} with {len(want['patches'])} patch(es)",
          flush=True)
    return tree


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vendor", type=Path, default=HERE.parent.parent / "vendor",
                    help="where vendor/llama.cpp and vendor/llama_cpp_py go (default: the repo's vendor/)")
    ap.add_argument("--pristine", type=Path, default=None,
                    help="only extract an UNPATCHED copy into this folder (for stock reference builds)")
    args = ap.parse_args(argv)
    try:
        if args.pristine is not None:
            sdist = ensure_sdist(args.vendor)
            if not (args.pristine / "llama.cpp" / "CMakeLists.txt").exists():
                args.pristine.mkdir(parents=True, exist_ok=True)
                extract_pristine(sdist, args.pristine)
        else:
            prepare(args.vendor)
    except UpstreamError as e:
        print(f"rapidmoe: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
