"""What the split-routing tests compare: a prompt's tokens, every position's logits from `rapidmoe.Llama`, and the
relative error between two logit arrays (shared by tests/engine/test_split_routing.py and test_refine_split.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from testkit import ROOT, TEXT

from rapidmoe import Llama

# every position's logits of a token list from stock llama.cpp (run with llama-cpp-python over the stock build:
# argv model, JSON tokens, .npy out), the same n_ctx and threads as all_logits
STOCK_LOGITS = """
import json, sys, numpy as np, llama_cpp
m = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=128, logits_all=True, n_threads=2, verbose=False)
toks = json.loads(sys.argv[2])
m.eval(toks)
np.save(sys.argv[3], np.array(m.scores[:len(toks)], dtype=np.float64))
"""

# our kernels that sum in another order than stock's (or repack what stock keeps plain), off: bit-for-bit with stock
STOCK_ORDER_ENV = {"RAPIDMOE_REPACK_MMID_GEMM": "0", "RAPIDMOE_Q2_K_REPACK": "0", "RAPIDMOE_GEMM": "0",
                   "RAPIDMOE_Q8_0_REPACK": "0", "RAPIDMOE_Q6_K_REPACK": "0", "RAPIDMOE_Q3_K_REPACK": "0"}


def stock_logits(model: Path, toks: list[int], stock_bin: Path, tmp_path: Path) -> np.ndarray:
    """STOCK_LOGITS run by llama-cpp-python over the stock build, in a child process: every position's logits."""
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(stock_bin), PYTHONPATH=str(ROOT / "vendor" / "llama_cpp_py"))
    out = tmp_path / "stock-logits.npy"
    subprocess.run([sys.executable, "-c", STOCK_LOGITS, str(model), json.dumps(toks), str(out)],
                   env=env, check=True, capture_output=True, cwd=ROOT / "vendor")
    return np.load(out)


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
