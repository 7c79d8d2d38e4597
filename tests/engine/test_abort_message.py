"""A file whose contents reach one of llama.cpp's asserts: two tokenizer entries made equal, which llama.cpp's vocab
loader asserts against (GGML_ASSERT(id_to_token.size() == token_to_id.size()) in llama-vocab.cpp). rapidmoe refuses
it before llama.cpp sees it (rapidmoe.modelfile); loaded by llama.cpp directly, the abort says why on the stderr the
process started with, though llama-cpp-python silences fd 2 while a model loads (src/rapidmoe_ggml/pymodule/
abort_message.cpp). The token list is judged as llama.cpp reads it (each token up to its first NUL byte, an empty
one named [EMPTY_<id>]); llama.cpp itself is the reference: what rapidmoe refuses, it aborts on, and what rapidmoe
lets through, it loads."""
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


def _rewritten(src: Path, dst: Path, tokens: dict[int, bytes], types: dict[int, int] | None = None,
               model: bytes | None = None) -> Path:
    """src with token texts replaced in place (each of its token's length), token types set and the tokenizer model's
    name replaced (of the same length): the file stays a well-formed GGUF."""
    r = gguf.GGUFReader(src)
    base = r.data.ctypes.data
    field = r.fields["tokenizer.ggml.tokens"]
    parts = [field.parts[i] for i in field.data]
    edits = []
    for i, text in tokens.items():
        assert len(text) == len(parts[i]), (i, bytes(parts[i]), text)
        edits.append((parts[i].ctypes.data - base, text))
    type_field = r.fields["tokenizer.ggml.token_type"]
    for i, ty in (types or {}).items():
        edits.append((type_field.parts[type_field.data[i]].ctypes.data - base, ty.to_bytes(4, "little")))
    if model is not None:
        name = r.fields["tokenizer.ggml.model"].parts[-1]
        assert len(model) == len(name)
        edits.append((name.ctypes.data - base, model))
    del r, field, parts, type_field  # the reader's memory map
    shutil.copy(src, dst)
    with dst.open("r+b") as f:
        for off, b in edits:
            f.seek(off)
            f.write(b)
    return dst


def _token(path: Path, i: int) -> bytes:
    from rapidmoe.ggufio import GGUFFile  # noqa: PLC0415

    return str(GGUFFile(path).get("tokenizer.ggml.tokens")[i]).encode()


def _llama_cpp_load(path: Path) -> subprocess.CompletedProcess[str]:
    return _run(["-c", LOW_LEVEL_LOAD, str(path)])


def test_a_token_is_read_up_to_its_first_nul_byte(tiny_qwen: Path, tmp_path: Path) -> None:
    """`Ġso` and `Ġcut\\0\\0...` are one token to llama.cpp (it aborts); rapidmoe says so in one line, before it."""
    i, j = 555, 3407  # "Ġso" and "Ġcut": token j becomes i's text and NULs, as long as it was
    assert (_token(tiny_qwen, i), _token(tiny_qwen, j)) == ("Ġso".encode(), "Ġcut".encode())
    text = _token(tiny_qwen, i)
    path = _rewritten(tiny_qwen, tmp_path / "nul.gguf", {j: text + b"\0" * (len(_token(tiny_qwen, j)) - len(text))})
    assert _llama_cpp_load(path).returncode == -signal.SIGABRT  # the reference: llama.cpp alone aborts
    p = _run(["-m", "rapidmoe.cli", "run", str(path), "-p", "hi", "-n", "2"])
    assert p.returncode == 1, p
    assert p.stderr.strip().splitlines() == [
        f"rapidmoe-cli: error: {path} is damaged: its tokenizer lists the token 'Ġso' twice (ids {i} and {j}; "
        "llama.cpp reads 'Ġso\\x00' as 'Ġso': a token ends at its first NUL byte, an empty one is named "
        "[EMPTY_<id>]); llama.cpp cannot load such a vocabulary"], p.stderr


def test_empty_tokens_as_llama_cpp_names_them(tiny_qwen: Path, tmp_path: Path) -> None:
    """Two tokens empty as read (all NULs) load in llama.cpp, which names them [EMPTY_<id>]: rapidmoe runs the file;
    one beside a token spelled `[EMPTY_<id>]` is a duplicate to llama.cpp (it aborts): refused in one line."""
    i, j, k = 1000, 1001, 1032  # k: a 12-byte token, the length of "[EMPTY_1000]"
    blank = {i: bytes(len(_token(tiny_qwen, i))), j: bytes(len(_token(tiny_qwen, j)))}
    two = _rewritten(tiny_qwen, tmp_path / "two-empty.gguf", blank)
    assert _llama_cpp_load(two).returncode == 0
    p = _run(["-m", "rapidmoe.cli", "run", str(two), "-p", "hi", "-n", "2", "--temp", "0"])
    assert p.returncode == 0, p.stderr
    named = _rewritten(tiny_qwen, tmp_path / "empty-named.gguf", {i: blank[i], k: f"[EMPTY_{i}]".encode()})
    assert _llama_cpp_load(named).returncode == -signal.SIGABRT
    p = _run(["-m", "rapidmoe.cli", "inspect", str(named)])
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p
    assert f"lists the token '[EMPTY_{i}]' twice (ids {i} and {k}; llama.cpp reads" in lines[0], lines


def test_a_byte_token_in_a_wordpiece_vocabulary(tiny_qwen: Path, tmp_path: Path) -> None:
    """A token of the byte type in a WordPiece ("bert") vocabulary: llama.cpp builds every token's piece at load and
    aborts in token_to_byte, which has no byte value for that type; rapidmoe refuses the file first. Without the
    byte token the same vocabulary loads."""
    wpm = _rewritten(tiny_qwen, tmp_path / "wpm.gguf", {}, model=b"bert")
    assert _llama_cpp_load(wpm).returncode == 0
    byte = _rewritten(tiny_qwen, tmp_path / "wpm-byte.gguf", {}, {300: 6}, model=b"bert")
    p = _llama_cpp_load(byte)
    assert p.returncode == -signal.SIGABRT and "llama-vocab.cpp" in p.stderr, p
    p = _run(["-m", "rapidmoe.cli", "inspect", str(byte)])
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p
    assert "token 300 ('Ġe') of its WordPiece (bert) tokenizer has the byte type" in lines[0], lines
