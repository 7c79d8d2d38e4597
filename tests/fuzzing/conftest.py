"""The fuzz tests' bases: the default model's twin (tiny_qwen: same spec, same bytes), its cpu-fast conversion and
the reader seeds, made once per session (tools/fuzz/targets.py prepare_bases)."""
from __future__ import annotations

from pathlib import Path

import pytest
from fuzz.targets import Bases, prepare_bases


@pytest.fixture(scope="session")
def fuzz_bases(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Bases:
    return prepare_bases(tmp_path_factory.mktemp("fuzz-bases"), model=tiny_qwen)
