"""Behaviours llama.cpp's own server test-suite checks that pass on stock llama-server of the pin and once failed
on ours (tests/server_upstream/results.md), each pinned here against a real server process on the tiny model.

References: the GGUF's own metadata (gguf-py's reader) for the model's end-of-generation tokens, the server's
/tokenize for how a text becomes tokens (llama-server biases the tokens of the text as its tokenizer splits it),
the chat route's usage for the prompt it evaluated, Python's datetime for today's date in the templates' formats.
"""
from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest
from gguf import GGUFReader
from server_proc import ServerProc
from testkit import GREEDY, ROOT

from rapidmoe.server.chat import ChatTemplate

TEMPLATES = ROOT / "vendor" / "llama.cpp" / "models" / "templates"  # llama.cpp's own copies of model templates


@pytest.fixture(scope="module")
def srv(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    log = tmp_path_factory.mktemp("server") / "parity.log"
    s = ServerProc(tiny_qwen, "--parallel", "1", "-c", "1024", "-t", "1", "--metrics", log_path=log)
    yield s
    s.stop()


def _meta_int(path: Path, key: str) -> int | None:
    field = GGUFReader(path).get_field(key)
    return None if field is None else int(field.contents())


def _tokens(s: ServerProc, text: str) -> list[int]:
    status, r = s.request("POST", "/tokenize", {"content": text, "add_special": False, "parse_special": False})
    assert status == 200, r
    return list(r["tokens"])


def _complete(s: ServerProc, **body: object) -> dict:
    status, r = s.request("POST", "/completion", {"prompt": "Once upon a time", **body})
    assert status == 200, r
    return dict(r)


def test_ignore_eos_bans_the_end_of_generation_tokens(srv: ServerProc, tiny_qwen: Path) -> None:
    """llama-server adds a -inf bias (JSON null) for every EOG token when ignore_eos is set, and shows it in
    generation_settings; without ignore_eos the list is the request's own (empty)."""
    eos = _meta_int(tiny_qwen, "tokenizer.ggml.eos_token_id")
    assert eos is not None
    on = _complete(srv, n_predict=2, ignore_eos=True, **GREEDY)["generation_settings"]["logit_bias"]
    assert on and all(e["bias"] is None for e in on), on
    assert eos in {e["token"] for e in on}
    assert _complete(srv, n_predict=2, **GREEDY)["generation_settings"]["logit_bias"] == []


def test_ignore_eos_never_samples_eos(srv: ServerProc, tiny_qwen: Path) -> None:
    """Forcing EOS to the top with a bias: without ignore_eos the first token ends the answer; with it the EOG ban
    (added after the request's biases, as llama-server) wins and every requested token is generated."""
    eos = _meta_int(tiny_qwen, "tokenizer.ggml.eos_token_id")
    body = {"n_predict": 4, "logit_bias": [[eos, 100.0]], "return_tokens": True, **GREEDY}
    stopped = _complete(srv, **body)
    assert stopped["stop_type"] == "eos" and stopped["tokens_predicted"] == 1, stopped
    kept = _complete(srv, **body, ignore_eos=True)
    assert kept["tokens_predicted"] == 4 and eos not in kept["tokens"], kept


@pytest.mark.parametrize("form", ["array", "object"])
def test_logit_bias_text_bans_its_tokens(srv: ServerProc, form: str) -> None:
    """A text in logit_bias (array entry, or an object key that is not a number) biases each of its tokens, as
    /tokenize splits it; the greedy first token, banned by its text, is not generated."""
    first = _complete(srv, n_predict=1, return_tokens=True, **GREEDY)
    tok = first["tokens"][0]
    text = first["content"]
    ids = _tokens(srv, text)
    assert tok in ids, (tok, text, ids)
    bias: object = [[text, False]] if form == "array" else {text: False}
    r = _complete(srv, n_predict=1, return_tokens=True, logit_bias=bias, **GREEDY)
    assert r["generation_settings"]["logit_bias"] == [{"bias": None, "token": t} for t in ids]
    assert r["tokens"][0] not in ids, r


def test_logit_bias_ids_as_numbers_and_digit_keys(srv: ServerProc) -> None:
    """Ids stay ids: an integer in the array, a key of digits in the object (OpenAI's form), with finite biases
    shown as numbers; an id out of the vocabulary is refused by name."""
    r = _complete(srv, n_predict=1, logit_bias=[[5, -2.5]], **GREEDY)
    assert r["generation_settings"]["logit_bias"] == [{"bias": -2.5, "token": 5}]
    r = _complete(srv, n_predict=1, logit_bias={"7": 1.5}, **GREEDY)
    assert r["generation_settings"]["logit_bias"] == [{"bias": 1.5, "token": 7}]
    status, err = srv.request("POST", "/completion", {"prompt": "a", "logit_bias": {"-1": 1.0}})
    assert status == 400 and "logit_bias" in err["error"]["message"], err


@pytest.mark.parametrize("path", ["/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"])
def test_chat_input_tokens_counts_the_prompt_the_chat_route_evaluates(srv: ServerProc, path: str) -> None:
    """llama-server's chat token count: equal to the usage.prompt_tokens of the same body sent to the chat route."""
    body = {"messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]}
    status, r = srv.request("POST", path, body)
    assert status == 200, r
    status, chat = srv.request("POST", "/v1/chat/completions", {**body, "max_tokens": 1, "cache_prompt": False})
    assert status == 200, chat
    assert r == {"input_tokens": chat["usage"]["prompt_tokens"]} and r["input_tokens"] > 5


def test_metrics_carry_the_speculative_decoding_counters_at_zero(srv: ServerProc) -> None:
    """llama-server's /metrics always has the spec_decode counters (HELP and TYPE counter); we never draft: 0."""
    _complete(srv, n_predict=2)
    status, text = srv.request("GET", "/metrics")
    assert status == 200
    for name in ("draft_tokens_total", "accepted_tokens_total", "drafts_total"):
        series = f"llamacpp:spec_decode_num_{name}"
        assert f"# HELP {series} " in text and f"# TYPE {series} counter" in text, text
        assert f"\n{series} 0\n" in text, text


def _template(name: str) -> ChatTemplate:
    path = TEMPLATES / f"{name}.jinja"
    if not path.exists():
        pytest.skip(f"{path} not fetched (vendor/ comes with the build)")
    return ChatTemplate(path.read_text(encoding="utf-8"), "<|begin_of_text|>", "<|eot_id|>")


def test_templates_see_todays_date() -> None:
    """llama.cpp gives every template `date_string` ("%d %b %Y") and `datetime` ("%b %d %Y"), today; Llama 3.3's
    template fell back to its own "26 Jul 2024". chat_template_kwargs override them."""
    msgs = [{"role": "user", "content": "What is today?"}]
    t = _template("meta-llama-Llama-3.3-70B-Instruct")
    assert datetime.date.today().strftime("%d %b %Y") in t.render(msgs, {})
    assert "Today Date: 01 Jan 2000" in t.render(msgs, {"chat_template_kwargs": {"date_string": "01 Jan 2000"}})
    probe = ChatTemplate("{{ datetime }}|{{ date_string }}", "", "")
    assert probe.render(msgs, {}) == datetime.date.today().strftime("%b %d %Y|%d %b %Y")


def test_apply_template_without_generation_prompt(srv: ServerProc) -> None:
    """/apply-template honours add_generation_prompt false, as llama-server: the prompt is the one with the
    generation prompt less its assistant header (here the tiny model's DeepSeek-R1 template's)."""
    body = {"messages": [{"role": "user", "content": "What is today?"}]}
    status, on = srv.request("POST", "/apply-template", body)
    assert status == 200, on
    status, off = srv.request("POST", "/apply-template", {**body, "add_generation_prompt": False})
    assert status == 200, off
    head = "<\uff5cAssistant\uff5c><think>\n"
    assert on["prompt"].endswith(head) and on["prompt"] == off["prompt"] + head, (on, off)


def test_llama33_generation_prompt_switch() -> None:
    """The same on Llama 3.3's template (llama.cpp's test_add_generation_prompt): its assistant header only with
    add_generation_prompt."""
    t = _template("meta-llama-Llama-3.3-70B-Instruct")
    msgs = [{"role": "user", "content": "What is today?"}]
    header = "<|start_header_id|>assistant<|end_header_id|>"
    assert header in t.render(msgs, {}) and header not in t.render(msgs, {}, add_generation_prompt=False)


def test_enable_thinking_defaults_to_true() -> None:
    """llama-server renders with enable_thinking true unless chat_template_kwargs says false (its default reasoning
    "auto"): Command-R7B's template then ends with the bare chatbot turn, not an empty thinking block."""
    t = _template("CohereForAI-c4ai-command-r7b-12-2024-tool_use")
    msgs = [{"role": "user", "content": "What is today?"}]
    turn = "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    assert t.render(msgs, {}).endswith(turn)
    off = t.render(msgs, {"chat_template_kwargs": {"enable_thinking": False}})
    assert off.endswith(turn + "<|START_THINKING|><|END_THINKING|>")
    probe = ChatTemplate("{{ enable_thinking }}", "", "")
    assert probe.render(msgs, {}) == "True"
