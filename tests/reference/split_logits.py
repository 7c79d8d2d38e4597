"""What the split-routing tests compare: a prompt's tokens, every position's logits from `rapidmoe.Llama`, and the
relative error between two logit arrays (shared by tests/engine/test_split_routing.py and test_refine_split.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from testkit import TEXT

from rapidmoe import Llama


def prompt_tokens(path: Path) -> list[int]:
    llm = Llama(path, n_ctx=128, vocab_only=True, verbose=False)
    toks = llm.tokenize(TEXT, add_bos=False)[:24]
    llm.close()
    return toks


def all_logits(path: Path, toks: list[int], **kw: Any) -> np.ndarray:
    llm = Llama(path, n_ctx=128, logits_all=True, verbose=False, n_threads=2, **kw)
    llm.eval(toks)
    out = np.array(llm.scores[: len(toks)], dtype=np.float64)
    llm.close()
    return out


def rel_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
