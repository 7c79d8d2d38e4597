"""The inference queue: one worker thread owns the Llama and decodes all busy slots together.

[HTTP threads] --submit--> waiting queue --admit--> slots (one llama sequence each)
    --> one llama_decode per step: prompt chunks + one token per generating slot --> per-slot sampling
    --> events (Chunk ..., Finished | Failed) on each ticket's queue --> HTTP threads.
Embedding tickets (`--embedding`) take slots too, in steps of their own with the context's embeddings switched on
(llama-server's rule: a batch is all generation or all embedding); when both wait, the steps alternate.
Nothing here knows JSON or HTTP; cancelled tickets (client gone) free their slot at the next step.
"""
from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from .._runtime import llama_cpp as lc
from . import pooling
from .params import GenerationParams
from .reasoning import ReasoningBudget
from .sampling import SlotSampler
from .text import TextAssembler
from .trigger import TriggerWatch

if TYPE_CHECKING:
    from ..llama import Llama

log = logging.getLogger(__name__)


SLOT_SIMILARITY = 0.1  # llama-server's --slot-prompt-similarity default: reuse a slot sharing > 10 % of the prompt


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class QueueFull(Exception):  # noqa: N818 - named like queue.Full
    """All slots are busy and the waiting queue is full."""


@dataclass(frozen=True)
class Timings:
    """One request's timings, llama-server's `timings` object (prompt = up to the first sampled token)."""

    prompt_n: int  # prompt tokens evaluated (the cached prefix not counted)
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    cache_n: int = 0  # prompt tokens whose KV was reused from the slot's previous request

    def to_json(self) -> dict[str, Any]:
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n else 0.0,
            "prompt_per_second": 1e3 * self.prompt_n / self.prompt_ms if self.prompt_ms > 0 else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": self.predicted_ms,
            # the first token comes from the prompt's logits: rates are over the predicted_n - 1 decode steps
            "predicted_per_token_ms": self.predicted_ms / (self.predicted_n - 1) if self.predicted_n > 1 else 0.0,
            "predicted_per_second": (1e3 * (self.predicted_n - 1) / self.predicted_ms
                                     if self.predicted_n > 1 and self.predicted_ms > 0 else 0.0),
        }


@dataclass(frozen=True)
class TokenProb:
    """A generated token's log-probability under the model (softmax of its raw logits, before any sampler, as
    llama-server's `n_probs`), with the `top` most likely tokens as (id, piece, logprob), most likely first."""

    id: int
    piece: bytes
    logprob: float
    top: tuple[tuple[int, bytes, float], ...]


@dataclass(frozen=True)
class Chunk:
    text: str
    tokens: list[int]
    n_decoded: int
    timings: Timings | None = None  # so far (for `timings_per_token`)
    probs: list[TokenProb] = field(default_factory=list)  # of `tokens`, when the request asked for them


@dataclass(frozen=True)
class Finished:
    text: str  # text not sent in a Chunk yet (the held tail)
    tokens: list[int]  # every generated token
    stop_type: str  # "eos" | "limit" | "word"
    stopping_word: str
    truncated: bool  # stopped because the slot's context was full
    n_prompt: int
    n_decoded: int
    id_slot: int
    timings: Timings
    n_cached: int = 0  # prompt tokens reused from the slot's KV (timings.cache_n)
    tokens_cached: int = 0  # tokens in the slot's KV at the end (llama-server's `tokens_cached`)
    probs: list[TokenProb] = field(default_factory=list)  # of every generated token, if asked for
    tail_probs: list[TokenProb] = field(default_factory=list)  # of the tokens behind `text` (not sent yet)


@dataclass(frozen=True)
class Embedded:
    """An embedding ticket's answer: one pooled vector (normalised as asked), or with pooling none one raw vector
    per prompt token."""

    vectors: np.ndarray  # float32 [1 or n_prompt, n_embd_out]
    n_prompt: int


@dataclass(frozen=True)
class Failed:
    status: int
    type: str
    message: str


Event = Union[Chunk, Finished, Embedded, Failed]


@dataclass
class QueueWait:
    """The `--queue-timeout` of one request, shared by its tickets: it bounds the wait before the request's FIRST
    choice starts. Once one has started the request is being answered, and its other choices wait without limit
    (with `id_slot` they run one after another in that slot)."""

    deadline: float  # monotonic time after which the request, none of its choices started, gets 503
    started: bool = False  # a choice of the request is (or was) in a slot

    def expired(self, now: float) -> bool:
        return not self.started and self.deadline < now


@dataclass
class Ticket:
    """One submitted generation; the HTTP thread reads `events` and calls `Engine.cancel` if the client leaves.
    The tickets of one request (several prompts, `n` > 1) share one `events` queue and one QueueWait; each event
    comes tagged with its ticket's `index` (the choice's index in the answer)."""

    id: int
    prompt: list[int]
    params: GenerationParams
    wait: QueueWait
    events: queue.Queue[tuple[int, Event]] = field(default_factory=queue.Queue)  # (index, event)
    index: int = 0  # the choice this ticket answers
    cancelled: bool = False
    embd_normalize: int | None = None  # an embedding ticket: its normalisation (pooling.normalize); None: generate

    def put(self, ev: Event) -> None:
        self.events.put((self.index, ev))


@dataclass
class EngineStats:
    """Cumulative counters for /metrics, written by the worker only."""

    prompt_tokens: int = 0  # evaluated, without the cached prefixes
    prompt_tokens_cached: int = 0  # reused from slots' KV
    prompt_seconds: float = 0.0
    predicted_tokens: int = 0
    predicted_seconds: float = 0.0
    n_decode: int = 0
    busy_slots: int = 0  # summed over decode calls
    decode_seconds: float = 0.0  # wall time inside llama_decode
    n_tokens_max: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    requests_rejected: int = 0  # queue full or timed out in the queue


class _Slot:
    def __init__(self, index: int, n_ctx: int) -> None:
        self.id = index  # also the llama sequence id
        self.n_ctx = n_ctx
        self.ticket: Ticket | None = None
        self.sampler: SlotSampler | None = None
        self.asm: TextAssembler | None = None
        self.n_past = 0  # tokens in this sequence's KV cache
        self.cache: list[int] = []  # those tokens (kept after a request: the next may share the prefix)
        self.n_cached = 0  # prompt tokens of the current request reused from `cache`
        self.t_last = 0.0  # when the slot last finished a request (LRU choice)
        self.i_prompt = 0  # prompt tokens fed so far
        self.i_batch = -1  # row of this slot's logits in the current batch
        self.last_token = -1
        self.n_decoded = 0
        self.tokens: list[int] = []
        self.pending: list[int] = []  # tokens whose text is still held back
        self.probs: list[TokenProb] = []  # of every generated token (only when asked for)
        self.pending_probs: list[TokenProb] = []
        self.has_new_line = False
        self.t_start = 0.0
        self.t_first = 0.0

    @property
    def busy(self) -> bool:
        return self.ticket is not None

    @property
    def prefilling(self) -> bool:
        return self.ticket is not None and self.i_prompt < len(self.ticket.prompt)


class Engine:
    def __init__(self, llm: Llama, *, n_parallel: int, queue_size: int, n_batch: int, queue_timeout: float,
                 embeddings: bool = False) -> None:
        self.llm = llm
        self._ctx = llm.ctx
        self._vocab = llm.vocab
        self.embeddings = embeddings  # embedding tickets are taken (serve --embedding)
        self.pooling = int(lc.llama_pooling_type(self._ctx))  # --pooling, else the model's
        self.n_embd_out = llm.n_embd_out()
        self.n_ubatch = int(lc.llama_n_ubatch(self._ctx))
        self._embd_on = False  # the last step was an embedding step (the context's embeddings are on)
        self._mem = lc.llama_get_memory(self._ctx)
        lc.llama_memory_clear(self._mem, True)  # the slots own every sequence from here on
        self.n_vocab = int(lc.llama_vocab_n_tokens(self._vocab))
        # every end-of-generation token: `ignore_eos` bans them (llama-server's logit_bias_eog)
        self.eog = tuple(t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self._vocab, t))
        self.n_ctx_slot = int(lc.llama_n_ctx_seq(self._ctx))
        self.n_batch = min(n_batch, int(lc.llama_n_batch(self._ctx)))
        self.n_parallel = n_parallel
        self.queue_size = queue_size
        self.queue_timeout = queue_timeout
        self.stats = EngineStats()
        self.slots = [_Slot(i, self.n_ctx_slot) for i in range(n_parallel)]
        self._batch = lc.llama_batch_init(self.n_batch, 0, 1)
        self._piece = ctypes.create_string_buffer(256)
        self._cv = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._outstanding = 0  # waiting + in slots
        self._next_id = 0
        self._stopping = False
        # llama.cpp asks its abort callback between graph nodes; Engine.close sets the flag so a long decode stops
        # at once instead of racing the context being freed. The callback is libc's strlen on a 2-byte buffer:
        # it returns the flag (length 0 or 1) in the return register without entering Python (a Python callback
        # would take the GIL at every graph node).
        self._abort_flag = ctypes.create_string_buffer(2)
        strlen = ctypes.cast(ctypes.CDLL(None).strlen, ctypes.c_void_p).value
        assert strlen is not None  # libc is loaded in every process
        self._abort_cb = lc.ggml_abort_callback(strlen)
        lc.llama_set_abort_callback(self._ctx, self._abort_cb, ctypes.cast(self._abort_flag, ctypes.c_void_p))
        self._thread = threading.Thread(target=self._run, name="rapidmoe-engine", daemon=True)
        self._thread.start()

    # ---- called from HTTP threads ----

    @property
    def capacity(self) -> int | None:
        """Generations that may be in slots or waiting at once; None: no limit (queue_size < 0)."""
        return None if self.queue_size < 0 else self.n_parallel + self.queue_size

    def submit_many(self, jobs: list[tuple[list[int], GenerationParams]]) -> list[Ticket]:
        """Queue all of one request's generations, or none (QueueFull): ticket i answers choice i, all tickets
        share one events queue. They wait in order and run in whichever slots free up, side by side."""
        return self._enqueue([(prompt, params, None) for prompt, params in jobs])

    def submit_embeddings(self, prompts: list[list[int]], normalize: int) -> list[Ticket]:
        """Queue one embedding ticket per prompt (all or none, as submit_many); each answers an Embedded event.
        The route has checked that each fits a batch and a slot (embeddings.check_fits)."""
        assert self.embeddings
        stateless = GenerationParams(cache_prompt=False)  # an embedding reuses no KV; its slot is the LRU one
        return self._enqueue([(prompt, stateless, normalize) for prompt in prompts])

    def _enqueue(self, jobs: list[tuple[list[int], GenerationParams, int | None]]) -> list[Ticket]:
        events: queue.Queue[tuple[int, Event]] = queue.Queue()
        with self._cv:
            cap = self.capacity
            if cap is not None and self._outstanding + len(jobs) > cap:
                self.stats.requests_rejected += 1
                raise QueueFull(f"{self._outstanding} generations in slots or waiting, at most {cap} "
                                f"(--parallel {self.n_parallel} + --queue-size {self.queue_size})")
            wait = QueueWait(time.monotonic() + self.queue_timeout)
            tickets = []
            for i, (prompt, params, embd) in enumerate(jobs):
                tickets.append(Ticket(self._next_id, prompt, params, wait, events, index=i, embd_normalize=embd))
                self._next_id += 1
            self._outstanding += len(tickets)
            self._waiting.extend(tickets)
            self._cv.notify()
        return tickets

    def cancel(self, t: Ticket) -> None:
        with self._cv:
            if t.cancelled:
                return
            t.cancelled = True
            if t in self._waiting:
                self._waiting.remove(t)
                self._outstanding -= 1
                self.stats.requests_cancelled += 1
            self._cv.notify()

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run `fn` on the worker between two decode steps (for anything that touches the context)."""
        fut: Future[Any] = Future()
        with self._cv:
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut.result(timeout)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def n_busy(self) -> int:
        return sum(s.busy for s in self.slots)

    def close(self) -> None:
        """Stop: requests in flight get 503, a running llama_decode is aborted, and only after the engine thread
        has ended is anything freed (no timeout: the decode returns at its next graph node)."""
        with self._cv:
            self._stopping = True
            self._abort_flag[0] = b"\x01"
            self._cv.notify()
        self._thread.join()
        lc.llama_set_abort_callback(self._ctx, lc.ggml_abort_callback(0), None)
        lc.llama_batch_free(self._batch)

    # ---- worker thread ----

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._waiting or self._calls or any(s.busy for s in self.slots)):
                    self._cv.wait()
                if self._stopping:
                    break
                calls = list(self._calls)
                self._calls.clear()
                self._admit()
            for fn, fut in calls:
                try:
                    fut.set_result(fn())
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            for s in self.slots:
                if s.ticket is not None and s.ticket.cancelled:
                    self.stats.requests_cancelled += 1
                    log.info("slot %d: client gone, freed after %d tokens", s.id, s.n_decoded)
                    self._release(s)
            if any(s.busy for s in self.slots):
                try:
                    self._step()
                except Exception:  # a bug: fail the requests in flight, keep serving
                    log.exception("decode step failed")
                    for s in self.slots:
                        if s.busy:
                            self._fail(s, 500, "server_error", "internal error while decoding")
        for s in self.slots:
            if s.busy:
                self._fail(s, 503, "unavailable_error", "server shutting down")
        with self._cv:
            waiting, calls = list(self._waiting), list(self._calls)
            self._waiting.clear()
            self._calls.clear()
            self._outstanding -= len(waiting)
        for t in waiting:
            t.put(Failed(503, "unavailable_error", "server shutting down"))
        for _, fut in calls:
            fut.set_exception(RuntimeError("server shutting down"))

    def _admit(self) -> None:
        """Time out tickets whose request waited too long, then fill the free slots first come, first served; a
        ticket pinned to a busy slot (`id_slot`) waits without holding up the tickets behind it."""
        now = time.monotonic()
        for t in [t for t in self._waiting if t.wait.expired(now)]:
            self._waiting.remove(t)
            self._outstanding -= 1
            self.stats.requests_rejected += 1
            t.put(Failed(503, "unavailable_error", "timed out waiting for a free slot"))
        free = [s for s in self.slots if not s.busy]
        for t in list(self._waiting):
            if not free:
                return
            fits = [s for s in free if t.params.id_slot < 0 or s.id == t.params.id_slot]
            if not fits:
                continue
            s = self._pick(fits, t)
            free.remove(s)
            self._waiting.remove(t)
            self._start(s, t)

    def _pick(self, free: list[_Slot], t: Ticket) -> _Slot:
        """llama-server's slot choice: the idle slot whose cached tokens share the longest prefix with the prompt
        (more than SLOT_SIMILARITY of it), else the least recently used one."""
        if t.params.cache_prompt:
            best, best_sim = None, 0.0
            for s in free:
                sim = common_prefix(s.cache, t.prompt) / len(t.prompt) if s.cache else 0.0
                if sim > best_sim and sim > SLOT_SIMILARITY:
                    best, best_sim = s, sim
            if best is not None:
                return best
        return min(free, key=lambda s: s.t_last)

    def _start(self, s: _Slot, t: Ticket) -> None:
        s.ticket = t
        t.wait.started = True  # the request is being answered: its other choices are no longer timed out
        if t.embd_normalize is None:
            budget, trigger = t.params.reasoning_budget, t.params.grammar_trigger
            s.sampler = SlotSampler(
                t.params.sampling, self._vocab, self.n_vocab, t.params.grammar,
                ReasoningBudget(budget, self._token_piece) if budget is not None else None,
                TriggerWatch(trigger, lambda tok: self.piece(tok, special=True), self._tokenize_special)
                if trigger is not None else None)
            for tok in t.prompt:
                s.sampler.accept(tok)  # penalties see the prompt, as in llama-server
            s.asm = TextAssembler(list(t.params.stop))
        n_keep = common_prefix(s.cache, t.prompt) if t.params.cache_prompt else 0
        n_keep = max(0, min(n_keep, len(t.prompt) - 1))  # the last prompt token is evaluated again for its logits
        if n_keep < len(s.cache) and not lc.llama_memory_seq_rm(self._mem, s.id, n_keep, -1):
            lc.llama_memory_seq_rm(self._mem, s.id, -1, -1)  # the memory cannot cut a tail: start empty
            n_keep = 0
        del s.cache[n_keep:]
        s.n_cached = n_keep
        s.n_past = s.i_prompt = n_keep
        s.n_decoded = 0
        s.i_batch = s.last_token = -1
        s.tokens, s.pending, s.has_new_line = [], [], False
        s.probs, s.pending_probs = [], []
        s.t_start = time.perf_counter()
        s.t_first = 0.0

    def _step(self) -> None:
        embedding = [s for s in self.slots if s.busy and s.ticket is not None and s.ticket.embd_normalize is not None]
        generating = [s for s in self.slots if s.busy and s not in embedding]
        if embedding and (not generating or not self._embd_on):  # alternate while both wait
            self._embed_step(embedding)
        elif generating:
            self._generate_step(generating)

    def _set_embeddings(self, on: bool) -> None:
        """The context's embeddings output, switched per batch as llama-server does (llama_set_embeddings)."""
        if on != self._embd_on:
            lc.llama_set_embeddings(self._ctx, on)
            self._embd_on = on

    def _decode(self, n: int, busy: list[_Slot]) -> bool:
        """llama_decode of the batch's first n tokens for the busy slots; False (and they failed) on an error."""
        b = self._batch
        b.n_tokens = n
        t0 = time.perf_counter()
        rc = lc.llama_decode(self._ctx, b)
        dt = time.perf_counter() - t0
        self.llm.after_decode(n)  # the routing trace (serve --trace) and a refreshing expert cache follow each step
        self.stats.n_decode += 1
        self.stats.busy_slots += len(busy)
        self.stats.decode_seconds += dt
        if rc != 0 and self._stopping:
            log.warning("llama_decode aborted (%d) with %d tokens in %d slots: shutting down", rc, n, len(busy))
            for s in busy:
                self._fail(s, 503, "unavailable_error", "server shutting down")
            return False
        if rc != 0:
            log.error("llama_decode returned %d with %d tokens in %d slots", rc, n, len(busy))
            for s in busy:
                self._fail(s, 500, "server_error", f"llama_decode failed ({rc})")
            return False
        return True

    def _embed_step(self, busy: list[_Slot]) -> None:
        """One batch of embedding prompts, every token an output. A prompt that pooling needs whole (mean, cls,
        none) waits for a batch it fits in whole; a last-token one is fed in chunks like a generation's."""
        n, rows = 0, {}
        for s in busy:
            assert s.ticket is not None
            rest = s.ticket.prompt[s.i_prompt:]
            if not pooling.can_split(self.pooling) and n + len(rest) > min(self.n_batch, self.n_ubatch):
                continue
            chunk = rest[:self.n_batch - n]
            rows[s.id] = list(range(n, n + len(chunk)))
            for tok in chunk:
                self._add(s, tok, n, True)
                s.i_prompt += 1
                n += 1
            if n >= self.n_batch:
                break
        if n == 0:
            return
        self._set_embeddings(True)
        if not self._decode(n, [s for s in busy if s.id in rows]):
            return
        for s in busy:
            t = s.ticket
            if t is None or s.id not in rows or s.i_prompt < len(t.prompt):
                continue
            assert t.embd_normalize is not None
            vectors = pooling.read(self._ctx, self.pooling, s.id, rows[s.id], self.n_embd_out)
            if self.pooling != lc.LLAMA_POOLING_TYPE_NONE:  # llama-server normalises pooled vectors only
                vectors = pooling.normalize(vectors[0], t.embd_normalize)[None, :]
            self.stats.prompt_tokens += len(t.prompt)
            self.stats.prompt_seconds += time.perf_counter() - s.t_start
            self.stats.requests_finished += 1
            t.put(Embedded(vectors, len(t.prompt)))
            self._release(s)

    def _generate_step(self, busy: list[_Slot]) -> None:
        n = 0
        for s in busy:  # generating slots first: one token each keeps their latency flat
            s.i_batch = -1
            if not s.prefilling and s.last_token >= 0:
                self._add(s, s.last_token, n, True)
                s.i_batch, n = n, n + 1
        for s in busy:
            if not s.prefilling or n >= self.n_batch:
                continue
            assert s.ticket is not None
            prompt = s.ticket.prompt
            chunk = prompt[s.i_prompt:s.i_prompt + self.n_batch - n]
            for tok in chunk:
                s.i_prompt += 1
                last = s.i_prompt == len(prompt)
                self._add(s, tok, n, last)
                if last:
                    s.i_batch = n
                n += 1
        if n == 0:
            return
        self._set_embeddings(False)
        if not self._decode(n, busy):
            return
        for s in busy:
            if s.i_batch >= 0:
                self._sampled(s)

    def _add(self, s: _Slot, tok: int, i: int, logits: bool) -> None:
        b = self._batch
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, s.n_past, 1, logits
        b.seq_id[i][0] = s.id
        s.cache.append(tok)
        s.n_past += 1
        self.stats.n_tokens_max = max(self.stats.n_tokens_max, s.n_past)

    def _sampled(self, s: _Slot) -> None:
        t = s.ticket
        assert t is not None and s.sampler is not None and s.asm is not None
        now = time.perf_counter()
        if s.n_decoded == 0 and not s.t_first:
            s.t_first = now
            self.stats.prompt_tokens += len(t.prompt) - s.n_cached
            self.stats.prompt_tokens_cached += s.n_cached
            self.stats.prompt_seconds += now - s.t_start
            if t.params.n_predict == 0:
                self._finish(s, "limit")
                return
        logprobs = self._logprobs(s.i_batch) if t.params.n_probs >= 0 else None  # before sampling touches them
        tok = s.sampler.sample(self._ctx, s.i_batch)
        s.n_decoded += 1
        s.tokens.append(tok)
        if logprobs is not None:
            s.probs.append(self._token_prob(tok, logprobs, t.params.n_probs))
            s.pending_probs.append(s.probs[-1])
        if lc.llama_vocab_is_eog(self._vocab, tok) and not t.params.ignore_eos:
            self._finish(s, "eos")
            return
        s.pending.append(tok)
        text = s.asm.push(self._token_piece(tok))
        if text:
            s.has_new_line = s.has_new_line or "\n" in text
            t.put(Chunk(text, s.pending, s.n_decoded, self._timings(s, now), s.pending_probs))
            s.pending, s.pending_probs = [], []
        if s.asm.stopping_word:
            self._finish(s, "word")
        elif 0 <= t.params.n_predict <= s.n_decoded:
            self._finish(s, "limit")
        elif s.n_past >= s.n_ctx:
            self._finish(s, "limit", truncated=True)
        elif (t.params.t_max_predict_ms and s.has_new_line
              and 1e3 * (now - s.t_first) > t.params.t_max_predict_ms):
            self._finish(s, "limit")
        else:
            s.last_token = tok

    def _logprobs(self, i_batch: int) -> np.ndarray:
        """log softmax of batch row `i_batch`'s raw logits (float64)."""
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, i_batch), shape=(self.n_vocab,))
        x = logits.astype(np.float64)
        x -= x.max()
        logp: np.ndarray = x - np.log(np.exp(x).sum())
        return logp

    def _token_prob(self, tok: int, logprobs: np.ndarray, n_top: int) -> TokenProb:
        top: tuple[tuple[int, bytes, float], ...] = ()
        if n_top > 0:
            k = min(n_top, self.n_vocab)
            ids = np.argpartition(-logprobs, k - 1)[:k]
            ids = ids[np.argsort(-logprobs[ids], kind="stable")]
            top = tuple((int(i), self._token_piece(int(i)), float(logprobs[i])) for i in ids)
        return TokenProb(tok, self._token_piece(tok), float(logprobs[tok]), top)

    def _token_piece(self, tok: int) -> bytes:
        return self.piece(tok)

    def piece(self, tok: int, special: bool = False) -> bytes:
        """The token's text; `special`: a special token as its text (as llama.cpp's grammar sees it), else empty
        (as answers show it)."""
        n = lc.llama_token_to_piece(self._vocab, tok, self._piece, len(self._piece), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(self._vocab, tok, buf, -n, 0, special)
            return buf.raw[:n]
        return self._piece.raw[:n]

    def _tokenize_special(self, text: bytes) -> list[int]:
        """`text`'s tokens, special tokens parsed, no BOS (for trigger.py's re-spelling)."""
        return list(self.llm.tokenize(text, add_bos=False, special=True))

    def _timings(self, s: _Slot, now: float) -> Timings:
        assert s.ticket is not None
        t_first = s.t_first or now
        return Timings(len(s.ticket.prompt) - s.n_cached, 1e3 * (t_first - s.t_start), s.n_decoded,
                       1e3 * (now - t_first), s.n_cached)

    def _finish(self, s: _Slot, stop_type: str, truncated: bool = False) -> None:
        t = s.ticket
        assert t is not None and s.asm is not None
        now = time.perf_counter()
        t_first = s.t_first or now
        predicted_ms = 1e3 * (now - t_first)
        self.stats.predicted_tokens += s.n_decoded
        self.stats.predicted_seconds += predicted_ms / 1e3
        self.stats.requests_finished += 1
        timings = Timings(len(t.prompt) - s.n_cached, 1e3 * (t_first - s.t_start), s.n_decoded, predicted_ms,
                          s.n_cached)
        t.put(Finished(s.asm.flush(), list(s.tokens), stop_type, s.asm.stopping_word, truncated,
                              len(t.prompt), s.n_decoded, s.id, timings, n_cached=s.n_cached,
                              tokens_cached=len(s.cache), probs=list(s.probs), tail_probs=list(s.pending_probs)))
        self._release(s)

    def _fail(self, s: _Slot, status: int, type_: str, message: str) -> None:
        if s.ticket is not None:
            self.stats.requests_failed += 1
            s.ticket.put(Failed(status, type_, message))
        lc.llama_memory_seq_rm(self._mem, s.id, -1, -1)  # after a failed decode the KV is not known: drop it
        s.cache.clear()
        self._release(s)

    def _release(self, s: _Slot) -> None:
        """The slot is free again; its KV (s.cache) stays for the next request's prefix."""
        s.t_last = time.monotonic()
        if s.sampler is not None:
            s.sampler.free()
        s.ticket, s.sampler, s.asm = None, None, None
        s.i_batch, s.last_token = -1, -1
        with self._cv:
            self._outstanding -= 1

    def slot_state(self, s: _Slot) -> dict[str, Any]:
        """llama-server's /slots entry for one slot, without `params` as the pinned llama-server (read without
        locking: a snapshot, maybe a step old)."""
        t = s.ticket
        n_predict = t.params.n_predict if t is not None else -1
        return {
            "id": s.id,
            "id_task": t.id if t is not None else -1,
            "n_ctx": self.n_ctx_slot,
            "speculative": False,
            "is_processing": t is not None,
            "next_token": [{
                "has_next_token": t is not None,
                "has_new_line": s.has_new_line if t is not None else False,
                "n_remain": (n_predict - s.n_decoded) if t is not None and n_predict >= 0 else -1,
                "n_decoded": s.n_decoded if t is not None else 0,
            }],
        }
