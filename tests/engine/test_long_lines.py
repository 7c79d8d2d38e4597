"""Long lines reach llama.cpp's std::regex pre-tokenizer, which recurses once per character (rapidmoe.tokenize_stack).

Before the fix, 30,000 letters or brackets in a row killed the process with SIGSEGV (an 8 MiB stack) and nothing
printed: the server (fuzzing, http seed 101 #49), `rapidmoe-cli run`, the Python API. Now they tokenize exactly as
stock llama.cpp does on a stack big enough for it, and a line too long even for that is refused with a clear error.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_proc import ServerProc

from rapidmoe import tokenize_stack
from rapidmoe.tokenize_stack import TextTooLongError, longest_match_bound

ROOT = Path(__file__).resolve().parents[2]
VOCAB = "ggml-vocab-deepseek-coder.gguf"  # the synthetic models' tokenizer: a pre-tokenizer without a custom splitter
LONG = {"brackets": "[" * 100_000, "letters": "x" * 60_000 + " tail\n" + "7" * 50, "spaces": "a" + " " * 40_000 + "b"}
TOKENIZE = ("import json, sys, {mod}; m = {mod}.Llama(sys.argv[1], vocab_only=True, verbose=False); "
            "print(json.dumps([m.tokenize(t.encode(), add_bos=False) for t in json.loads(sys.stdin.read())]))")


def _stack_limit(n: int):  # type: ignore[no-untyped-def]
    return lambda: resource.setrlimit(resource.RLIMIT_STACK, (n, resource.getrlimit(resource.RLIMIT_STACK)[1]))


def _tokenize_in_child(mod: str, vocab: Path, texts: list[str], stack: int, env: dict[str, str]) -> list[list[int]]:
    """Tokenize on the main thread of a fresh process whose stack limit is `stack` bytes (a crash is a failure)."""
    out = subprocess.run([sys.executable, "-c", TOKENIZE.format(mod=mod), str(vocab)], input=json.dumps(texts),
                         capture_output=True, text=True, env=env, preexec_fn=_stack_limit(stack), timeout=300,
                         cwd=ROOT / "vendor")
    assert out.returncode == 0, (mod, out.returncode, out.stderr[-2000:])
    tokens: list[list[int]] = json.loads(out.stdout.splitlines()[-1])
    return tokens


@pytest.mark.native
@pytest.mark.stock
def test_long_lines_tokenize_like_stock_on_a_normal_stack(vocab_dir: Path, stock_bin: Path) -> None:
    texts = list(LONG.values())
    hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
    big = 1 << 30 if hard == resource.RLIM_INFINITY else min(1 << 30, hard)
    stock_env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(stock_bin), PYTHONPATH=str(ROOT / "vendor" / "llama_cpp_py"))
    # the reference: stock libllama, on a main thread allowed to grow to 1 GiB
    want = _tokenize_in_child("llama_cpp", vocab_dir / VOCAB, texts, big, stock_env)
    # ours, on the usual 8 MiB: the long lines move to a thread with a stack that fits
    got = _tokenize_in_child("rapidmoe", vocab_dir / VOCAB, texts, 8 << 20, dict(os.environ))
    for name, g, w in zip(LONG, got, want, strict=True):
        assert g == w, name
    assert len(want[0]) >= 10_000  # really one pre-token that long: brackets merge into a few long tokens at most


@pytest.mark.native
def test_a_line_too_long_is_refused(vocab_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rapidmoe import Llama  # noqa: PLC0415 - the extension

    llm = Llama(vocab_dir / VOCAB, vocab_only=True, verbose=False)
    # 16 MiB: lines up to ~8,000 characters; 10,000 would also fit this thread's stack, so a broken check fails here
    monkeypatch.setattr(tokenize_stack, "MAX_STACK", 16 << 20)
    text = ("ok\n" + "y" * 10_000).encode()
    with pytest.raises(TextTooLongError, match=r"a line of 10000 characters and a whitespace run of 1: "
                                               r".*limit of 16 MiB; break the text into shorter lines"):
        llm.tokenize(text)
    assert len(llm.tokenize(b"ok\n" + b"y z\n" * 10_000)) > 0  # as long, but in short lines: no limit
    llm.close()


def test_the_bound_covers_line_and_space_runs() -> None:
    assert longest_match_bound(b"") == 1
    assert longest_match_bound(b"ab\ncd ef") == 5 + 1 + 1  # the line "cd ef", the space
    assert longest_match_bound(b"x\n\n\n\n  y") == 3 + 6 + 1  # " y"-line is 3 with its spaces, the run "\n\n\n\n  "
    assert longest_match_bound("\u00e9\u0301" .encode() * 5) == 10 + 0 + 1  # code points, not bytes
    assert longest_match_bound(b"\xff" * 7) == 7 + 0 + 1  # each invalid byte is one character


@pytest.fixture(scope="module")
def server(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    log = tmp_path_factory.mktemp("server") / "long-lines.log"
    s = ServerProc(tiny_qwen, "-c", "1024", "--max-body", str(6 << 20), "-t", "1", log_path=log)
    yield s
    s.stop()


@pytest.mark.native
def test_server_answers_long_lines(server: ServerProc) -> None:
    status, body = server.request("POST", "/tokenize", {"content": LONG["brackets"]})
    assert status == 200 and len(body["tokens"]) >= 10_000, (status, body if status != 200 else "")
    status, body = server.request("POST", "/completion", {"prompt": LONG["brackets"], "n_predict": 1})
    assert status == 400 and "context" in body["error"]["message"], (status, body)  # tokenized, then too long
    status, body = server.request("POST", "/tokenize", {"content": "z" * 5_000_000})  # beyond MAX_STACK (4 GiB)
    assert status == 400 and "shorter lines" in body["error"]["message"], (status, body)
    status, body = server.request("POST", "/completion", {"prompt": "Hello", "n_predict": 2})
    assert status == 200, (status, body)  # the server lives on


@pytest.mark.native
def test_cli_run_takes_a_long_line(tiny_qwen: Path) -> None:
    prompt = "[" * 30_000  # ~15,000 tokens or fewer: the context below holds it
    out = subprocess.run([sys.executable, "-m", "rapidmoe.cli", "run", str(tiny_qwen), "-p", prompt, "-n", "2",
                          "-c", "20000", "-t", "1"], capture_output=True, text=True, timeout=600,
                         preexec_fn=_stack_limit(8 << 20))
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith(prompt)


@pytest.mark.native
def test_tokenize_equals_llama_cpp_python(vocab_dir: Path) -> None:
    """Our tokenize sizes its buffer by the text, llama_cpp's by the training context: the same tokens."""
    from rapidmoe import Llama  # noqa: PLC0415 - the extension
    from rapidmoe._runtime import llama_cpp  # noqa: PLC0415

    llm = Llama(vocab_dir / VOCAB, vocab_only=True, verbose=False)
    texts = [b"", b"a", b"Hello, world!", "na\u00efve \u4e2d\u6587 \U0001f600".encode(), b"<|EOT|>x<|EOT|>",
             b"\xff\xfe broken utf-8", b"  lead and trail  \n\n"]
    for text in texts:
        for add_bos in (False, True):
            for special in (False, True):
                want = llama_cpp.Llama.tokenize(llm, text, add_bos, special)
                assert llm.tokenize(text, add_bos, special) == want, (text, add_bos, special)
    llm.close()
