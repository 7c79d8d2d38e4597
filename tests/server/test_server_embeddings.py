"""Embeddings (`serve --embedding`): /v1/embeddings, /embedding, /embeddings against independent references.

References: the numpy forward pass of the same F32 GGUF (tests/reference/numpy_forward.py: the last hidden states
after the output norm, which llama.cpp pools), llama-server's normalisation written again here in numpy, and
llama-cpp-python's `Llama.embed` over STOCK libllama of the same pin on the same model. The `openai` client is the
real OpenAI client. Bad requests: a 4xx naming the problem, never a 500.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reference.numpy_forward import hidden
from server_proc import ServerProc
from testkit import GREEDY, ROOT

TEXTS = ["I believe the meaning of life is", "Mixture of experts route each token", "a"]


@pytest.fixture(scope="module")
def f32(make_tiny: Callable[..., Path]) -> Path:
    return make_tiny("qwen3moe", "f32")


@pytest.fixture(scope="module")
def servers(f32: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProc]]:
    """server(pooling, *flags): one server per flag set, started on first use and kept for the module."""
    started: dict[tuple[str, ...], ServerProc] = {}
    logs = tmp_path_factory.mktemp("server")

    def get(*flags: str) -> ServerProc:
        if flags not in started:
            started[flags] = ServerProc(f32, "--parallel", "2", "-c", "1024", "-b", "64", "-t", "1",
                                        *flags, log_path=logs / f"embd{len(started)}.log")
        return started[flags]

    yield get
    for s in started.values():
        s.stop()


def _tokens(s: ServerProc, text: str) -> list[int]:
    status, r = s.request("POST", "/tokenize", {"content": text, "add_special": True})
    assert status == 200, r
    return list(r["tokens"])


def _ok(s: ServerProc, path: str, body: dict[str, Any]) -> Any:
    status, r = s.request("POST", path, body)
    assert status == 200, r
    return r


def _pool(h: np.ndarray, pooling: str) -> np.ndarray:
    return {"mean": h.mean(0), "cls": h[0], "last": h[-1]}[pooling]


def _normalize(v: np.ndarray, p: int) -> np.ndarray:
    """common_embd_normalize, written again."""
    if p == -1:
        return v
    if p == 0:
        return v * 32760.0 / np.abs(v).max()
    return v / (np.abs(v) ** p).sum() ** (1.0 / p)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_pooled_embeddings_match_numpy(servers: Callable[..., ServerProc], f32: Path, pooling: str) -> None:
    """/v1/embeddings with several inputs: each vector is the numpy pooling of the model's last hidden states,
    unit length; usage counts every prompt token."""
    s = servers("--embedding", "--pooling", pooling)
    r = _ok(s, "/v1/embeddings", {"input": TEXTS})
    assert [d["index"] for d in r["data"]] == [0, 1, 2] and r["object"] == "list"
    n_tokens = 0
    for text, d in zip(TEXTS, r["data"], strict=True):
        toks = _tokens(s, text)
        n_tokens += len(toks)
        ref = _normalize(_pool(hidden(f32, toks), pooling), 2)
        got = np.asarray(d["embedding"])
        assert d["object"] == "embedding" and got.shape == ref.shape
        assert np.abs(got - ref).max() < 1e-3, (text, np.abs(got - ref).max())
        assert abs(np.linalg.norm(got) - 1) < 1e-5
    assert r["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}


def test_pooling_none_gives_raw_vectors_per_token(servers: Callable[..., ServerProc], f32: Path) -> None:
    """/embedding with pooling none: one unnormalised vector per prompt token, the numpy hidden states; OpenAI's
    route refuses pooling none (400), as llama-server."""
    s = servers("--embedding", "--pooling", "none")
    toks = _tokens(s, TEXTS[0])
    r = _ok(s, "/embedding", {"content": TEXTS[0]})
    got, ref = np.asarray(r[0]["embedding"]), hidden(f32, toks)
    assert r[0]["index"] == 0 and got.shape == ref.shape == (len(toks), ref.shape[1])
    assert np.abs(got - ref).max() < 2e-3 * np.abs(ref).max()
    status, err = s.request("POST", "/v1/embeddings", {"input": TEXTS[0]})
    assert status == 400 and "Pooling type 'none' is not OAI compatible" in err["error"]["message"]


@pytest.mark.parametrize("p", [-1, 0, 1, 2, 3])
def test_embd_normalize(servers: Callable[..., ServerProc], f32: Path, p: int) -> None:
    """`embd_normalize` per request: none, max absolute in int16's range, taxicab, euclidean, a p-norm."""
    s = servers("--embedding", "--pooling", "mean")
    toks = _tokens(s, TEXTS[1])
    got = np.asarray(_ok(s, "/embeddings", {"content": TEXTS[1], "embd_normalize": p})[0]["embedding"][0])
    ref = _normalize(hidden(f32, toks).mean(0), p)
    assert np.abs(got - ref).max() < 1e-3 * np.abs(ref).max(), np.abs(got - ref).max()


def test_server_default_normalization(servers: Callable[..., ServerProc], f32: Path) -> None:
    s = servers("--embedding", "--pooling", "mean", "--embd-normalize", "-1")
    toks = _tokens(s, TEXTS[0])
    got = np.asarray(_ok(s, "/v1/embeddings", {"input": TEXTS[0]})["data"][0]["embedding"])
    ref = hidden(f32, toks).mean(0)
    assert np.abs(got - ref).max() < 1e-3 * np.abs(ref).max()


def test_input_shapes(servers: Callable[..., ServerProc]) -> None:
    """llama-server's prompt forms: token ids, ids mixed with text (one prompt), several prompts, prompt_string
    objects and OpenAI content arrays (their texts joined) give the vectors of the same tokens."""
    s = servers("--embedding", "--pooling", "mean")
    toks = _tokens(s, "hello world")

    def vecs(inp: Any) -> list[list[float]]:
        return [d["embedding"] for d in _ok(s, "/v1/embeddings", {"input": inp})["data"]]

    ref = vecs("hello world")[0]
    same = vecs([toks, {"prompt_string": "hello world"},
                 {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}])
    assert len(same) == 3
    for v in same:
        assert np.abs(np.asarray(v) - ref).max() < 1e-5
    assert len(vecs([*toks[:1], "x", 12])) == 1  # ids mixed with text: one prompt
    assert len(vecs(["a", [12, 34]])) == 2


def test_same_prompt_same_vector_and_base64(servers: Callable[..., ServerProc]) -> None:
    s = servers("--embedding", "--pooling", "last")
    r = _ok(s, "/v1/embeddings", {"input": [TEXTS[0]] * 5})
    vs = np.asarray([d["embedding"] for d in r["data"]])
    assert np.abs(vs - vs[0]).max() < 1e-5
    b = _ok(s, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})["data"][0]
    assert b["encoding_format"] == "base64"
    decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
    assert decoded.shape == vs[0].shape and np.abs(decoded - vs[0]).max() < 1e-5


def test_openai_client(servers: Callable[..., ServerProc], f32: Path) -> None:
    """The real `openai` client (it asks for base64 and decodes it) gets the numpy vectors."""
    openai = pytest.importorskip("openai")
    s = servers("--embedding", "--pooling", "mean")
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none")
    one = client.embeddings.create(model="text-embedding-3-small", input=TEXTS[0])
    many = client.embeddings.create(model="text-embedding-3-small", input=TEXTS)
    assert len(one.data) == 1 and len(many.data) == 3
    for text, d in zip(TEXTS, many.data, strict=True):
        ref = _normalize(hidden(f32, _tokens(s, text)).mean(0), 2)
        assert np.abs(np.asarray(d.embedding) - ref).max() < 1e-3
    assert np.abs(np.asarray(one.data[0].embedding) - np.asarray(many.data[0].embedding)).max() < 1e-5
    assert many.usage.prompt_tokens == sum(len(_tokens(s, t)) for t in TEXTS)


def test_generation_still_works_beside_embeddings(servers: Callable[..., ServerProc]) -> None:
    """Embedding steps and generation steps alternate: an embedding during a long generation equals the one
    computed alone, and the generation equals the same request run with no embedding beside it."""
    s = servers("--embedding", "--pooling", "mean")
    body = {"prompt": "Once upon a time", "n_predict": 48, "ignore_eos": True, "cache_prompt": False, **GREEDY}
    alone = _ok(s, "/completion", body)["content"]
    ref = _ok(s, "/v1/embeddings", {"input": TEXTS[0]})["data"][0]["embedding"]
    out: dict[str, Any] = {}
    gen = threading.Thread(target=lambda: out.update(r=_ok(s, "/completion", body)))
    gen.start()
    during = [_ok(s, "/v1/embeddings", {"input": TEXTS[0]})["data"][0]["embedding"] for _ in range(3)]
    gen.join()
    assert out["r"]["content"] == alone
    for v in during:
        assert np.abs(np.asarray(v) - ref).max() < 1e-5


def test_prefix_cache_after_an_embedding(servers: Callable[..., ServerProc]) -> None:
    """An embedding leaves its prompt's KV in the slot, computed by the same forward pass: a completion that reuses
    it as a cached prefix answers as one evaluated from scratch."""
    s = servers("--embedding", "--pooling", "mean", "--parallel", "1")
    text = "Once upon a time there was a little"
    body = {"prompt": text + " dog", "n_predict": 12, "ignore_eos": True, **GREEDY}
    fresh = _ok(s, "/completion", {**body, "cache_prompt": False})["content"]
    _ok(s, "/v1/embeddings", {"input": text})
    cached = _ok(s, "/completion", body)
    assert cached["timings"]["cache_n"] >= len(_tokens(s, text)) - 1
    assert cached["content"] == fresh


BAD = [
    ("/v1/embeddings", {}, 400, '"input" or "content" must be provided'),
    ("/v1/embeddings", {"input": []}, 400, '"input" must not be empty'),
    ("/v1/embeddings", {"input": {"content": "string"}}, 400, "must be an array"),
    ("/v1/embeddings", {"input": {"content": [{"type": "unknown"}]}}, 400, '"type": "text"'),
    ("/v1/embeddings", {"input": {"content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}}, 400,
     "multimodal"),
    ("/v1/embeddings", {"input": {"content": [{"type": "input_audio", "input_audio": {}}]}}, 400, "multimodal"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, 400, "either float or base64"),
    ("/v1/embeddings", {"input": "a", "embd_normalize": "x"}, 400, "embd_normalize"),
    ("/v1/embeddings", {"input": [1, 10 ** 9]}, 400, "out of range"),
    ("/v1/embeddings", {"input": ["a", 5.5]}, 400, "input[1]"),
    ("/v1/embeddings", {"input": "word " * 100}, 400, "too large to process"),  # mean: one ubatch (-b 64)
    ("/embedding", {"content": None}, 400, '"content"'),
    ("/v1/embeddings", {"input": "a", "model": 5}, 400, '"model" must be a string'),
    ("/v1/embeddings", {"input": ["a"] * 2049}, 400, "at most 2048 per request"),
    ("/v1/embeddings", {"input": None}, 400, '"input"'),
    ("/v1/embeddings", {"input": [[]]}, 400, '"input[0]"'),
]


@pytest.mark.parametrize("path,body,status,msg", BAD, ids=[b[3] for b in BAD])
def test_bad_requests(servers: Callable[..., ServerProc], path: str, body: dict[str, Any], status: int,
                      msg: str) -> None:
    s = servers("--embedding", "--pooling", "mean")
    got, r = s.request("POST", path, body)
    assert got == status and msg in r["error"]["message"], r
    assert not any(x["is_processing"] for x in s.request("GET", "/slots")[1])


def test_last_pooling_splits_long_prompts_up_to_the_context(servers: Callable[..., ServerProc], f32: Path) -> None:
    """Last-token pooling may span several batches (llama-server's can_split): a prompt longer than the batch
    embeds, and equals numpy; one that fills the slot's context is a 400 exceed_context_size_error."""
    s = servers("--embedding", "--pooling", "last")
    text = "word " * 100  # > -b 64 tokens
    toks = _tokens(s, text)
    assert len(toks) > 64
    got = np.asarray(_ok(s, "/v1/embeddings", {"input": text})["data"][0]["embedding"])
    assert np.abs(got - _normalize(hidden(f32, toks)[-1], 2)).max() < 1e-3
    status, r = s.request("POST", "/v1/embeddings", {"input": "word " * 600})
    assert status == 400 and r["error"]["type"] == "exceed_context_size_error", r


def test_refused_without_the_flag(servers: Callable[..., ServerProc]) -> None:
    """Without --embedding every embedding route is llama-server's 501 naming the flag."""
    s = servers()
    for path in ("/v1/embeddings", "/embedding", "/embeddings"):
        status, r = s.request("POST", path, {"input": "a"})
        assert status == 501 and r["error"]["type"] == "not_supported_error", r
        assert "Start it with `--embeddings`" in r["error"]["message"]


def test_reranking_is_refused_by_name(servers: Callable[..., ServerProc], f32: Path) -> None:
    """Reranking (a classification head's score) is not implemented: its routes answer 501 naming it, as
    llama-server without --reranking; --pooling rank is refused at start."""
    s = servers("--embedding", "--pooling", "mean")
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        status, r = s.request("POST", path, {"query": "a", "documents": ["b"]})
        assert status == 501 and "reranking" in r["error"]["message"], r
    r = subprocess.run([sys.executable, "-m", "rapidmoe.cli", "serve", str(f32), "--port", "0", "--embedding",
                        "--pooling", "rank"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--pooling rank" in r.stdout + r.stderr


STOCK_SCRIPT = """
import json, sys, llama_cpp
pooling = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "last": llama_cpp.LLAMA_POOLING_TYPE_LAST,
           "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS}[sys.argv[2]]
m = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, n_batch=512, n_threads=1, embedding=True,
                    pooling_type=pooling, verbose=False)
out = [m.embed(t, normalize=True) for t in json.loads(sys.argv[3])]
print(json.dumps({"lib": str(llama_cpp.llama_cpp._lib._name), "vectors": out}))
"""


@pytest.mark.stock
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_match_stock_llama_cpp(servers: Callable[..., ServerProc], f32: Path, stock_bin: Path, pooling: str) -> None:
    """The same model's embeddings through llama-cpp-python over STOCK libllama (its `embed`, normalised)."""
    s = servers("--embedding", "--pooling", pooling)
    ours = np.asarray([d["embedding"] for d in _ok(s, "/v1/embeddings", {"input": TEXTS})["data"]])
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(stock_bin), PYTHONPATH=str(ROOT / "vendor" / "llama_cpp_py"))
    res = subprocess.run([sys.executable, "-c", STOCK_SCRIPT, str(f32), pooling, json.dumps(TEXTS)], env=env,
                         capture_output=True, text=True, check=True, cwd=ROOT / "vendor")
    stock = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(stock["lib"]).resolve().parent == stock_bin.resolve()  # really the stock library
    theirs = np.asarray(stock["vectors"])
    assert theirs.shape == ours.shape
    assert np.abs(ours - theirs).max() < 1e-4, np.abs(ours - theirs).max()
