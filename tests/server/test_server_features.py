"""`rapidmoe-cli serve` features beyond the basics, against a real server process on the tiny model:
fields the server does not implement are refused by name, DRY and top-n-sigma sampling, per-token timings,
`response_fields`, structured output (GBNF grammars, JSON schemas checked with the `jsonschema` package),
token log-probabilities (against a softmax of the numpy reference forward pass's logits).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from server_proc import ServerProc, sse_json
from testkit import GREEDY, ROOT

from rapidmoe.server.chat import CHATML  # chat requests here keep ChatML, whatever the model carries
from rapidmoe.server.params import UNSUPPORTED

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def srv(tiny_qwen: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    log = tmp_path_factory.mktemp("server") / "features.log"
    s = ServerProc(tiny_qwen, "--parallel", "2", "-c", "2048", "-t", "1", "--chat-template", CHATML,
                   log_path=log)
    yield s
    s.stop()


def good(s: ServerProc) -> None:
    status, body = s.request("POST", "/completion", {"prompt": "Hello", "n_predict": 2})
    assert status == 200 and body["tokens_predicted"] == 2, body


def client(s: ServerProc):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)


# ---- refused, never ignored ----

MSGS = [{"role": "user", "content": "hi"}]
REFUSED = [
    ("/completion", {"prompt": "a", "lora": [{"id": 0, "scale": 1.0}]}, "lora"),
    ("/completion", {"prompt": "a", "n_indent": 4}, "n_indent"),
    ("/completion", {"prompt": "a", "samplers": ["top_k"]}, "samplers"),
    ("/completion", {"prompt": "a", "post_sampling_probs": True}, "post_sampling_probs"),
    ("/completion", {"prompt": "a", "n_cache_reuse": 256}, "n_cache_reuse"),
    ("/completion", {"prompt": "a", "return_progress": True}, "return_progress"),
    ("/completion", {"prompt": "a", "grammar_lazy": True}, "grammar_lazy"),
    ("/completion", {"prompt": "a", "input_suffix": "}"}, "input_suffix"),
    ("/v1/completions", {"prompt": "a", "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": "a", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "a", "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": MSGS, "reasoning_format": "deepseek-legacy"}, "reasoning_format"),
    ("/v1/completions", {"prompt": "a", "reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/completions", {"prompt": "a", "thinking_budget_tokens": 8}, "thinking_budget_tokens"),
    ("/v1/chat/completions", {"messages": MSGS, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"messages": MSGS, "continue_final_message": True}, "continue_final_message"),
    ("/v1/chat/completions", {"messages": MSGS, "add_generation_prompt": False}, "add_generation_prompt"),
    ("/v1/chat/completions", {"messages": MSGS, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": MSGS, "prediction": {"type": "content", "content": "x"}}, "prediction"),
]


@pytest.mark.parametrize("path,body,field", REFUSED, ids=[r[2] for r in REFUSED])
def test_unsupported_field_is_refused_by_name(srv: ServerProc, path: str, body: dict, field: str) -> None:
    status, r = srv.request("POST", path, body)
    assert status == 400, r  # the client's error: a 5xx would make SDKs send it again
    assert r["error"]["type"] == "invalid_request_error" and f'"{field}"' in r["error"]["message"], r
    good(srv)


def test_docs_list_exactly_the_refused_fields() -> None:
    """docs/server.md's "What is refused" table names every field of UNSUPPORTED, and nothing else."""
    text = (ROOT / "docs" / "server.md").read_text(encoding="utf-8")
    section = text.split("\n## What is refused\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    assert {name for first in rows for name in re.findall(r"`([a-z_]+)`", first)} == set(UNSUPPORTED)


def test_off_values_of_unsupported_fields_are_accepted(srv: ServerProc) -> None:
    off = {"lora": [], "n_indent": 0, "post_sampling_probs": False, "return_progress": False, "samplers": [],
           "best_of": 1, "echo": False, "user": "me", "cache_prompt": True, "n_keep": 0}
    status, r = srv.request("POST", "/v1/completions", {"prompt": "a", "max_tokens": 2, **off})
    assert status == 200 and r["usage"]["completion_tokens"] == 2, r
    status, r = srv.request("POST", "/v1/chat/completions",
                            {"messages": MSGS, "max_tokens": 2, "reasoning_format": "none",
                             "modalities": ["text"], "add_generation_prompt": True})
    assert status == 200, r


@pytest.mark.parametrize("method,path,status,name", [
    ("GET", "/tools", 403, "--tools"), ("POST", "/tools", 403, "--tools"),
    ("GET", "/cors-proxy", 403, "--ui-mcp-proxy"), ("POST", "/cors-proxy", 403, "--ui-mcp-proxy")])
def test_unimplemented_routes_answer_llama_servers_status(srv: ServerProc, method: str, path: str, status: int,
                                                          name: str) -> None:
    """The status llama-server answers without their flags (403 "feature_disabled"), the feature named."""
    got, r = srv.request(method, path, {} if method == "POST" else None)
    assert got == status and name in r["error"]["message"] and r["error"]["type"] == "feature_disabled", r


def _requests(s: ServerProc, line: str) -> int:
    """How many requests the server's log shows answered as `line` ("POST /v1/completions 400")."""
    return sum(line in ln for ln in s.log().splitlines())


@pytest.mark.parametrize("path,call", [
    ("/v1/completions", lambda c: c.completions.create(model="x", prompt="a", max_tokens=2, best_of=2)),
    ("/v1/chat/completions", lambda c: c.chat.completions.create(model="x", messages=MSGS, max_tokens=2,
                                                                 extra_body={"lora": [{"id": 0, "scale": 1.0}]})),
])
def test_openai_client_sends_a_refused_field_once(srv: ServerProc, path: str, call: Any) -> None:
    """A refused field is the client's error (400): the SDK, with its default retries, raises at once instead of
    sending the request three times as it did for the 501 of old."""
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=60)  # the SDK's default max_retries (2)
    before = _requests(srv, f"POST {path} 400")
    with pytest.raises(openai.BadRequestError):
        call(c)
    assert _requests(srv, f"POST {path} 400") - before == 1


# ---- DRY and top-n-sigma (llama.cpp's samplers) ----

def _tokens(s: ServerProc, body: dict) -> tuple[list[int], list[int]]:
    """(prompt tokens as the server tokenizes them, generated tokens)."""
    status, r = s.request("POST", "/completion", {**body, "return_tokens": True})
    assert status == 200, r
    _, tok = s.request("POST", "/tokenize", {"content": body["prompt"], "add_special": True})
    return tok["tokens"], r["tokens"]


def _extends_repeat(seq: list[int], start: int, n: int) -> list[int]:
    """Positions i >= start where seq[i-n:i+1] (n tokens and the next) already occurred earlier in seq."""
    out = []
    for i in range(max(start, n), len(seq)):
        gram = seq[i - n:i + 1]
        if any(seq[j - n:j + 1] == gram for j in range(n, i)):
            out.append(i)
    return out


def test_dry_forbids_extending_repeats(srv: ServerProc) -> None:
    """With a huge multiplier, greedy DRY never picks a token that extends a repeat of `allowed_length` tokens
    (what DRY penalizes, checked on the token ids); without DRY the same request does repeat."""
    base = {"prompt": "one two one two one two one two", "n_predict": 48, "ignore_eos": True, **GREEDY}
    prompt, plain = _tokens(srv, base)
    assert _extends_repeat(prompt + plain, len(prompt), 2), "the reference output should repeat itself"
    prompt, dry = _tokens(srv, {**base, "dry_multiplier": 1e4, "dry_allowed_length": 2, "dry_base": 2.0,
                                "dry_penalty_last_n": 4096, "dry_sequence_breakers": ["\u0001"]})
    assert len(dry) == 48 and dry != plain
    assert _extends_repeat(prompt + dry, len(prompt), 2) == []
    status, r = srv.request("POST", "/completion", {**base, "dry_sequence_breakers": []})
    assert status == 400 and "dry_sequence_breakers" in r["error"]["message"]
    _, r = srv.request("POST", "/completion", {**base, "n_predict": 1, "dry_multiplier": 0.5})
    assert r["generation_settings"]["dry_multiplier"] == 0.5
    assert r["generation_settings"]["dry_sequence_breakers"] == ["\n", ":", "\"", "*"]


def test_top_n_sigma_keeps_only_the_top_logit(srv: ServerProc) -> None:
    """A tiny top-n-sigma keeps only the maximum logit: at temperature 5 the answer equals greedy's for any
    seed; without it, temperature 5 gives different answers for different seeds."""
    body = {"prompt": "Once upon a time", "n_predict": 16, "ignore_eos": True, "top_k": 0, "top_p": 1.0,
            "min_p": 0.0}
    _, greedy = srv.request("POST", "/completion", {**body, **GREEDY})
    hot = [srv.request("POST", "/completion", {**body, "temperature": 5.0, "seed": seed})[1]["content"]
           for seed in (1, 2)]
    assert hot[0] != hot[1] and greedy["content"] not in hot
    for seed in (1, 2):
        _, r = srv.request("POST", "/completion", {**body, "temperature": 5.0, "seed": seed, "top_n_sigma": 1e-6})
        assert r["content"] == greedy["content"]


# ---- timings_per_token, response_fields ----

def test_timings_per_token_in_stream(srv: ServerProc) -> None:
    events = sse_json(srv.stream("/v1/chat/completions", {"messages": MSGS, "max_tokens": 6, "stream": True,
                                                          "timings_per_token": True, "ignore_eos": True}))
    assert "timings" not in events[0]
    content = [e for e in events[1:-1] if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert content and all("timings" in e for e in content)
    n = [e["timings"]["predicted_n"] for e in content]
    assert n == sorted(n) and n[-1] <= 6
    plain = sse_json(srv.stream("/v1/chat/completions", {"messages": MSGS, "max_tokens": 6, "stream": True}))
    assert not any("timings" in e for e in plain[1:-2])


def test_response_fields(srv: ServerProc) -> None:
    status, r = srv.request("POST", "/completion", {"prompt": "Hi", "n_predict": 3, "response_fields": [
        "content", "generation_settings/n_predict", "timings/predicted_n", "no/such"]})
    assert status == 200 and set(r) == {"content", "generation_settings/n_predict", "timings/predicted_n"}
    assert r["generation_settings/n_predict"] == 3 and r["timings/predicted_n"] == 3


# ---- structured output: grammar, json_schema, response_format ----

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 150}},
               "required": ["name", "age"]},
    "order": {"type": "object", "properties": {
        "size": {"enum": ["small", "medium", "large"]}, "paid": {"type": "boolean"},
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1,
                  "maxItems": 3},
        "where": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                  "required": ["city"]}},
        "required": ["size", "paid", "items", "where"], "additionalProperties": False},
    "choice": {"anyOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "number"}},
                          "required": ["kind", "n"]},
                         {"type": "object", "properties": {"kind": {"const": "b"}, "ok": {"type": "null"}},
                          "required": ["kind", "ok"]}]},
    "list": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 4},
}


def _valid(text: str, schema: dict) -> object:
    import jsonschema  # noqa: PLC0415 - a test extra, only needed here

    doc = json.loads(text)
    jsonschema.validate(doc, schema)
    return doc


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_output_validates(srv: ServerProc, name: str) -> None:
    schema = SCHEMAS[name]
    for sampling in (GREEDY, {"temperature": 1.0, "seed": 7}, {"temperature": 1.5, "seed": 8, "top_k": 0}):
        status, r = srv.request("POST", "/completion", {"prompt": "JSON:", "json_schema": schema, "n_predict": 200,
                                                        **sampling})
        assert status == 200 and r["stop_type"] == "eos", r
        _valid(r["content"], schema)


def test_grammar_sees_only_generated_tokens(srv: ServerProc) -> None:
    """The prompt ends with a word the grammar does not allow first: it is not fed to the grammar."""
    for prompt in ("The answer is yes", "no no no", "{"):
        status, r = srv.request("POST", "/completion", {"prompt": prompt, "grammar": 'root ::= ("yes" | "no") "!"',
                                                        "n_predict": 10, "temperature": 1.0, "seed": 3})
        assert status == 200 and r["content"] in ("yes!", "no!") and r["stop_type"] == "eos", r


def test_structured_output_openai_chat_stream_and_parallel(srv: ServerProc) -> None:
    c = client(srv)
    schema = SCHEMAS["order"]
    rf = {"type": "json_schema", "json_schema": {"name": "order", "schema": schema, "strict": True}}
    r = c.chat.completions.create(model="x", messages=MSGS, response_format=rf, max_tokens=200, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    whole = r.choices[0].message.content
    _valid(whole, schema)
    chunks = list(c.chat.completions.create(model="x", messages=MSGS, response_format=rf, max_tokens=200,
                                            stream=True, **GREEDY))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == whole
    obj = c.chat.completions.create(model="x", messages=MSGS, response_format={"type": "json_object"},
                                    max_tokens=300, **GREEDY)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    cmpl = c.completions.create(model="x", prompt="JSON:", max_tokens=200, extra_body={"json_schema": SCHEMAS["list"]},
                                **GREEDY)
    _valid(cmpl.choices[0].text, SCHEMAS["list"])

    def one(i: int) -> None:
        name = list(SCHEMAS)[i % len(SCHEMAS)]
        events = sse_json(srv.stream("/completion", {"prompt": f"Item {i}:", "json_schema": SCHEMAS[name],
                                                     "n_predict": 200, "stream": True, "temperature": 1.0,
                                                     "seed": i}))
        assert events[-1]["stop_type"] == "eos"
        _valid("".join(e["content"] for e in events), SCHEMAS[name])

    with ThreadPoolExecutor(6) as ex:
        list(ex.map(one, range(6)))


BAD_STRUCTURED = [
    ({"grammar": "root ::= foo"}, "Undefined rule identifier 'foo'"),
    ({"grammar": 'root ::= "a" ('}, "expecting ')'"),
    ({"grammar": 5}, "\"grammar\" must be a string"),
    ({"json_schema": {"type": "foo"}}, "Unrecognized schema"),
    ({"json_schema": {"$ref": "#/definitions/nope"}}, "\"json_schema\""),
    ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "Cannot use both"),
    ({"response_format": {"type": "xml"}}, "response_format type"),
    ({"json_schema": {"type": "array", "uniqueItems": True}}, "keyword \"uniqueItems\" at / is not supported"),
    ({"json_schema": {"type": "object", "properties": {"x": {"type": "number", "maximum": 2}}}},
     "\"maximum\" at /properties/x is supported for integers only"),
    ({"json_schema": {"type": "integer", "minimum": 0, "maximum": 10**9}}, "too wide"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(("}}}},
     "response_format.json_schema.schema"),
]


@pytest.mark.parametrize("extra,msg", BAD_STRUCTURED, ids=[b[1][:24] for b in BAD_STRUCTURED])
def test_bad_grammar_or_schema_is_400_naming_the_problem(srv: ServerProc, extra: dict, msg: str) -> None:
    for path, body in (("/completion", {"prompt": "a"}), ("/v1/chat/completions", {"messages": MSGS})):
        status, r = srv.request("POST", path, {**body, **extra, "n_predict": 2})
        assert status == 400 and msg in r["error"]["message"], r
    good(srv)


# ---- logprobs: checked against a numpy softmax of logits from the independent numpy forward pass ----

@pytest.fixture(scope="module")
def f32_srv(make_tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:  # type: ignore[no-untyped-def]
    path = make_tiny("qwen3moe", "f32")
    s = ServerProc(path, "--parallel", "2", "-c", "1024", "-t", "1", "--chat-template", CHATML,
                   log_path=tmp_path_factory.mktemp("server") / "f32.log")
    s.model_path = path  # type: ignore[attr-defined]
    yield s
    s.stop()


def _ref_logprobs(path: Path, tokens: list[int]) -> np.ndarray:
    from reference.numpy_forward import forward  # noqa: PLC0415 - the numpy reference, only needed here

    x = forward(path, tokens).astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


LP_TOL = 0.02  # llama.cpp's f32 logits against numpy's float64 forward pass


def _check_against_reference(path: Path, prompt: list[int], gen: list[int], probs: list[dict], k: int,
                             greedy: bool) -> None:
    ref = _ref_logprobs(path, prompt + gen[:-1])
    assert [p["id"] for p in probs] == gen
    for i, p in enumerate(probs):
        row = ref[len(prompt) - 1 + i]
        assert abs(p["logprob"] - row[p["id"]]) < LP_TOL, (i, p["logprob"], row[p["id"]])
        top = p["top_logprobs"]
        assert len(top) == k and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        for t in top:
            assert abs(t["logprob"] - row[t["id"]]) < LP_TOL
            assert bytes(t["bytes"]).decode("utf-8", "ignore").startswith(t["token"])
        order = np.argsort(-row)
        if row[order[k - 1]] - row[order[k]] > 2 * LP_TOL:  # no near-tie at the cut: the same k tokens
            assert {t["id"] for t in top} == set(order[:k].tolist())
        if greedy:
            assert top[0]["id"] == p["id"]


def test_n_probs_native_against_numpy(f32_srv: ServerProc) -> None:
    path = f32_srv.model_path  # type: ignore[attr-defined]
    body = {"prompt": "The quick brown fox", "n_predict": 8, "ignore_eos": True, "n_probs": 5, "return_tokens": True}
    _, tok = f32_srv.request("POST", "/tokenize", {"content": body["prompt"], "add_special": True})
    for sampling, greedy in ((GREEDY, True), ({"temperature": 1.0, "seed": 5, "top_k": 0}, False)):
        status, r = f32_srv.request("POST", "/completion", {**body, **sampling})
        assert status == 200, r
        _check_against_reference(path, tok["tokens"], r["tokens"], r["completion_probabilities"], 5, greedy)
        events = sse_json(f32_srv.stream("/completion", {**body, **sampling, "stream": True}))
        streamed = [p for e in events for p in e.get("completion_probabilities", [])]
        assert [p["id"] for p in streamed] == r["tokens"]
        assert all(abs(a["logprob"] - b["logprob"]) < 1e-4 for a, b in zip(streamed, r["completion_probabilities"],
                                                                               strict=True))
    _, off = f32_srv.request("POST", "/completion", {**body, "n_probs": 0})
    assert "completion_probabilities" not in off


def test_openai_logprobs_chat_and_completions(f32_srv: ServerProc) -> None:
    path = f32_srv.model_path  # type: ignore[attr-defined]
    c = client(f32_srv)
    r = c.chat.completions.create(model="x", messages=MSGS, max_tokens=6, logprobs=True, top_logprobs=3,
                                  extra_body={"ignore_eos": True}, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(t.token for t in content) == r.choices[0].message.content
    _, rendered = f32_srv.request("POST", "/apply-template", {"messages": MSGS})
    _, tok = f32_srv.request("POST", "/tokenize", {"content": rendered["prompt"], "add_special": True})
    entries = [t.model_dump() for t in content]
    _check_against_reference(path, tok["tokens"], [t["id"] for t in entries], entries, 3, True)
    chunks = list(c.chat.completions.create(model="x", messages=MSGS, max_tokens=6, logprobs=True, top_logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True}, **GREEDY))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    plain = c.chat.completions.create(model="x", messages=MSGS, max_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None

    cm = c.completions.create(model="x", prompt="The quick brown fox", max_tokens=5, logprobs=2,
                              extra_body={"ignore_eos": True}, **GREEDY)
    lp = cm.choices[0].logprobs
    assert len(lp.tokens) == 5 and "".join(lp.tokens) == cm.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and top[token] == logprob  # greedy: the sampled token is the most likely
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        c.chat.completions.create(model="x", messages=MSGS, max_tokens=2, top_logprobs=3)


# ---- the chat page can be switched off (llama-server's --no-ui) ----

def test_no_ui_answers_404(tiny_qwen: Path, tmp_path: Path) -> None:
    s = ServerProc(tiny_qwen, "-t", "1", "-c", "1024", "--no-ui", log_path=tmp_path / "noui.log")
    try:
        for path in ("/", "/static/app.js"):
            assert s.request("GET", path)[0] == 404
        assert s.request("GET", "/health")[0] == 200
    finally:
        s.stop()


@pytest.mark.parametrize("allowed,origin,answer", [
    ("localhost", "http://localhost:8080", "http://localhost:8080"), ("localhost", "http://127.0.0.1", "http://127.0.0.1"),
    ("localhost", "http://localhost.evil.com", None), ("localhost", "http://evil.com", None),
    ("https://a.example,https://b.example", "http://evil.com", "https://a.example,https://b.example")])
def test_cors_origins(tiny_qwen: Path, tmp_path: Path, allowed: str, origin: str, answer: str | None) -> None:
    """--cors-origins as llama-server answers it (its test_security cases): "localhost" reflects a localhost Origin
    only, a list is sent as given; preflights and answers alike."""
    s = ServerProc(tiny_qwen, "-t", "1", "-c", "512", "--cors-origins", allowed, log_path=tmp_path / "cors.log")
    try:
        for method, path in (("OPTIONS", "/completions"), ("GET", "/health")):
            s.request(method, path, headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
            assert s.last_headers.get("access-control-allow-origin") == answer, (method, s.last_headers)
    finally:
        s.stop()


def test_two_final_assistant_messages_are_400(srv: ServerProc) -> None:
    """llama-server's rule (its test_invalid_chat_completion_req): two assistant messages at the end are a 400."""
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "assistant", "content": "c"}]
    status, r = srv.request("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    assert status == 400 and "2 or more assistant messages" in r["error"]["message"], r


def test_resumable_streams_are_refused_by_name(srv: ServerProc) -> None:
    """llama-server's resumable streams (X-Conversation-Id, GET /v1/stream) are not implemented: 501, named."""
    status, r = srv.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                             "max_tokens": 1}, headers={"X-Conversation-Id": "c1"})
    assert status == 501 and "X-Conversation-Id" in r["error"]["message"], r
    status, r = srv.request("GET", "/v1/stream?id=c1&from=0")
    assert status == 501 and "resumable streams" in r["error"]["message"], r


def test_vertex_ai_prediction_mode_is_refused_at_start(tiny_qwen: Path, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "rapidmoe.cli", "serve", str(tiny_qwen)], capture_output=True,
                       text=True, env={**os.environ, "AIP_MODE": "PREDICTION"}, timeout=120)
    assert r.returncode != 0 and "AIP_MODE=PREDICTION" in r.stderr, r.stderr
