"""A file whose contents reach one of llama.cpp's asserts: two tokenizer entries made equal, which llama.cpp's vocab
loader asserts against (GGML_ASSERT(id_to_token.size() == token_to_id.size()) in llama-vocab.cpp). rapidmoe refuses
it before llama.cpp sees it (rapidmoe.modelfile); loaded by llama.cpp directly, the abort says why on the stderr the
process started with, though llama-cpp-python silences fd 2 while a model loads (src/rapidmoe_ggml/core/
abort_message.cpp)."""
from __future__ import annotations

import os
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
def equal_tokens(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """tiny_qwen with two 5-byte tokens overwritten by the same text (the file stays a well-formed GGUF); their ids."""
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
    return out, ids


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_cli_refuses_a_duplicate_token_before_llama_cpp_sees_it(equal_tokens: tuple[Path, list[int]]) -> None:
    path, ids = equal_tokens
    p = _run(["-m", "rapidmoe.cli", "run", str(path), "-p", "hi", "-n", "2"])
    assert p.returncode == 1, p  # rapidmoe.modelfile checks the tokenizer first: llama.cpp would abort
    assert p.stderr.strip().splitlines() == [
        f"rapidmoe-cli: error: {path} is damaged: its tokenizer lists the token 'zzzzz' twice "
        f"(ids {ids[0]} and {ids[1]}); llama.cpp cannot load such a vocabulary"], p.stderr


# llama.cpp's own loader on the same file, with fd 2 silenced as llama-cpp-python's Llama silences it while loading
LOW_LEVEL_LOAD = """
import sys
from rapidmoe._runtime import llama_cpp  # imports rapidmoe._core, which installs the abort hook
from rapidmoe._llama_cpp._utils import suppress_stdout_stderr
with suppress_stdout_stderr(disable=False):
    llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), llama_cpp.llama_model_default_params())
"""


@pytest.mark.parametrize(("prog", "env"), [("rapidmoe", {}), ("rapidmoe-cli", {"RAPIDMOE_PROG": "rapidmoe-cli"})])
def test_an_abort_inside_llama_cpp_prints_its_message(equal_tokens: tuple[Path, list[int]], prog: str,
                                                      env: dict[str, str]) -> None:
    p = _run(["-c", LOW_LEVEL_LOAD, str(equal_tokens[0])], **env)
    assert p.returncode == -signal.SIGABRT, p  # llama.cpp still ends the process: the line says why
    lines = [ln for ln in p.stderr.splitlines() if "llama.cpp aborted" in ln]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: llama.cpp aborted: "), p.stderr
    assert lines[0].endswith(ASSERT) and "llama-vocab.cpp:" in lines[0], p.stderr
