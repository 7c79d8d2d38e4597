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

_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(lc.llama_token_data)


class SlotSampler:
    """The chain, and optionally a grammar applied as llama-server applies it (`common_sampler_sample`): sample
    with the chain, check the token against the grammar, and only if it is rejected sample again with the
    grammar applied to every candidate first. The grammar accepts generated tokens only."""

    def __init__(self, p: SamplingParams, vocab: lc.llama_vocab_p, n_vocab: int, grammar: str | None = None) -> None:
        self.n_vocab = n_vocab
        self.grammar = None
        if grammar is not None:
            self.grammar = lc.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
            if not self.grammar:  # checked at the HTTP boundary; a failure here is a bug
                raise ValueError("grammar failed to parse")
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

    def sample(self, ctx: lc.llama_context_p, i_batch: int) -> int:
        """Sample from the logits of batch row `i_batch` and accept the token into the chain's (and grammar's)
        state."""
        if self.grammar is None:
            return int(lc.llama_sampler_sample(self.chain, ctx, i_batch))
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i_batch), shape=(self.n_vocab,))
        tok = self._apply(logits, with_grammar=False)
        self._one[0] = (tok, 1.0, 0.0)
        self._one_cur.size, self._one_cur.selected = 1, -1
        lc.llama_sampler_apply(self.grammar, ctypes.byref(self._one_cur))
        if self._one[0]["logit"] == -np.inf:  # rejected: the grammar first, then the chain again
            tok = self._apply(logits, with_grammar=True)
        lc.llama_sampler_accept(self.grammar, tok)
        lc.llama_sampler_accept(self.chain, tok)
        return tok

    def _apply(self, logits: np.ndarray, with_grammar: bool) -> int:
        d = self._data
        d["id"] = np.arange(self.n_vocab, dtype=np.int32)
        d["logit"] = logits
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
