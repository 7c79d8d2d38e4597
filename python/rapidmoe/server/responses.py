"""Response bodies in llama-server's shapes: native /completion, OpenAI completions and chat (whole and chunks).

Built from the engine's events; these functions only arrange fields (see server-task.cpp upstream).
"""
from __future__ import annotations

import secrets
import string
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .engine import Chunk, Finished, TokenProb
from .toolcalls import Delta, ToolCall

_ALNUM = string.ascii_letters + string.digits


def completion_id() -> str:
    return "chatcmpl-" + "".join(secrets.choice(_ALNUM) for _ in range(32))


@dataclass(frozen=True)
class Meta:
    """What every response of one request repeats."""

    id: str
    model: str
    fingerprint: str
    created: int
    return_tokens: bool
    include_usage: bool = False
    timings_per_token: bool = False  # llama-server's: `timings` in every streamed chunk
    logprobs: bool = False  # the request asked for token probabilities

    @classmethod
    def new(cls, model: str, fingerprint: str, return_tokens: bool = False, include_usage: bool = False,
            timings_per_token: bool = False, logprobs: bool = False) -> Meta:
        return cls(completion_id(), model, fingerprint, int(time.time()), return_tokens, include_usage,
                   timings_per_token, logprobs)

    def add_timings(self, obj: dict[str, Any], c: Chunk) -> dict[str, Any]:
        if self.timings_per_token and c.timings is not None:
            obj["timings"] = c.timings.to_json()
        return obj


def finish_reason(f: Finished) -> str:
    return "stop" if f.stop_type in ("eos", "word") else "length"


def usage(fins: list[Finished]) -> dict[str, Any]:
    """OpenAI `usage`, summed over the choices (each choice evaluated its prompt: a prompt with n completions
    counts n times, `cached_tokens` says how much of that came from the slots' KV)."""
    n_decoded, n_prompt = sum(f.n_decoded for f in fins), sum(f.n_prompt for f in fins)
    return {"completion_tokens": n_decoded, "prompt_tokens": n_prompt, "total_tokens": n_decoded + n_prompt,
            "prompt_tokens_details": {"cached_tokens": sum(f.n_cached for f in fins)}}


def merged(answers: list[dict[str, Any]], fins: list[Finished]) -> dict[str, Any]:
    """One OpenAI answer from one per choice (as llama-server merges them): the first one's fields and timings,
    every choice in index order, usage summed."""
    out = answers[0]
    out["choices"] = [c for a in answers for c in a["choices"]]
    out["usage"] = usage(fins)
    return out


# ---- token probabilities ----

def piece_text(piece: bytes) -> str:
    """A token's text as llama-server sends it: the longest valid UTF-8 prefix (a piece may end inside a
    character)."""
    for cut in range(min(4, len(piece)) + 1):
        try:
            return piece[:len(piece) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return piece.decode("utf-8", "replace")


def probs_json(probs: list[TokenProb]) -> list[dict[str, Any]]:
    """llama-server's `completion_probabilities` / OpenAI's `logprobs.content` entries."""
    return [{"id": p.id, "token": piece_text(p.piece), "bytes": list(p.piece), "logprob": p.logprob,
             "top_logprobs": [{"id": i, "token": piece_text(b), "bytes": list(b), "logprob": lp}
                              for i, b, lp in p.top]} for p in probs]


def oai_cmpl_logprobs(probs: list[TokenProb], with_offsets: bool) -> dict[str, Any]:
    """/v1/completions: llama-server's `content` list and OpenAI's legacy fields (tokens, token_logprobs,
    top_logprobs as {token: logprob}, text_offset within the generated text)."""
    out: dict[str, Any] = {"content": probs_json(probs), "tokens": [piece_text(p.piece) for p in probs],
                           "token_logprobs": [p.logprob for p in probs],
                           "top_logprobs": [{piece_text(b): lp for _, b, lp in p.top} for p in probs]}
    if with_offsets:
        offsets, n = [], 0
        for p in probs:
            offsets.append(n)
            n += len(piece_text(p.piece))
        out["text_offset"] = offsets
    return out


# ---- native /completion ----

def native_partial(m: Meta, c: Chunk, n_prompt: int, id_slot: int, index: int = 0) -> dict[str, Any]:
    out = {"index": index, "content": c.text, "tokens": c.tokens, "stop": False, "id_slot": id_slot,
           "tokens_predicted": c.n_decoded, "tokens_evaluated": n_prompt}
    if m.logprobs and c.probs:
        out["completion_probabilities"] = probs_json(c.probs)
    return m.add_timings(out, c)


def native_final(m: Meta, f: Finished, content: str, prompt: str, settings: dict[str, Any],
                 stream: bool, index: int = 0) -> dict[str, Any]:
    out = {
        "index": index, "content": content,
        "tokens": f.tokens if (m.return_tokens and not stream) else [],
        "id_slot": f.id_slot, "stop": True, "model": m.model,
        "tokens_predicted": f.n_decoded, "tokens_evaluated": f.n_prompt,
        "generation_settings": settings, "prompt": prompt,
        "has_new_line": "\n" in content, "truncated": f.truncated,
        "stop_type": f.stop_type, "stopping_word": f.stopping_word, "tokens_cached": f.tokens_cached,
        "timings": f.timings.to_json(),
    }
    if m.logprobs and not stream:
        out["completion_probabilities"] = probs_json(f.probs)
    return out


def pick_fields(res: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """llama-server's `response_fields`: only these fields, a path `a/b` answered under the key "a/b"; missing
    ones left out without an error."""
    if not paths:
        return res
    out: dict[str, Any] = {}
    for path in paths:
        cur: Any = res
        for k in path.split("/"):
            if not isinstance(cur, dict) or k not in cur:
                break
            cur = cur[k]
        else:
            out[path] = cur
    return out


# ---- OpenAI /v1/completions ----

def _oai_base(m: Meta, obj: str) -> dict[str, Any]:
    return {"created": m.created, "model": m.model, "system_fingerprint": m.fingerprint, "object": obj, "id": m.id}


def oai_cmpl_partial(m: Meta, c: Chunk, index: int = 0) -> dict[str, Any]:
    lp = oai_cmpl_logprobs(c.probs, False) if m.logprobs else None
    return m.add_timings({"choices": [{"text": c.text, "index": index, "logprobs": lp, "finish_reason": None}],
                          **_oai_base(m, "text_completion")}, c)


def oai_cmpl_final(m: Meta, f: Finished, text: str, stream: bool = False, index: int = 0) -> dict[str, Any]:
    lp = oai_cmpl_logprobs(f.probs, True) if m.logprobs and not stream else None
    return {"choices": [{"text": text, "index": index, "logprobs": lp, "finish_reason": finish_reason(f)}],
            **_oai_base(m, "text_completion"), "usage": usage([f]), "timings": f.timings.to_json()}


# ---- OpenAI /v1/chat/completions ----

def chat_final(m: Meta, f: Finished, text: str, reasoning: str = "",
               calls: list[ToolCall] | None = None, index: int = 0) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [c.to_json() for c in calls]
        message["content"] = text or None
    choice: dict[str, Any] = {"finish_reason": "tool_calls" if calls else finish_reason(f), "index": index,
                              "message": message}
    if m.logprobs:
        choice["logprobs"] = {"content": probs_json(f.probs)}
    return {"choices": [choice], **_oai_base(m, "chat.completion"), "usage": usage([f]),
            "timings": f.timings.to_json()}


def _chat_chunk(m: Meta, delta: dict[str, Any], reason: str | None, index: int = 0) -> dict[str, Any]:
    return {"choices": [{"finish_reason": reason, "index": index, "delta": delta}],
            **_oai_base(m, "chat.completion.chunk")}


def chat_partial(m: Meta, c: Chunk, first: bool, index: int = 0) -> list[dict[str, Any]]:
    """llama-server opens with a role-only delta, then one content delta per piece of text."""
    out = [chat_role_chunk(m, index)] if first else []
    if c.text:
        chunk = _chat_chunk(m, {"content": c.text}, None, index)
        if m.logprobs:
            chunk["choices"][0]["logprobs"] = {"content": probs_json(c.probs)}
        out.append(m.add_timings(chunk, c))
    return out


def chat_role_chunk(m: Meta, index: int = 0) -> dict[str, Any]:
    return _chat_chunk(m, {"role": "assistant", "content": None}, None, index)


def chat_delta_chunks(m: Meta, d: Delta, probs: list[TokenProb], c: Chunk | None,
                      index: int = 0) -> list[dict[str, Any]]:
    """Chunks for a parsed delta: reasoning_content, content, then each completed tool call whole. The token
    probabilities go on the first chunk (on an empty delta if the text was held back)."""
    out = []
    if d.reasoning:
        out.append(_chat_chunk(m, {"reasoning_content": d.reasoning}, None, index))
    if d.content:
        out.append(_chat_chunk(m, {"content": d.content}, None, index))
    out += [_chat_chunk(m, {"tool_calls": [call.to_json(i)]}, None, index) for i, call in d.calls]
    if m.logprobs and probs:
        if not out:
            out.append(_chat_chunk(m, {}, None, index))
        out[0]["choices"][0]["logprobs"] = {"content": probs_json(probs)}
    if c is not None and out:
        m.add_timings(out[-1], c)
    return out


def chat_stream_final(m: Meta, f: Finished, tail: str, tool_calls: bool = False,
                      index: int = 0) -> list[dict[str, Any]]:
    """A choice's last chunks: the held-back tail, then an empty delta with finish_reason and the timings."""
    out = []
    if tail:
        out.append(_chat_chunk(m, {"content": tail}, None, index))
        if m.logprobs:
            out[-1]["choices"][0]["logprobs"] = {"content": probs_json(f.tail_probs)}
    out.append(_chat_chunk(m, {}, "tool_calls" if tool_calls else finish_reason(f), index))
    out[-1]["timings"] = f.timings.to_json()
    return out


def usage_chunk(m: Meta, fins: list[Finished], obj: str) -> list[dict[str, Any]]:
    """With `stream_options.include_usage`: after every choice, one chunk (`object` obj) with empty `choices` and
    the summed usage (OpenAI's rule), carrying the timings too when there is one choice (llama-server's last
    chunk)."""
    if not m.include_usage:
        return []
    out = {"choices": [], **_oai_base(m, obj), "usage": usage(fins)}
    if len(fins) == 1:
        out["timings"] = fins[0].timings.to_json()
    return [out]
