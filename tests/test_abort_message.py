"""A llama.cpp abort reached by a file's contents says why on stderr, though llama-cpp-python silences fd 2 while a
model loads (src/rapidmoe_ggml/core/abort_message.cpp). The file: two tokenizer entries made equal, which llama.cpp's
vocab loader asserts against (GGML_ASSERT(id_to_token.size() == token_to_id.size()) in llama-vocab.cpp)."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

pytestmark = pytest.mark.native

ASSERT = "GGML_ASSERT(id_to_token.size() == token_to_id.size()) failed"


@pytest.fixture(scope="module")
def equal_tokens(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_qwen with two 5-byte tokens overwritten by the same text (the file stays a well-formed GGUF)."""
    r = gguf.GGUFReader(tiny_qwen)
    field = r.fields["tokenizer.ggml.tokens"]
    parts = [field.parts[i] for i in field.data]
    ids = [i for i in range(1000, len(parts)) if len(parts[i]) == 5][:2]
    offsets = [parts[i].ctypes.data - r.data.ctypes.data for i in ids]
    del r, field, parts  # the reader's memory map
    out = tmp_path_factory.mktemp("abort") / "equal-tokens.gguf"
    shutil.copy(tiny_qwen, out)
    with out.open("r+b") as f:
        for off in offsets:
            f.seek(off)
            f.write(b"zzzzz")
    return out


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_cli_prints_the_abort_as_one_error_line(equal_tokens: Path) -> None:
    p = _run(["-m", "rapidmoe.cli", "run", str(equal_tokens), "-p", "hi", "-n", "2"])
    assert p.returncode == -signal.SIGABRT, p  # llama.cpp still ends the process: the line says why
    lines = [ln for ln in p.stderr.splitlines() if "llama.cpp aborted" in ln]
    assert len(lines) == 1 and lines[0].startswith("rapidmoe-cli: error: llama.cpp aborted: "), p.stderr
    assert lines[0].endswith(ASSERT) and "llama-vocab.cpp:" in lines[0], p.stderr


def test_library_use_names_rapidmoe(equal_tokens: Path) -> None:
    code = f"from rapidmoe import Llama; Llama({str(equal_tokens)!r}, verbose=False)"
    p = _run(["-c", code])
    assert p.returncode == -signal.SIGABRT, p
    assert "rapidmoe: error: llama.cpp aborted: " in p.stderr and ASSERT in p.stderr, p.stderr
