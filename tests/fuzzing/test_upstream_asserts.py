"""The lists of llama.cpp asserts that rapidmoe.modelfile refuses a file for ahead of llama.cpp, against the pinned
sources: a llama.cpp upgrade that adds or drops one fails here, not as an abort in a user's process."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from rapidmoe.modelfile import ROPE_WHOLE_HEAD_ARCHS

SRC = Path(__file__).resolve().parents[2] / "vendor" / "llama.cpp" / "src"


def whole_head_archs(src: Path) -> set[str]:
    """Architecture names whose graph constructor asserts `n_embd_head == n_rot` (not in a comment)."""
    arch_class: dict[str, str] = {}
    pending: list[str] = []
    for line in (src / "llama-model.cpp").read_text().splitlines():  # the factory: case LLM_ARCH_X: return new C
        case = re.match(r"\s*case (LLM_ARCH_\w+):", line)
        made = re.match(r"\s*return new (llama_model_\w+)\(params\);", line)
        if case:
            pending.append(case.group(1))
        elif made:
            arch_class.update(dict.fromkeys(pending, made.group(1)))
            pending = []
        elif line.strip() and not line.strip().startswith("//"):
            pending = []
    names = dict(re.findall(r"\{\s*(LLM_ARCH_\w+),\s*\"([^\"]+)\"\s*\}", (src / "llama-arch.cpp").read_text()))
    asserting = set()
    for f in (src / "models").glob("*.cpp"):
        text = f.read_text()
        starts = [(m.start(), m.group(1)) for m in re.finditer(r"(llama_model_\w+)::graph(?:<\w+>)?::graph\(", text)]
        for i, (pos, cls) in enumerate(starts):
            body = text[pos:starts[i + 1][0] if i + 1 < len(starts) else len(text)]
            if re.search(r"^\s*GGML_ASSERT\(n_embd_head == (hparams\.)?n_rot(\(\))?\);", body, re.M):
                asserting.add(cls)
    return {names[e] for e, cls in arch_class.items() if cls in asserting and e in names}


def test_whole_head_archs_match_the_pinned_sources() -> None:
    if not (SRC / "models").is_dir():
        pytest.skip("vendor/llama.cpp not prepared (the build fetches it)")
    found = whole_head_archs(SRC)
    assert {"qwen3moe", "qwen2moe", "llama", "olmoe"} <= found  # the parser still reads the sources
    assert "deepseek2" not in found  # MLA: its rope covers part of each head
    assert found == ROPE_WHOLE_HEAD_ARCHS, (sorted(found - ROPE_WHOLE_HEAD_ARCHS),
                                            sorted(ROPE_WHOLE_HEAD_ARCHS - found))
