"""/infill's prompt: llama-server's fill-in-the-middle layout (`format_prompt_infill`, tools/server/server-common.cpp).

Token arithmetic over a tokenizer and the vocabulary's FIM token ids, and the checks of the request's infill fields;
the route (api/native.infill) generates from the prompt as /completion does. Nothing here touches the engine.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import invalid_request

Tokenize = Callable[[str, bool], list[int]]  # (text, parse_special) -> token ids, no BOS


@dataclass(frozen=True)
class FimTokens:
    """The vocabulary's fill-in-the-middle tokens; -1 (LLAMA_TOKEN_NULL) where it has none."""

    pre: int
    suf: int
    mid: int
    rep: int
    sep: int

    def missing(self) -> str:
        """llama-server's list of the missing required tokens ("" when infill works)."""
        names = (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid))
        return "".join(f"{name} token is missing. " for name, tok in names if tok < 0)


def check_fields(body: dict[str, Any]) -> list[dict[str, Any]]:
    """llama-server's checks of `prompt`, `input_prefix`, `input_suffix` and `input_extra` (400s); the extra chunks."""
    if "prompt" in body and not isinstance(body["prompt"], str):
        raise invalid_request("\"prompt\" must be a string")
    for name in ("input_prefix", "input_suffix"):
        if name not in body:
            raise invalid_request(f"\"{name}\" is required")
        v = body[name]
        if not isinstance(v, str) and not (isinstance(v, list) and all(
                isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool)) for x in v)):
            raise invalid_request(f"\"{name}\" must be a string or an array of strings and token ids")
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise invalid_request("\"input_extra\" must be an array of {\"filename\": string, \"text\": string}")
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise invalid_request("extra_context chunk must contain a \"text\" field with a string value")
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise invalid_request("extra_context chunk's \"filename\" field must be a string")
    return extra


def _mixed(tokenize: Tokenize, value: str | list[Any]) -> list[int]:
    """A string, or strings and token ids, as tokens (llama-server's tokenize_mixed, no special parsing)."""
    parts = [value] if isinstance(value, str) else value
    out: list[int] = []
    for p in parts:
        out += tokenize(p, False) if isinstance(p, str) else [p]
    return out


def infill_prompt(fim: FimTokens, tokenize: Tokenize, body: dict[str, Any], extra: list[dict[str, Any]], *,
                  n_batch: int, n_predict: int, n_ctx: int, bos: int | None) -> list[int]:
    """The prompt tokens in llama-server's repo-level FIM layout: the extra context
    `[FIM_REP]myproject\n [FIM_SEP]name\n text ... [FIM_SEP]filename\n`, then (BOS when the vocabulary adds one)
    `[FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]`. The prefix keeps its last 3/4 of a batch, the suffix its
    first quarter less the prompt, the extra context its end, what the slot's context leaves after a batch and twice
    `n_predict`."""
    prefix = _mixed(tokenize, body["input_prefix"])
    suffix = _mixed(tokenize, body["input_suffix"])
    prompt = tokenize(body.get("prompt", ""), True)
    extra_toks: list[int] = []
    if fim.rep >= 0:
        extra_toks += [fim.rep, *tokenize("myproject\n", False)]
    for chunk in extra:
        if fim.sep >= 0:
            extra_toks += [fim.sep, *tokenize(chunk.get("filename", "tmp") + "\n", False)]
        else:
            extra_toks += tokenize("\n\n--- snippet ---\n\n", False)
        extra_toks += tokenize(chunk["text"], False)
    if fim.sep >= 0:
        extra_toks += [fim.sep, *tokenize("filename\n", False)]
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_toks))
    head = [fim.pre, *prefix[len(prefix) - n_prefix:], *prompt]
    tail = [fim.suf, *suffix[:n_suffix]]
    start = [bos] if bos is not None else []
    return [*extra_toks[len(extra_toks) - n_extra:], *start, *head, *tail, fim.mid]
