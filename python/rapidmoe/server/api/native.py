"""llama-server's native routes: /completion (and /infill, laid out by server/infill.py), /health, /models,
/props, /slots, /metrics, and the routes of llama-server features not implemented here (refused with its status).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ..._runtime import llama_cpp as lc
from .. import infill as fill
from .. import metrics, responses, sse
from ..engine import Chunk, Event, Finished
from ..errors import ApiError, unavailable
from ..params import SEED_RANDOM, GenerationParams, SamplingParams, native_output
from . import serving
from .serving import AppState, Job, Reply, Request, Stream, json_reply


def health(st: AppState, req: Request) -> Reply:
    return json_reply({"status": "ok"})


def models(st: AppState, req: Request) -> Reply:
    c = st.config
    data = {"id": c.model_id, "aliases": sorted(set(c.aliases)), "tags": list(c.tags), "object": "model",
            "created": int(time.time()), "owned_by": "llamacpp", "meta": st.model_meta}
    return json_reply({"models": [{"name": c.model_id, "model": c.model_id, "modified_at": "", "size": "",
                                   "digest": "", "type": "model", "description": "", "tags": [""],
                                   "capabilities": ["completion"], "parameters": "",
                                   "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                                               "parameter_size": "", "quantization_level": ""}}],
                       "object": "list", "data": [data]})


def _settings(st: AppState, p: GenerationParams, n_ctx: int, model: str, stream: bool) -> dict[str, Any]:
    return {"n_predict": p.n_predict, "max_tokens": p.n_predict, "stop": list(p.stop), "ignore_eos": p.ignore_eos,
            "stream": stream, "n_ctx": n_ctx, "model": model, **p.sampling.to_json()}


def completion(st: AppState, req: Request) -> Reply | Stream:
    """POST /completion: llama-server's native endpoint. Several prompts (or `n` > 1) answer a list of results,
    one per choice, each with its `index`; one answers the object itself."""
    return _native(st, req, req.json())


def _native(st: AppState, req: Request, body: dict[str, Any]) -> Reply | Stream:
    assert st.engine is not None
    engine = st.engine
    c = serving.completion_request(st, body, route="native")
    model, params, jobs = c.model, c.params, c.jobs
    opts = native_output(body)
    meta = responses.Meta.new(model, st.fingerprint, return_tokens=opts.return_tokens,
                              timings_per_token=opts.timings_per_token, logprobs=params.n_probs >= 0)

    def prompt_text(job: Job) -> str:
        if isinstance(job.prompt, str):
            return job.prompt
        return engine.llm.detokenize(job.toks, special=True).decode("utf-8", "replace")  # as llama-server shows it

    def final(i: int, fin: Finished, text: str, streamed: bool) -> dict[str, Any]:
        settings = _settings(st, jobs[i].params, engine.n_ctx_slot, model, streamed)
        return responses.native_final(meta, fin, text, prompt_text(jobs[i]), settings, streamed, i)

    ts = serving.submit(st, jobs)
    if not opts.stream:
        def whole(got: list[tuple[str, Finished]]) -> Any:
            out = [responses.pick_fields(final(i, fin, text, False), opts.response_fields)
                   for i, (text, fin) in enumerate(got)]
            return out[0] if len(out) == 1 else out
        return serving.whole_answer(st, ts, req, whole)

    def fmt(i: int, ev: Event, first: bool) -> list[bytes]:
        n_prompt = len(jobs[i].toks)
        if isinstance(ev, Chunk):
            return [sse.event(responses.native_partial(meta, ev, n_prompt, -1, i))]
        assert isinstance(ev, Finished)
        out = []
        if ev.text:
            out.append(sse.event(responses.native_partial(meta, Chunk(ev.text, [], ev.n_decoded,
                                                                      probs=ev.tail_probs), n_prompt, ev.id_slot, i)))
        out.append(sse.event(final(i, ev, "", True)))
        return out

    return serving.streamed_answer(st, ts, req, fmt, done=False)


def infill(st: AppState, req: Request) -> Reply | Stream:
    """POST /infill: fill-in-the-middle as llama-server does it (infill.py lays out the prompt), then generation and
    answer as /completion; a model without FIM tokens answers 501, as llama-server."""
    assert st.engine is not None
    vocab = st.engine.llm.vocab
    fim = fill.FimTokens(*(int(f(vocab)) for f in (lc.llama_vocab_fim_pre, lc.llama_vocab_fim_suf,
                                                    lc.llama_vocab_fim_mid, lc.llama_vocab_fim_rep,
                                                    lc.llama_vocab_fim_sep)))
    if fim.missing():
        raise ApiError(501, "not_supported_error", f"Infill is not supported by this model: {fim.missing()}")
    body = req.json()
    extra = fill.check_fields(body)
    add_bos = bool(lc.llama_vocab_get_add_bos(vocab))
    toks = fill.infill_prompt(fim, lambda text, special: serving.tokenize_text(st, text, False, special), body, extra,
                              n_batch=st.config.n_batch, n_predict=st.config.n_predict, n_ctx=st.engine.n_ctx_slot,
                              bos=int(lc.llama_vocab_bos(vocab)) if add_bos else None)
    rest = {k: v for k, v in body.items() if k not in ("input_prefix", "input_suffix", "input_extra")}
    return _native(st, req, {**rest, "prompt": toks})


def props(st: AppState, req: Request) -> Reply:
    assert st.engine is not None
    c = st.config
    default = GenerationParams(n_predict=c.n_predict, sampling=SamplingParams(
        temperature=c.temperature, seed=SEED_RANDOM if c.seed == -1 else c.seed))
    settings = st.engine.slot_state(st.engine.slots[0])
    settings["params"] = _settings(st, default, st.engine.n_ctx_slot, c.model_id, False)
    settings["params"].pop("n_ctx")
    settings["params"].pop("model")
    return json_reply({
        "default_generation_settings": settings,
        "total_slots": st.engine.n_parallel,
        "model_alias": c.model_id,
        "model_path": str(c.model),
        "chat_template": st.template.source if st.template else "",
        "chat_template_caps": {},
        "modalities": {"vision": False, "audio": False},
        "build_info": st.fingerprint,
        "is_sleeping": False,
        "rapidmoe": {"residual": str(c.residual) if c.residual else None, "n_critical": c.n_critical,
                     "policy": str(c.policy) if c.policy else None},
    })


def slots(st: AppState, req: Request) -> Reply:
    if not st.config.slots:
        raise ApiError(501, "not_supported_error", "This server does not support slots endpoint.")
    assert st.engine is not None
    states = [st.engine.slot_state(s) for s in st.engine.slots]
    if "fail_on_no_slot=1" in req.path and all(s["is_processing"] for s in states):
        raise unavailable("no slot available")
    return json_reply(states)


def get_metrics(st: AppState, req: Request) -> Reply:
    if not st.config.metrics:
        raise ApiError(501, "not_supported_error", "This server does not support metrics endpoint.")
    e = st.engine
    assert e is not None
    snap = e.call(lambda: metrics.snapshot(e.llm))
    text = metrics.render(e.stats, snap, st.requests.snapshot(), e.n_busy, e.n_waiting,
                          getattr(e.llm, "residual", None) is not None)
    return Reply(200, text.encode(), "text/plain; version=0.0.4",
                 headers={"Process-Start-Time-Unix": str(int(st.started))})


def feature_disabled(feature: str) -> Callable[[AppState, Request], Reply]:
    """llama-server's answer on a route whose feature its flags leave off (403 "feature_disabled"): here the feature
    is not implemented, and its flag is refused."""
    def refuse(st: AppState, req: Request) -> Reply:
        raise ApiError(403, "feature_disabled", f"this feature is disabled: {feature} is not supported by this server")
    return refuse


def resumable_stream(st: AppState, req: Request) -> Reply:
    """GET /v1/stream: llama-server's resumable streams are not implemented (501, named)."""
    raise ApiError(501, "not_supported_error", "resumable streams (the X-Conversation-Id header, /v1/stream) are "
                   "not supported by this server")


def model_meta(llm: Any, path: str) -> dict[str, Any]:
    """/v1/models `meta`, from the loaded model."""
    m = llm.model
    return {"vocab_type": int(lc.llama_vocab_type(llm.vocab)), "n_vocab": int(llm.n_vocab()),
            "n_ctx_train": int(lc.llama_model_n_ctx_train(m)), "n_embd": int(lc.llama_model_n_embd(m)),
            "n_params": int(lc.llama_model_n_params(m)), "size": os.path.getsize(path)}
