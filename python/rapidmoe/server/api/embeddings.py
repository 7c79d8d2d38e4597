"""The embedding routes (/v1/embeddings, /embedding, /embeddings) and the refused reranking ones.

server/embeddings.py parses the request and shapes the answer; the vectors are the engine's embedding tickets.
"""
from __future__ import annotations

from typing import Any

from .. import embeddings
from ..engine import Embedded, Failed, QueueFull
from ..errors import invalid_request, unavailable
from ..params import check_utf8
from .serving import AppState, Reply, Request, json_reply, next_event, one_prompt, raise_failed, tokenize_text


def _embedding_tokens(st: AppState, entry: Any, name: str) -> list[int]:
    if isinstance(entry, dict) and "content" in entry:
        return tokenize_text(st, check_utf8(embeddings.content_text(entry["content"], f"{name}.content"), name),
                             st.add_bos)
    return one_prompt(st, entry, name)


def _embeddings(st: AppState, req: Request, oai_route: bool) -> Reply:
    """POST /v1/embeddings and /embedding(s): one embedding ticket per prompt, answered when all are done."""
    e = st.engine
    assert e is not None
    if not e.embeddings:
        raise embeddings.not_enabled()
    body = req.json()
    model = st.check_model(body)
    er = embeddings.parse(body, oai_route=oai_route, pooling=e.pooling, default_normalize=st.config.embd_normalize)
    prompts = [_embedding_tokens(st, x, f"{er.name}[{i}]" if er.several else er.name)
               for i, x in enumerate(er.entries)]
    for toks in prompts:
        embeddings.check_fits(len(toks), pooling=e.pooling, n_ubatch=e.n_ubatch, n_ctx_slot=e.n_ctx_slot)
    if e.capacity is not None and len(prompts) > e.capacity:
        raise invalid_request(f"the request has {len(prompts)} inputs; this server holds at most {e.capacity} at "
                              f"once (--parallel {e.n_parallel} + --queue-size {e.queue_size})")
    try:
        ts = e.submit_embeddings(prompts, er.normalize)
    except QueueFull as err:
        raise unavailable(f"server busy: {err}") from None
    done: dict[int, Embedded] = {}
    while len(done) < len(ts):
        got = next_event(st, ts, req)
        if got is None:
            return Reply(499, b"")
        i, ev = got
        if isinstance(ev, Failed):
            raise_failed(st, ts, ev)
        assert isinstance(ev, Embedded)
        done[i] = ev
    vectors = [done[i].vectors for i in range(len(ts))]
    if er.oai:
        return json_reply(embeddings.oai_answer(model, vectors, [done[i].n_prompt for i in range(len(ts))],
                                                er.use_base64))
    return json_reply(embeddings.native_answer(vectors))


def embeddings_native(st: AppState, req: Request) -> Reply:
    """POST /embedding, /embeddings: llama-server's shape (a list of {index, embedding: [vectors]})."""
    return _embeddings(st, req, oai_route=False)


def embeddings_oai(st: AppState, req: Request) -> Reply:
    """POST /v1/embeddings: OpenAI's shape (with `content` instead of `input`, the native one, as llama-server)."""
    return _embeddings(st, req, oai_route=True)


def rerank(st: AppState, req: Request) -> Reply:
    """POST /rerank (and llama-server's other names for it): not implemented, refused with llama-server's status
    for a server without --reranking (501)."""
    raise embeddings.rerank_refused()
