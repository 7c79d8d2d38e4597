"""Patch 0015: the CPU backend's buffers ask Linux for transparent huge pages (madvise MADV_HUGEPAGE).

Each case runs in a fresh interpreter: glibc reuses freed memory, so a buffer allocated after another one could sit
in memory the first one advised.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

pytestmark = [pytest.mark.native,  # the build's _core, imported in the subprocesses
              pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists(),
                                 reason="transparent huge pages are a Linux kernel feature, absent here")]


def vm_flags(nbytes: int, repack: bool = False, switch: str | None = None) -> set[str]:
    """The VmFlags of a fresh CPU backend buffer's memory, in a new process."""
    env = dict(os.environ)
    env.pop("RAPIDMOE_HUGE_PAGES", None)
    if switch is not None:
        env["RAPIDMOE_HUGE_PAGES"] = switch
    code = ("from rapidmoe import _core; "
            f"print(_core.cpu_buffer_vm_flags({nbytes}, repack={repack}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    flags = set(out.stdout.split())
    assert "rd" in flags and "wr" in flags, f"no mapping found for the buffer: {out.stdout!r}"
    return flags


@pytest.mark.parametrize("repack", [False, True], ids=["cpu", "cpu-repack"])
def test_large_buffer_is_advised(repack: bool) -> None:
    assert "hg" in vm_flags(64 << 20, repack=repack)


def test_switch_off_leaves_upstream_pages() -> None:
    assert "hg" not in vm_flags(64 << 20, switch="0")


def test_small_buffer_is_not_advised() -> None:
    # under 2 MiB no aligned huge page fits: the advice would only split the mapping
    assert "hg" not in vm_flags(1 << 20)
