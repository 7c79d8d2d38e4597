"""Request fields -> native types: checking every field's type and range, llama-server's names and defaults.

Each reader raises errors.invalid_request with the field's name; nothing here touches the engine or sockets.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import ApiError, invalid_request
from .reasoning import BudgetSpec
from .trigger import TriggerSpec

INT32_MAX = 2**31 - 1
SEED_RANDOM = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: llama.cpp picks a random seed


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampler chain settings (llama-server names, defaults and order of application)."""

    temperature: float = 0.8  # <= 0: greedy
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_last_n: int = 64
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    mirostat: int = 0  # 0 off, 1 Mirostat, 2 Mirostat 2.0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    top_n_sigma: float = -1.0  # <= 0: off
    dry_multiplier: float = 0.0  # 0: DRY off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")
    min_keep: int = 0
    seed: int = SEED_RANDOM
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); -inf bans the token

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "logit_bias"}
        d["dry_sequence_breakers"] = list(self.dry_sequence_breakers)
        # llama-server's shape: {"bias", "token"} objects, a ban (-inf) as null (nlohmann's JSON for -inf)
        d["logit_bias"] = [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in self.logit_bias]
        return d


@dataclass(frozen=True)
class GenerationParams:
    """What the engine needs besides the prompt tokens."""

    n_predict: int = -1  # -1: until the slot's context is full
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    t_max_predict_ms: int = 0  # 0: no limit
    id_slot: int = -1  # -1: any idle slot
    sampling: SamplingParams = field(default_factory=SamplingParams)
    grammar: str | None = None  # GBNF (from `grammar`, `json_schema` or `response_format`), checked already
    grammar_trigger: TriggerSpec | None = None  # the grammar starts at a tool-call opener (strict tools, trigger.py)
    n_probs: int = -1  # -1: no probabilities; k >= 0: each generated token's log-probability and the top k
    cache_prompt: bool = True  # reuse the KV of the prompt prefix a slot already holds (llama-server's default)
    reasoning_budget: BudgetSpec | None = None  # chat on a thinking template with a budget (reasoning.py)


def _off(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(v == x and type(v) is type(x) for x in values)  # `type(v) is type(x)`: True is not 1 here


_EMPTY = lambda v: v == [] or v == {} or v == ""  # noqa: E731

# Fields of llama-server's or OpenAI's request schema that this server does not implement, each with the values
# that mean "off" (and so change nothing). Any other value is a 400 naming the field instead of being ignored: the
# client asked for something this server does not do, and a 5xx would make SDKs send the request again.
# Fields not listed are either implemented, have no effect on the answer (`user`, `metadata`, `store`,
# `cache_prompt`, `n_keep`/`n_discard` without context shift), or unknown (ignored, as llama-server does).
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n_indent": (_off(0), "code-indentation stop"),
    "n_cache_reuse": (_off(0), "KV shifting"),
    "return_progress": (_off(False), "prompt progress events"),
    "sse_ping_interval": (_off(0, -1), "SSE pings"),
    "lora": (_EMPTY, "LoRA adapters"),
    "samplers": (_EMPTY, "a custom sampler order"),
    "backend_sampling": (_off(False), "backend sampling"),
    "post_sampling_probs": (_off(False), ""),
    "grammar_lazy": (_off(False), "lazy grammars"),
    "grammar_triggers": (_EMPTY, "lazy grammars"),
    "preserved_tokens": (_EMPTY, ""),
    "chat_format": (lambda v: False, "internal field of llama-server"),
    "chat_parser": (lambda v: False, "internal field of llama-server"),
    "generation_prompt": (lambda v: False, "internal field of llama-server"),
    "parse_tool_calls": (_off(False), "tool calls"),
    "continue_final_message": (_off(False), "continuing the last message"),
    "add_generation_prompt": (_off(True), ""),
    "reasoning_format": (lambda v: v in ("none", "auto", "deepseek"), "\"none\", \"auto\" or \"deepseek\""),
    # the chat routes implement these (api/openai.CHAT_FIELDS); elsewhere, as in llama-server, there is no thinking
    "reasoning_budget_tokens": (_off(-1), "reasoning budgets apply to chat requests"),
    "thinking_budget_tokens": (_off(-1), "reasoning budgets apply to chat requests"),
    "reasoning_budget_message": (_off(""), "reasoning budgets apply to chat requests"),
    "reasoning_effort": (lambda v: False, "reasoning effort applies to chat requests"),
    "reasoning_control": (_off(False), "forcing the end of reasoning by request"),
    "verbose": (_off(False), ""),
    "echo": (_off(False), ""),
    "multimodal_data": (_EMPTY, "multimodal input"),
    "input_prefix": (_off(""), "infill"),
    "input_suffix": (_off(""), "infill"),
    "input_extra": (_EMPTY, "infill"),
    "suffix": (_off(""), "infill"),
    "best_of": (_off(1), ""),
    "functions": (_EMPTY, "tool calls"),
    "function_call": (_off("none"), "tool calls"),
    "audio": (lambda v: False, "audio output"),
    "modalities": (lambda v: v == ["text"], "text output only"),
    "prediction": (lambda v: False, "predicted outputs"),
    "web_search_options": (lambda v: False, "web search"),
}


def refuse_unsupported(body: dict[str, Any], skip: frozenset[str] = frozenset()) -> None:
    """400 naming the first field that asks for something this server does not do (null means absent)."""
    for name, (is_off, why) in UNSUPPORTED.items():
        if name in skip:
            continue
        v = body.get(name)
        if v is not None and not is_off(v):
            raise refused(name, why)


def refused(name: str, why: str = "", value: Any = None) -> ApiError:
    """400 naming a request field this server does not implement (and, for a type it does not do, the value): the
    client's error, as OpenAI's and Anthropic's APIs answer a field they do not know, and not one to retry."""
    what = f"\"{name}\"" + (f": {json.dumps(value, ensure_ascii=False)}" if value is not None else "")
    return invalid_request(f"{what} is not supported by this server" + (f" ({why})" if why else ""))


def check_keys(obj: dict[str, Any], allowed: frozenset[str] | set[str], where: str = "",
               why: dict[str, str] | None = None) -> None:
    """`refused` for the first key of `obj` (at path `where`) not in `allowed`; null counts as absent."""
    for k in obj:
        if k not in allowed and obj[k] is not None:
            raise refused(f"{where}{k}", (why or {}).get(k, ""))


def text_value(v: Any, name: str) -> str:
    """A string field's value (UTF-8 text), else a 400 naming it."""
    if not isinstance(v, str):
        raise invalid_request(f"\"{name}\" must be a string")
    return check_utf8(v, name)


def _type_error(name: str, want: str, got: Any) -> Exception:
    return invalid_request(f"\"{name}\" must be {want}, got {type(got).__name__}")


def get_int(body: dict[str, Any], name: str, default: int, lo: int = -INT32_MAX, hi: int = INT32_MAX) -> int:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**53:
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise _type_error(name, "an integer", v)
    if not lo <= v <= hi:
        raise invalid_request(f"\"{name}\" must be in [{lo}, {hi}], got {v}")
    return v


def get_float(body: dict[str, Any], name: str, default: float, lo: float = -1e9, hi: float = 1e9) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _type_error(name, "a number", v)
    if not (lo <= float(v) <= hi):
        raise invalid_request(f"\"{name}\" must be in [{lo:g}, {hi:g}], got {v}")
    return float(v)


def get_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def get_str(body: dict[str, Any], name: str, default: str | None = None) -> str | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise _type_error(name, "a string", v)
    return check_utf8(v, name)


def check_utf8(s: str, name: str) -> str:
    """JSON can carry lone surrogates (\\ud800) that are not text; refuse them instead of failing later."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid_request(f"\"{name}\" is not valid UTF-8 text") from None
    return s


def get_stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        return (check_utf8(v, "stop"),)
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid_request("\"stop\" must be a string or an array of strings")
    if len(v) > 16:
        raise invalid_request("\"stop\" takes at most 16 strings")
    return tuple(check_utf8(s, "stop") for s in v)


def get_logit_bias(body: dict[str, Any], n_vocab: int,
                   tokenize: Callable[[str], list[int]] | None = None) -> tuple[tuple[int, float], ...]:
    """`[[token, bias|false], ...]` (llama-server) or `{"token": bias}` (OpenAI), as llama-server reads them: in
    the array a token is an id or a text, in the object a key is an id when it is all digits, else a text; a text's
    bias applies to each of its tokens (`tokenize`: no BOS, special tokens as plain text). Anything else is refused
    by name (llama-server skips it silently)."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    pairs: list[tuple[Any, Any]]
    if isinstance(v, dict):
        pairs = [(_id_or_text(k), b) for k, b in v.items()]
    elif isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 for p in v):
        pairs = [(p[0], p[1]) for p in v]
    else:
        raise invalid_request("\"logit_bias\" must be [[token, bias], ...] or {\"token\": bias}")
    out = []
    for tok, bias in pairs:
        if bias is False:
            b = -math.inf
        elif isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias):
            b = float(bias)
        else:
            raise invalid_request(f"\"logit_bias\": bias for {tok!r} must be a number or false")
        if isinstance(tok, str) and tokenize is not None:
            out += [(t, b) for t in tokenize(check_utf8(tok, "logit_bias"))]
            continue
        if not isinstance(tok, int) or isinstance(tok, bool):
            raise invalid_request(f"\"logit_bias\": token {tok!r} is not a token id or a text")
        if not 0 <= tok < n_vocab:
            raise invalid_request(f"\"logit_bias\": token id {tok} out of range [0, {n_vocab})")
        out.append((tok, b))
    return tuple(out)


def _id_or_text(key: str) -> int | str:
    """An object key of logit_bias: a token id when it is a whole decimal integer (llama-server's strtol test, so
    "-1" is an id, out of range), else the text to tokenize."""
    return int(key) if re.fullmatch(r"\s*[+-]?[0-9]+", key) else key


def get_breakers(body: dict[str, Any]) -> tuple[str, ...]:
    """`dry_sequence_breakers`: a non-empty array of strings (llama-server refuses an empty one)."""
    v = body.get("dry_sequence_breakers")
    if v is None:
        return SamplingParams.dry_sequence_breakers
    if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
        raise invalid_request("\"dry_sequence_breakers\" must be a non-empty array of non-empty strings")
    return tuple(check_utf8(x, "dry_sequence_breakers") for x in v)


def sampling_from(body: dict[str, Any], n_vocab: int, default_seed: int, default_temp: float,
                  tokenize: Callable[[str], list[int]] | None = None,
                  eog: tuple[int, ...] = ()) -> SamplingParams:
    """The sampler settings of a request. `ignore_eos` bans every end-of-generation token `eog` with a -inf
    logit bias after the request's own (llama-server's logit_bias_eog), so they are never sampled."""
    seed = get_int(body, "seed", default_seed, lo=-1, hi=2**32 - 1)
    dry_base = get_float(body, "dry_base", 1.75, lo=-1e3, hi=1e3)
    return SamplingParams(
        temperature=get_float(body, "temperature", default_temp, lo=-1e3, hi=1e3),
        dynatemp_range=get_float(body, "dynatemp_range", 0.0, lo=0.0, hi=1e3),
        dynatemp_exponent=get_float(body, "dynatemp_exponent", 1.0, lo=0.0, hi=1e3),
        top_k=get_int(body, "top_k", 40, lo=-1, hi=n_vocab if n_vocab > 0 else INT32_MAX),
        top_p=get_float(body, "top_p", 0.95, lo=0.0, hi=1.0),
        min_p=get_float(body, "min_p", 0.05, lo=0.0, hi=1.0),
        typical_p=get_float(body, "typical_p", 1.0, lo=0.0, hi=1.0),
        repeat_last_n=get_int(body, "repeat_last_n", 64, lo=-1, hi=INT32_MAX),
        repeat_penalty=get_float(body, "repeat_penalty", 1.0, lo=0.0, hi=1e3),
        presence_penalty=get_float(body, "presence_penalty", 0.0, lo=-1e3, hi=1e3),
        frequency_penalty=get_float(body, "frequency_penalty", 0.0, lo=-1e3, hi=1e3),
        mirostat=get_int(body, "mirostat", 0, lo=0, hi=2),
        mirostat_tau=get_float(body, "mirostat_tau", 5.0, lo=0.0, hi=1e3),
        mirostat_eta=get_float(body, "mirostat_eta", 0.1, lo=0.0, hi=1e3),
        xtc_probability=get_float(body, "xtc_probability", 0.0, lo=0.0, hi=1.0),
        xtc_threshold=get_float(body, "xtc_threshold", 0.1, lo=0.0, hi=1.0),
        top_n_sigma=get_float(body, "top_n_sigma", -1.0, lo=-1e3, hi=1e3),
        dry_multiplier=get_float(body, "dry_multiplier", 0.0, lo=0.0, hi=1e9),
        dry_base=dry_base if dry_base >= 1.0 else 1.75,  # llama-server: below 1 means the default
        dry_allowed_length=get_int(body, "dry_allowed_length", 2, lo=0),
        dry_penalty_last_n=get_int(body, "dry_penalty_last_n", 64, lo=0),
        dry_sequence_breakers=get_breakers(body),
        min_keep=get_int(body, "min_keep", 0, lo=0, hi=INT32_MAX),
        seed=SEED_RANDOM if seed == -1 else seed,
        logit_bias=get_logit_bias(body, n_vocab, tokenize)
        + (tuple((t, -math.inf) for t in eog) if get_bool(body, "ignore_eos", False) else ()),
    )


def get_n_probs(body: dict[str, Any], route: str, n_vocab: int) -> int:
    """-1 (off) or the number of top tokens to report with each generated token's log-probability.
    native: `n_probs` (else `logprobs`), 0 is off (llama-server); /v1/completions: `logprobs` k >= 0 (OpenAI:
    0 still reports the sampled token's); chat: `logprobs` true with `top_logprobs` (20 when absent, as
    llama-server), `top_logprobs` without `logprobs` refused (llama-server's rule)."""
    if route == "chat":
        on = get_bool(body, "logprobs", False)
        if not on:
            if body.get("top_logprobs") is not None:
                raise invalid_request("\"top_logprobs\" requires \"logprobs\" to be set to true")
            return -1
        return get_int(body, "top_logprobs", 20, lo=0, hi=n_vocab)
    if route == "oai":
        return get_int(body, "logprobs", -1, lo=0, hi=n_vocab) if body.get("logprobs") is not None else -1
    name = "n_probs" if body.get("n_probs") is not None else "logprobs"
    k = get_int(body, name, 0, lo=0, hi=n_vocab)
    return k if k > 0 else -1


MAX_N = 128  # completions per prompt (`n`), OpenAI's limit
MAX_CHOICES = 1024  # completions per request (prompts x n)


def get_n(body: dict[str, Any]) -> int:
    """Completions per prompt: llama-server's `n_cmpl`, else OpenAI's `n` (llama-server's alias), 1 to MAX_N."""
    name = "n_cmpl" if body.get("n_cmpl") is not None else "n"
    return get_int(body, name, 1, lo=1, hi=MAX_N)


def choice_seed(seed: int, j: int) -> int:
    """The seed of a prompt's completion j: seed + j (mod 2^32, never SEED_RANDOM), so `n` completions with a
    fixed seed differ and are reproducible; a random seed stays random."""
    return seed if seed == SEED_RANDOM else (seed + j) % SEED_RANDOM


@dataclass(frozen=True)
class Output:
    """How a completion request wants its answers (/completion and /infill, /v1/completions, /v1/chat/completions),
    read once per request by native_output or oai_output, after its prompts and choices."""

    stream: bool = False  # SSE as the tokens come, else one whole answer
    timings_per_token: bool = False  # llama-server's: `timings` in every streamed chunk
    include_usage: bool = False  # OpenAI's `stream_options.include_usage`: a last chunk with the usage
    return_tokens: bool = False  # native: each answer's token ids
    response_fields: tuple[str, ...] = ()  # native: only these fields of each answer (`a/b` paths)


def native_output(body: dict[str, Any]) -> Output:
    """The native route's answer options: `stream`, `response_fields`, `return_tokens`, `timings_per_token` (read
    in this order, so a request with several bad fields gets the same error as ever)."""
    stream = get_bool(body, "stream", False)
    v = body.get("response_fields")
    if v is not None and (not isinstance(v, list) or not all(isinstance(x, str) for x in v)):
        raise invalid_request("\"response_fields\" must be an array of strings")
    return Output(stream=stream, response_fields=tuple(v or ()), return_tokens=get_bool(body, "return_tokens", False),
                  timings_per_token=get_bool(body, "timings_per_token", False))


def oai_output(body: dict[str, Any]) -> Output:
    """The OpenAI routes' answer options: `stream`, `stream_options.include_usage`, `timings_per_token` (in this
    order)."""
    stream = get_bool(body, "stream", False)
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise invalid_request("\"stream_options\" must be an object")
    return Output(stream=stream, include_usage=get_bool(opts, "include_usage", False),
                  timings_per_token=get_bool(body, "timings_per_token", False))


def generation_from(body: dict[str, Any], *, n_vocab: int, default_n_predict: int, default_seed: int,
                    default_temp: float, route: str = "native", tokenize: Callable[[str], list[int]] | None = None,
                    eog: tuple[int, ...] = ()) -> GenerationParams:
    """llama-server reads `n_predict`, then `max_tokens` (OpenAI), then `max_completion_tokens`."""
    n_predict = get_int(body, "n_predict", default_n_predict, lo=-1)
    for name in ("max_tokens", "max_completion_tokens"):
        if name in body and body[name] is not None:
            n_predict = get_int(body, name, n_predict, lo=-1)
    return GenerationParams(
        n_predict=n_predict,
        stop=get_stop(body),
        ignore_eos=get_bool(body, "ignore_eos", False),
        t_max_predict_ms=get_int(body, "t_max_predict_ms", 0, lo=0),
        id_slot=get_int(body, "id_slot", -1, lo=-1),
        sampling=sampling_from(body, n_vocab, default_seed, default_temp, tokenize, eog),
        n_probs=get_n_probs(body, route, n_vocab),
        cache_prompt=get_bool(body, "cache_prompt", True),
    )
