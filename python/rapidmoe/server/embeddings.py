"""Embedding requests and answers in llama-server's shapes: `POST /v1/embeddings` (OpenAI's) and `/embedding`,
`/embeddings` (native, `content`), as the pinned server's `handle_embeddings_impl` reads and writes them.

Parsing, checks and JSON only; tokenizing and the engine's tickets are the routes', the numbers server/pooling.py's.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._runtime import llama_cpp as lc
from .errors import ApiError, exceed_context, invalid_request
from .pooling import can_split

DEFAULT_NORMALIZE = 2  # llama-server's --embd-normalize default: euclidean
MAX_INPUTS = 2048  # prompts per request, OpenAI's limit (llama-server has none)


def not_enabled() -> ApiError:
    return ApiError(501, "not_supported_error", "This server does not support embeddings. Start it with "
                                                "`--embeddings`")


def rerank_refused() -> ApiError:
    """Reranking reads a classification head's score (llama.cpp's rank pooling); the MoE language models this
    server runs have none, so it is not implemented: llama-server's 501 for a server without --reranking."""
    return ApiError(501, "not_supported_error", "This server does not support reranking (llama-server's "
                                                "`--reranking`, which needs a model with a classification head)")


@dataclass(frozen=True)
class EmbeddingRequest:
    entries: list[Any]  # one per prompt, as given: text, token ids, ids mixed with text, {"prompt_string": ...}
    # or {"content": [text parts]}
    oai: bool  # answer in OpenAI's shape (the OpenAI route with `input`; `content` always answers natively)
    use_base64: bool  # encoding_format "base64": each vector as its float32 bytes in base64
    normalize: int  # embd_normalize for pooled vectors (pooling.normalize)
    name: str  # the field the prompts came in: "input" or "content"
    several: bool  # the field held a list of prompts (named name[i] in errors)


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse(body: dict[str, Any], *, oai_route: bool, pooling: int, default_normalize: int) -> EmbeddingRequest:
    """The request's prompts and options, in llama-server's order of checks."""
    if oai_route and pooling == lc.LLAMA_POOLING_TYPE_NONE:
        raise invalid_request("Pooling type 'none' is not OAI compatible. Please use a different pooling type")
    oai = oai_route
    if "input" in body:
        prompt = body["input"]
    elif "content" in body:
        oai, prompt = False, body["content"]  # "content" is not OpenAI's: the native answer
    else:
        raise invalid_request("\"input\" or \"content\" must be provided")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise invalid_request("The format to return the embeddings in. Can be either float or base64")
    name = "input" if "input" in body else "content"
    several = isinstance(prompt, list) and not any(_is_id(x) for x in prompt)
    if several:
        entries = list(prompt)  # several prompts
    else:
        entries = [prompt]  # one: text, token ids, ids mixed with text, or an object
    if not entries:
        raise invalid_request("\"input\" must not be empty")
    if len(entries) > MAX_INPUTS:
        raise invalid_request(f"\"input\" has {len(entries)} prompts; at most {MAX_INPUTS} per request")
    normalize = body.get("embd_normalize", default_normalize)
    if not _is_id(normalize) or normalize < -1:
        raise invalid_request("\"embd_normalize\" must be an integer >= -1 (-1 none, 0 max absolute, 1 taxicab, "
                              "2 euclidean, p > 2 the p-norm)")
    return EmbeddingRequest(entries, oai, fmt == "base64", normalize, name, several)


def content_text(content: Any, name: str) -> str:
    """OpenAI's content array of an entry (`{"content": [{"type": "text", "text": ...}, ...]}`): its texts
    joined, as llama-server's tokenize_oai_content_array. Media parts need a multimodal projector, which this
    server does not load."""
    if not isinstance(content, list):
        raise invalid_request(f"\"{name}\" must be an array")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image_url", "input_audio", "input_video"):
            raise invalid_request(f"\"{name}[{i}]\": {kind} needs a multimodal model; this server has none")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise invalid_request(f"\"{name}[{i}]\" must be {{\"type\": \"text\", \"text\": \"...\"}}")
        texts.append(part["text"])
    return "".join(texts)


def check_fits(n_prompt: int, *, pooling: int, n_ubatch: int, n_ctx_slot: int) -> None:
    """llama-server's checks of one embedding prompt against the batch and a slot's context. Pooling that needs
    the whole prompt in one ubatch refuses a longer one (llama-server: 500; here 400, the request is at fault)."""
    if n_prompt == 0:
        raise invalid_request("Input content cannot be empty")
    if not can_split(pooling):
        if n_prompt > n_ubatch:
            raise invalid_request(f"input ({n_prompt} tokens) is too large to process. increase the physical batch "
                                  f"size (current batch size: {n_ubatch})")
        if n_prompt > n_ctx_slot:
            raise ApiError(400, "exceed_context_size_error", f"input ({n_prompt} tokens) is larger than the max "
                           f"context size ({n_ctx_slot} tokens). skipping", n_prompt_tokens=n_prompt,
                           n_ctx=n_ctx_slot)
    elif n_prompt >= n_ctx_slot:
        raise exceed_context(n_prompt, n_ctx_slot)


def _b64(v: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")


def oai_answer(model: str, vectors: list[np.ndarray], n_prompts: list[int], use_base64: bool) -> dict[str, Any]:
    """OpenAI's embeddings list: one pooled vector per prompt, in order, and the prompt tokens as usage."""
    data = []
    for i, v in enumerate(vectors):
        item: dict[str, Any] = {"embedding": _b64(v[0]) if use_base64 else v[0].tolist(), "index": i,
                                "object": "embedding"}
        if use_base64:
            item["encoding_format"] = "base64"
        data.append(item)
    n = sum(n_prompts)
    return {"model": model, "object": "list", "usage": {"prompt_tokens": n, "total_tokens": n}, "data": data}


def native_answer(vectors: list[np.ndarray]) -> list[dict[str, Any]]:
    """llama-server's native answer: per prompt its index and a list of vectors (one pooled, or one per token)."""
    return [{"index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]
