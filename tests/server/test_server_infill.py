"""/infill: llama-server's fill-in-the-middle prompt layout (server/infill.py) and the route on the tiny model, whose
DeepSeek vocabulary has the FIM prefix, suffix and middle tokens (not the repo and separator ones).

STOCK is stock llama-server's answer of the pin to REQUEST on the same model (`llama-server -m tiny.gguf -c 2048
--threads 1`: four slots of 2048 tokens, a batch of 2048): its prompt as it shows it and how many tokens it evaluated.
"""
# ruff: noqa: RUF001 - DeepSeek's FIM tokens really are written with U+FF5C (fullwidth vertical bar)
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc

from rapidmoe.server.errors import ApiError
from rapidmoe.server.infill import FimTokens, check_fields, infill_prompt

REQUEST: dict[str, Any] = {"input_extra": [{"filename": "a.py", "text": "def f(): pass\n"}],
                           "input_prefix": "int main() {\n", "prompt": "    int n = ", "input_suffix": "}\n",
                           "n_predict": 8, "temperature": 0}
STOCK = {"tokens_evaluated": 17,
         "prompt": " pass\n<｜begin▁of▁sentence｜><｜fim▁begin｜>int main() {\n    int n = <｜fim▁hole｜>}\n"
                   "<｜fim▁end｜>"}


def _chars(text: str, special: bool) -> list[int]:
    return [ord(c) for c in text]


def test_layout_with_repo_and_separator_tokens() -> None:
    fim = FimTokens(pre=1002, suf=1003, mid=1004, rep=1005, sep=1006)
    body = {"input_prefix": "abcdefgh", "input_suffix": "xyz", "prompt": "P"}
    extra = [{"filename": "f", "text": "T"}]
    got = infill_prompt(fim, _chars, body, extra, n_batch=8, n_predict=1, n_ctx=100, bos=None)
    repo = [1005, *_chars("myproject\n", False), 1006, *_chars("f\n", False), *_chars("T", False), 1006,
            *_chars("filename\n", False)]
    # the prefix keeps its last 3/4 of the batch (6), the suffix its first 8/4 - (2 + 1 prompt token) = none
    assert got == [*repo, 1002, *_chars("cdefgh", False), ord("P"), 1003, 1004]
    small = infill_prompt(fim, _chars, body, extra, n_batch=8, n_predict=40, n_ctx=100, bos=1)
    assert small == [*repo[-(100 - 8 - 80):], 1, 1002, *_chars("cdefgh", False), ord("P"), 1003, 1004]


def test_layout_without_separator_tokens_and_mixed_input() -> None:
    fim = FimTokens(pre=1002, suf=1003, mid=1004, rep=-1, sep=-1)
    body = {"input_prefix": ["a", 7], "input_suffix": "uv"}
    got = infill_prompt(fim, _chars, body, [{"text": "T"}], n_batch=64, n_predict=-1, n_ctx=1000, bos=None)
    assert got == [*_chars("\n\n--- snippet ---\n\nT", False), 1002, ord("a"), 7, 1003, *_chars("uv", False), 1004]


@pytest.mark.parametrize("body,msg", [
    ({"input_suffix": ""}, "input_prefix"), ({"input_prefix": ""}, "input_suffix"),
    ({"input_prefix": "", "input_suffix": "", "prompt": 3}, "prompt"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": {}}, "input_extra"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]}, "text"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "a", "filename": 1}]}, "filename")])
def test_bad_fields_are_400(body: dict[str, Any], msg: str) -> None:
    with pytest.raises(ApiError) as e:
        check_fields(body)
    assert e.value.status == 400 and msg in e.value.message


def test_missing_fim_tokens_are_named() -> None:
    assert FimTokens(1, 2, 3, -1, -1).missing() == ""
    assert FimTokens(-1, 2, -1, 4, 5).missing() == "prefix token is missing. middle token is missing. "


@pytest.fixture(scope="module")
def srv(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    d = tmp_path_factory.mktemp("infill")  # slots of 2048 tokens and a batch of 2048, as stock's above
    s = ServerProc(tiny_qwen, "-c", "4096", "--parallel", "2", "--batch-size", "2048", "-t", "1",
                   log_path=d / "server.log")
    yield s
    s.stop()


def test_infill_prompt_is_stocks(srv: ServerProc) -> None:
    status, r = srv.request("POST", "/infill", REQUEST)
    assert status == 200, r
    assert {k: r[k] for k in STOCK} == STOCK
    assert r["tokens_predicted"] == 8 and r["content"]


def test_infill_streams_as_completion(srv: ServerProc) -> None:
    events = list(srv.stream("/infill", {**REQUEST, "stream": True}))
    assert events and b'"stop":true' in events[-1].replace(b" ", b"")


@pytest.mark.parametrize("extra", [{}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"},
                                   {"filename": 123, "text": 456}])
def test_bad_input_extra_is_400(srv: ServerProc, extra: dict[str, Any]) -> None:
    """llama.cpp's test_invalid_input_extra_req."""
    status, r = srv.request("POST", "/infill", {**REQUEST, "input_extra": [extra]})
    assert status == 400 and "error" in r, r
