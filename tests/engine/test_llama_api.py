"""rapidmoe.Llama on the tiny synthetic models: loads, generates, matches stock llama.cpp and a numpy reference."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import rapidmoe._llama_cpp._logger as lg
from reference.numpy_forward import forward
from testkit import ROOT

from rapidmoe import Llama, ModelFileError, RapidMoEError, llama_cpp

PROMPT = "The quick brown fox"
N_GEN = 24


def greedy_tokens(llm: Llama, prompt: str, n: int) -> list[int]:
    toks = llm.tokenize(prompt.encode(), add_bos=True)
    out = []
    for tok in llm.generate(toks, temp=0.0, top_k=1, repeat_penalty=1.0):
        out.append(tok)
        if len(out) == n:
            break
    return out


STOCK_SCRIPT = """
import json, sys, llama_cpp
m = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_threads=2, verbose=False)
toks = m.tokenize(sys.argv[2].encode(), add_bos=True)
out = []
for t in m.generate(toks, temp=0.0, top_k=1, repeat_penalty=1.0):
    out.append(t)
    if len(out) == int(sys.argv[3]):
        break
print(json.dumps({"lib": str(llama_cpp.llama_cpp._lib._name), "tokens": out}))
"""


@pytest.mark.stock
def test_greedy_tokens_match_stock_llama_cpp(tiny_model: Path, stock_bin: Path) -> None:
    """Same file, same greedy tokens: our patched build vs llama-cpp-python's Llama over STOCK libllama."""
    llm = Llama(tiny_model, n_ctx=256, n_threads=2, verbose=False)
    ours = greedy_tokens(llm, PROMPT, N_GEN)
    llm.close()
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(stock_bin), PYTHONPATH=str(ROOT / "vendor" / "llama_cpp_py"))
    res = subprocess.run([sys.executable, "-c", STOCK_SCRIPT, str(tiny_model), PROMPT, str(N_GEN)], env=env,
                         capture_output=True, text=True, check=True, cwd=ROOT / "vendor")
    stock = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(stock["lib"]).resolve().parent == stock_bin.resolve()  # really the stock library
    assert len(ours) == N_GEN
    assert ours == stock["tokens"]


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_logits_match_numpy_reference(make_tiny, arch: str) -> None:  # type: ignore[no-untyped-def]
    path = make_tiny(arch, "f32")
    llm = Llama(path, n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    toks = llm.tokenize(b"Hello world, this is a test of the mixture of experts", add_bos=True)[:16]
    llm.eval(toks)
    ours = np.asarray(llm.scores[: len(toks)], dtype=np.float64)
    llm.close()
    ref = forward(path, toks).astype(np.float64)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err < 2e-3, f"max |llama.cpp - numpy| / max |numpy| = {err:.2e}"
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_completion_chat_and_streaming_api(tiny_qwen: Path) -> None:
    llm = Llama(tiny_qwen, n_ctx=256, n_threads=2, verbose=False, seed=1)
    full: Any = llm.create_completion(PROMPT, max_tokens=8, temperature=0.0)  # not streamed: one dict
    assert full["object"] == "text_completion" and full["usage"]["completion_tokens"] == 8
    chunks: Any = llm.create_completion(PROMPT, max_tokens=8, temperature=0.0, stream=True)
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert streamed == full["choices"][0]["text"]
    again: Any = llm(PROMPT, max_tokens=8, temperature=0.0)  # __call__
    assert again["choices"][0]["text"] == full["choices"][0]["text"]
    chat: Any = llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0)
    assert chat["choices"][0]["message"]["role"] == "assistant"
    text = "Mixture of experts"
    assert llm.detokenize(llm.tokenize(text.encode(), add_bos=False)).decode() == text
    t = llm.timings()
    assert t.decode_tokens > 0 and t.decode_tps > 0
    llm.close()


def _capture_llama_log(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def cb(level: int, text: bytes, user: ctypes.c_void_p) -> None:
        lines.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(cb, ctypes.c_void_p(0))
    monkeypatch.setattr(lg, "_test_cb", cb, raising=False)  # keep the callback alive for the test
    return lines


def test_override_tensor_and_n_cpu_moe_reach_llama_cpp(tiny_qwen: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = _capture_llama_log(monkeypatch)
    try:
        llm = Llama(tiny_qwen, n_ctx=64, n_cpu_moe=1, override_tensor=r"blk\.1\.ffn_down_exps=CPU", verbose=True)
        llm.close()
    finally:
        llama_cpp.llama_log_set(lg.llama_log_callback, ctypes.c_void_p(0))
    overridden = [ln for ln in lines if "buffer type overridden" in ln]
    names = sorted(ln.split()[1] for ln in overridden)
    assert names == ["blk.0.ffn_down_exps.weight", "blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight",
                     "blk.1.ffn_down_exps.weight"]


def test_placement_knobs_do_not_change_results(tiny_qwen: Path) -> None:
    a = Llama(tiny_qwen, n_ctx=128, n_threads=2, verbose=False)
    b = Llama(tiny_qwen, n_ctx=128, n_threads=2, verbose=False, n_cpu_moe=2, override_tensor=["exps=CPU"])
    assert greedy_tokens(a, PROMPT, 8) == greedy_tokens(b, PROMPT, 8)
    a.close()
    b.close()


def test_bad_placement_arguments(tiny_qwen: Path) -> None:
    with pytest.raises(RapidMoEError, match=r"unknown buffer type 'NOPE'.*available: .*CPU"):
        Llama(tiny_qwen, override_tensor="exps=NOPE", verbose=False)
    with pytest.raises(RapidMoEError, match="expected <tensor name pattern>=<buffer type>"):
        Llama(tiny_qwen, override_tensor="exps", verbose=False)
    with pytest.raises(RapidMoEError, match="n_cpu_moe must be >= 0"):
        Llama(tiny_qwen, n_cpu_moe=-1, verbose=False)


def test_repack_off_keeps_the_plain_layout(make_split, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    _, wq, _ = make_split("qwen3moe")  # Q2_K experts: llama.cpp repacks them for its AVX kernels by default
    buffers = {}
    for repack in (True, False):
        lines = _capture_llama_log(monkeypatch)
        try:
            Llama(wq, n_ctx=64, verbose=True, repack=repack).close()
        finally:
            llama_cpp.llama_log_set(lg.llama_log_callback, ctypes.c_void_p(0))
        buffers[repack] = [ln for ln in lines if "model buffer size" in ln]
    assert any("CPU_REPACK" in ln for ln in buffers[True]), buffers
    assert buffers[False] and not any("CPU_REPACK" in ln for ln in buffers[False]), buffers


def test_unknown_keyword_arguments_are_refused(tiny_qwen: Path) -> None:
    # llama_cpp.Llama drops unknown keywords silently: a misspelt option would run with its default
    with pytest.raises(TypeError, match=r"unexpected keyword argument.*n_ctxx, use_extra_bufts"):
        Llama(tiny_qwen, n_ctxx=64, use_extra_bufts=False, verbose=False)


def test_bad_model_files(tmp_path: Path, tiny_qwen: Path) -> None:
    with pytest.raises(ModelFileError, match="not found"):
        Llama(tmp_path / "missing.gguf", verbose=False)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04 definitely not gguf")
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        Llama(junk, verbose=False)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_qwen.read_bytes()[: tiny_qwen.stat().st_size // 2])
    with pytest.raises(ModelFileError, match="truncated"):
        Llama(cut, verbose=False)


def test_flash_attn_modes_reach_the_context(tiny_qwen: Path) -> None:
    """flash_attn takes llama_cpp.Llama's bool (default False) and llama.cpp's -fa values: the context gets that type
    (llama_cpp.Llama writes its own bool's type into the params before making the context: ours must win), "auto"
    runs flash attention on the CPU (the logits of "on", which differ from "off"'s), and the logits agree with the
    numpy reference either way; anything else is refused before the load."""
    toks = [1, 5, 9, 200, 17, 3, 88, 41]
    ref = forward(str(tiny_qwen), toks)
    logits = {}
    modes: list[tuple[bool | str, int]] = [
        (False, llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED), ("auto", llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO),
        ("on", llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED), (True, llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED)]
    for mode, want in modes:
        llm = Llama(tiny_qwen, n_ctx=64, n_threads=2, logits_all=True, verbose=False, flash_attn=mode)
        try:
            assert llm.context_params.flash_attn_type == want
            llm.eval(toks)
            logits[str(mode)] = np.array(llm.scores[: len(toks)])
        finally:
            llm.close()
        np.testing.assert_allclose(logits[str(mode)], ref, atol=2e-3 * float(np.abs(ref).max()))
    np.testing.assert_array_equal(logits["auto"], logits["on"])
    np.testing.assert_array_equal(logits["True"], logits["on"])
    assert not np.array_equal(logits["False"], logits["on"])  # the flash attention kernel really ran
    with pytest.raises(RapidMoEError, match="flash_attn must be"):
        Llama(tiny_qwen, flash_attn="sometimes")


def test_c_api_handles(tiny_qwen: Path) -> None:
    """The handles that callers of llama.cpp's C API take from Llama (the server does): the model's vocabulary, as
    llama.cpp's own llama_model_get_vocab gives it, and the output embedding width the file declares."""
    llm = Llama(tiny_qwen, n_ctx=64, verbose=False)
    try:
        assert llm.vocab == llama_cpp.llama_model_get_vocab(llm.model) and llm.vocab
        assert int(llama_cpp.llama_vocab_n_tokens(llm.vocab)) == llm.n_vocab()
        assert llm.n_embd_out() == int(llm.metadata["qwen3moe.embedding_length"])
    finally:
        llm.close()
