"""The pinned upstream: tarball verification, deterministic patching, and a patch set that still applies."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from testkit import PINNED_SDIST as SDIST
from testkit import ROOT
from testkit import fetch_upstream as fetch

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
    with pytest.raises(fetch.UpstreamError, match=r"9999-does-not-apply\.patch no longer applies"):
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


@needs_sdist
def test_fuzzy_hunk_is_refused(tmp_path: Path) -> None:
    """A hunk whose context no longer matches exactly must not apply (GNU patch's default fuzz would take it)."""
    fetch.extract_pristine(SDIST, tmp_path)
    tree = tmp_path / "llama.cpp"
    # patch 0001's first hunk with its outermost context line altered, as an upstream edit near the hook would
    hunk = ("--- a/src/llama-graph.cpp\n+++ b/src/llama-graph.cpp\n@@ -16,6 +16,7 @@\n"
            ' #include "llama-memory-hybrid-iswa.h"\n #include "llama-memory-recurrent.h"\n \n'
            '+#include "rapidmoe-graph.h"\n #include <cassert>\n #include <cmath>\n #include <not-upstream>\n')
    fuzzy = tmp_path / "9998-fuzzy.patch"
    fuzzy.write_text(hunk)
    probe = subprocess.run(["patch", "-p1", "--dry-run", "--batch", "-d", str(tree), "-i", str(fuzzy)],
                           capture_output=True, text=True)
    assert probe.returncode == 0 and "fuzz" in probe.stdout, probe.stdout  # default fuzz takes it...
    with pytest.raises(fetch.UpstreamError, match=r"9998-fuzzy\.patch no longer applies"):
        fetch.apply_patches(tree, [fuzzy])  # ...ours refuses it
    assert "rapidmoe" not in (tree / "src" / "llama-graph.cpp").read_text()


PATCHED_GRAPH = ROOT / "vendor" / "llama.cpp" / "src" / "llama-graph.cpp"
needs_patched = pytest.mark.skipif(not (ROOT / "vendor" / "llama.cpp" / fetch.STAMP_NAME).exists(),
                                   reason="the build has not prepared vendor/llama.cpp")

# Each patch-0001 hook and the upstream statements right around it (comments and blank lines skipped), in the
# order they must appear in build_moe_ffn. A pin bump that moves upstream code around a hook fails here, and
# whoever bumps it decides where the hook belongs now.
HOOKS: list[tuple[str, str, str]] = [
    # routing is final (selected experts and weights built) and nothing has multiplied an expert yet
    ("const rapidmoe_moe_split rm = rapidmoe_moe_begin(*this, cur, selected_experts, weights, up_exps, "
     "gate_exps, down_exps, il);",
     "ggml_tensor * experts = nullptr;",
     "if (gate_up_exps) {"),
    # the merged layout's one WQ matmul, before its bias and the views that split it into gate and up
    ("gate_up = rapidmoe_moe_gate_up_merged(rm, gate_up);",
     "ggml_tensor * gate_up = build_lora_mm_id(gate_up_exps, cur, selected_experts, up_exps_s);",
     'cb(gate_up, "ffn_moe_gate_up", il);'),
    # both gate and up exist (up is computed first in the separate path), before the gate's name and activation
    ("rapidmoe_moe_gate_up(rm, cur, up);",
     "cur = build_lora_mm_id(gate_exps, cur, selected_experts, gate_exps_s);",
     'cb(cur, "ffn_moe_gate", il);'),
    # the down projection's WQ result, before anything scales, names or sums it
    ("experts = rapidmoe_moe_down(rm, experts, cur);",
     "experts = build_lora_mm_id(down_exps, cur, selected_experts, down_exps_s);",
     "if (arch == LLM_ARCH_MISTRAL4) {"),
]


def _code_lines(text: str) -> list[str]:
    """Statements of C++ source one per line, without trailing comments, blank lines or comment lines."""
    out = []
    for line in text.splitlines():
        code = line.split("//", 1)[0].strip()
        if code:
            out.append(code)
    return out


def _moe_ffn_body(source: str) -> list[str]:
    """The code lines of the full build_moe_ffn definition (the overload that takes the gate/up/down tensors)."""
    lines = _code_lines(source)
    heads = [i for i, line in enumerate(lines) if line.startswith("ggml_tensor * llm_graph_context::build_moe_ffn(")]
    # the full definition is the one that calls rapidmoe_moe_begin; the other overload forwards to it
    for start in heads:
        depth, opened = 0, False
        for end in range(start, len(lines)):
            depth += lines[end].count("{") - lines[end].count("}")
            opened = opened or "{" in lines[end]
            if opened and depth == 0:
                break
        body = lines[start:end + 1]
        if any("rapidmoe_moe_begin" in line for line in body):
            return body
    raise AssertionError("no build_moe_ffn definition calls rapidmoe_moe_begin")


def _check_hooks(source: str) -> None:
    """Assert every hook sits between its two upstream statements, in order, and nothing else calls rapidmoe."""
    body = _moe_ffn_body(source)
    positions = []
    for hook, before, after in HOOKS:
        at = [i for i, line in enumerate(body) if line == hook]
        assert len(at) == 1, f"hook {hook!r} appears {len(at)} times in build_moe_ffn (want once)"
        i = at[0]
        assert body[i - 1] == before, f"{hook!r} must follow {before!r}, follows {body[i - 1]!r}"
        assert body[i + 1] == after, f"{hook!r} must precede {after!r}, precedes {body[i + 1]!r}"
        positions.append(i)
    assert positions == sorted(positions), "the hooks are out of order (begin, merged gate_up, gate/up, down)"
    # begin comes after routing is final, and up exists before the gate/up hook in the separate path
    assert body.index("ggml_build_forward_expand(gf, weights);") < positions[0]
    ups = [i for i, line in enumerate(body) if line.startswith("up = build_lora_mm_id(up_exps, cur,")]
    assert len(ups) == 1 and positions[1] < ups[0] < positions[2]
    # every rapidmoe call in the file is one of the hooks above
    calls = [line for line in _code_lines(source) if "rapidmoe_" in line and not line.startswith("#include")]
    assert calls == [h for h, _, _ in HOOKS], calls


@needs_patched
def test_hooks_sit_where_they_belong_in_build_moe_ffn() -> None:
    _check_hooks(PATCHED_GRAPH.read_text())


@needs_patched
def test_a_moved_hook_is_caught() -> None:
    """The check fails for the patched source with one hook moved a statement later (what fuzz could do)."""
    source = PATCHED_GRAPH.read_text()
    lines = source.splitlines(keepends=True)
    for hook, _, after in HOOKS:
        i = next(k for k, line in enumerate(lines) if line.strip().startswith(hook))
        j = next(k for k in range(i + 1, len(lines)) if lines[k].strip().startswith(after))
        moved = lines[:i] + lines[i + 1:j + 1] + [lines[i]] + lines[j + 1:]
        with pytest.raises(AssertionError, match="must"):
            _check_hooks("".join(moved))
