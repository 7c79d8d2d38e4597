"""A llama.cpp sampler chain for one slot from SamplingParams, in llama-server's default order.

logit bias -> penalties -> DRY -> top-n-sigma -> top_k -> typical -> top_p -> min_p -> xtc -> temperature -> dist
(or mirostat / greedy).
Owns a native handle: free it with `free()` (the slot does when it is released).
"""
from __future__ import annotations

import ctypes
import math

import numpy as np

from .._runtime import llama_cpp as lc
from .params import SamplingParams
from .reasoning import ReasoningBudget
from .trigger import TriggerWatch

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(lc.llama_token_data)


class SlotSampler:
    """The chain, and optionally a grammar and a reasoning budget applied as llama-server applies them
    (`common_sampler_sample`): the budget first (while it forces a token, every other token's logit is -inf),
    then sample with the chain, check the token against the grammar, and only if it is rejected sample again with
    the grammar applied to every candidate first. The grammar and the budget see generated tokens only."""

    def __init__(self, p: SamplingParams, vocab: lc.llama_vocab_p, n_vocab: int, grammar: str | None = None,
                 budget: ReasoningBudget | None = None, trigger: TriggerWatch | None = None) -> None:
        """`trigger`: the grammar starts once the answer has opened a tool call (trigger.py), fed the opener."""
        self.n_vocab = n_vocab
        self.grammar = None
        self.budget = budget
        self.trigger = trigger
        self._vocab = vocab
        self._lazy = grammar if trigger is not None else None  # the grammar, until the trigger starts it
        if grammar is not None and trigger is None:
            self._start_grammar(grammar, ())
        if grammar is not None or budget is not None:
            self._data = np.zeros(n_vocab, _TOKEN_DATA)
            self._cur = lc.llama_token_data_array(
                data=self._data.ctypes.data_as(ctypes.POINTER(lc.llama_token_data)), size=n_vocab, selected=-1,
                sorted=False)
            self._one = np.zeros(1, _TOKEN_DATA)
            self._one_cur = lc.llama_token_data_array(
                data=self._one.ctypes.data_as(ctypes.POINTER(lc.llama_token_data)), size=1, selected=-1,
                sorted=False)
        self.chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())

        def add(s: lc.llama_sampler_p) -> None:  # the chain takes ownership
            lc.llama_sampler_chain_add(self.chain, s)

        if p.logit_bias:
            arr = (lc.llama_logit_bias * len(p.logit_bias))()
            for i, (tok, bias) in enumerate(p.logit_bias):
                arr[i].token, arr[i].bias = tok, bias if math.isfinite(bias) else -math.inf  # type: ignore[assignment]  # ctypes converts
            add(lc.llama_sampler_init_logit_bias(n_vocab, len(p.logit_bias), arr))
        if p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            last_n = n_vocab if p.repeat_last_n == -1 else p.repeat_last_n
            add(lc.llama_sampler_init_penalties(last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty))
        if p.dry_multiplier != 0.0 and p.dry_penalty_last_n != 0:
            breakers = [b.encode() for b in p.dry_sequence_breakers]
            arr_b = (ctypes.c_char_p * len(breakers))(*breakers)  # copied by the sampler
            add(lc.llama_sampler_init_dry(vocab, p.dry_multiplier, p.dry_base, p.dry_allowed_length,
                                          p.dry_penalty_last_n, arr_b, len(breakers)))
        if p.top_n_sigma > 0.0:
            add(lc.llama_sampler_init_top_n_sigma(p.top_n_sigma))
        seed = ctypes.c_uint32(p.seed).value
        if p.temperature <= 0.0:
            add(lc.llama_sampler_init_greedy())
        elif p.mirostat == 1:
            add(lc.llama_sampler_init_temp(p.temperature))
            add(lc.llama_sampler_init_mirostat(n_vocab, seed, p.mirostat_tau, p.mirostat_eta, 100))
        elif p.mirostat == 2:
            add(lc.llama_sampler_init_temp(p.temperature))
            add(lc.llama_sampler_init_mirostat_v2(seed, p.mirostat_tau, p.mirostat_eta))
        else:
            min_keep = p.min_keep
            if p.top_k > 0:
                add(lc.llama_sampler_init_top_k(p.top_k))
            if p.typical_p < 1.0:
                add(lc.llama_sampler_init_typical(p.typical_p, min_keep))
            if p.top_p < 1.0:
                add(lc.llama_sampler_init_top_p(p.top_p, min_keep))
            if p.min_p > 0.0:
                add(lc.llama_sampler_init_min_p(p.min_p, min_keep))
            if p.xtc_probability > 0.0:
                add(lc.llama_sampler_init_xtc(p.xtc_probability, p.xtc_threshold, min_keep, seed))
            add(lc.llama_sampler_init_temp_ext(p.temperature, p.dynatemp_range, p.dynatemp_exponent))
            add(lc.llama_sampler_init_dist(seed))

    def accept(self, token: int) -> None:
        """A prompt token: into the chain (penalties, DRY), not the grammar."""
        lc.llama_sampler_accept(self.chain, token)

    def _start_grammar(self, grammar: str, fed: tuple[int, ...]) -> None:
        self.grammar = lc.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root")
        if not self.grammar:  # checked at the HTTP boundary; a failure here is a bug
            raise ValueError("grammar failed to parse")
        for tok in fed:
            lc.llama_sampler_accept(self.grammar, tok)

    def sample(self, ctx: lc.llama_context_p, i_batch: int) -> int:
        """Sample from the logits of batch row `i_batch` and accept the token into the chain's (and grammar's,
        budget's and trigger's) state."""
        watching = self.trigger is not None and not self.trigger.started
        forced = self.trigger.forced() if self.trigger is not None else None
        if forced is None and self.budget is not None:
            forced = self.budget.forced()
            if forced is not None and not self._grammar_takes(forced):
                forced = None  # a request's own grammar that cannot close the thinking block: the grammar wins
        if self.grammar is None and forced is None and not watching:
            tok = int(lc.llama_sampler_sample(self.chain, ctx, i_batch))  # accepts it into the chain
        else:
            logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i_batch), shape=(self.n_vocab,))
            tok = self._apply(logits, with_grammar=False, only=forced)
            if not self._grammar_takes(tok):  # rejected: the grammar first, then the chain again
                tok = self._apply(logits, with_grammar=True, only=forced)
            if watching and forced is None:
                assert self.trigger is not None
                tok = self.trigger.replace(tok)
            if self.grammar is not None:
                lc.llama_sampler_accept(self.grammar, tok)
            lc.llama_sampler_accept(self.chain, tok)
        if self.budget is not None:
            self.budget.accept(tok)
        if watching and self.trigger is not None and self.trigger.accept(tok):
            assert self._lazy is not None
            self._start_grammar(self._lazy, self.trigger.spec.opener_tokens)
        return tok

    def _grammar_takes(self, tok: int) -> bool:
        if self.grammar is None:
            return True
        self._one[0] = (tok, 1.0, 0.0)
        self._one_cur.size, self._one_cur.selected = 1, -1
        lc.llama_sampler_apply(self.grammar, ctypes.byref(self._one_cur))
        return bool(self._one[0]["logit"] != -np.inf)

    def _apply(self, logits: np.ndarray, with_grammar: bool, only: int | None = None) -> int:
        """The chain's token (after the grammar's mask, `with_grammar`); `only`: the one token the budget allows."""
        d = self._data
        d["id"] = np.arange(self.n_vocab, dtype=np.int32)
        if only is None:
            d["logit"] = logits
        else:
            d["logit"] = -np.inf
            d["logit"][only] = logits[only]
        d["p"] = 0.0
        self._cur.size, self._cur.selected, self._cur.sorted = self.n_vocab, -1, False
        if with_grammar:
            lc.llama_sampler_apply(self.grammar, ctypes.byref(self._cur))
        lc.llama_sampler_apply(self.chain, ctypes.byref(self._cur))
        if self._cur.selected < 0:
            raise RuntimeError("the sampler chain selected no token")
        return int(self._cur.data[self._cur.selected].id)  # samplers may reorder, never reallocate, but read it there

    def free(self) -> None:
        if self.chain is not None:
            lc.llama_sampler_free(self.chain)
            self.chain = None
        if self.grammar is not None:
            lc.llama_sampler_free(self.grammar)
            self.grammar = None
