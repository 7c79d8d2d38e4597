"""Fixtures shared by the conversion tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from rapidmoe.synthetic import spec_for, write_model


@pytest.fixture(scope="module")
def micro(model_dir: Path, vocab_dir: Path) -> Path:
    """One layer, 4 experts of 256x256 (qwen3moe, gpt-2 vocabulary): small enough to convert many times."""
    path = model_dir / "micro-qwen3moe.gguf"
    if not path.exists():
        write_model(spec_for("qwen3moe", "tiny", n_layer=1, n_expert=4, n_expert_used=2, vocab="gpt-2"), path,
                    vocab_dir)
    return path
