"""Prometheus text for GET /metrics: llama-server's `llamacpp:*` series plus RapidMoE's own `rapidmoe:*`.

Only numbers something really measured: the engine's counters, llama.cpp's perf counters (prompt/eval path
time) and the split-routing counters (critical-expert fraction). Formatting only; collection is the caller's.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .engine import EngineStats


class RequestCounters:
    """HTTP requests answered, by route and status (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n: Counter[tuple[str, int]] = Counter()

    def add(self, route: str, status: int) -> None:
        with self._lock:
            self._n[(route, status)] += 1

    def snapshot(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return dict(self._n)


@dataclass(frozen=True)
class EngineSnapshot:
    """What the worker reports between two steps (read on the worker thread)."""

    llama_prompt_tokens: int  # llama.cpp perf counters: tokens in batches of > 1 token ...
    llama_prompt_ms: float
    llama_eval_tokens: int  # ... and single-token batches
    llama_eval_ms: float
    moe_tokens: int  # split-routing counters (0 without a sidecar)
    moe_slots: int
    moe_critical_slots: int
    moe_wq_bytes: int
    moe_wr_bytes: int


def _item(out: list[str], name: str, kind: str, help_: str, value: float, labels: str = "") -> None:
    out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name}{labels} {value:g}\n")


def render(stats: EngineStats, snap: EngineSnapshot, requests: dict[tuple[str, int], int],
           n_processing: int, n_deferred: int, has_residual: bool) -> str:
    out: list[str] = []
    c, g = "counter", "gauge"
    _item(out, "llamacpp:prompt_tokens_total", c, "Number of prompt tokens processed, excluding cached tokens",
          stats.prompt_tokens)
    _item(out, "llamacpp:prompt_tokens_cached_total", c, "Number of prompt tokens reused from the cache",
          stats.prompt_tokens_cached)
    _item(out, "llamacpp:prompt_seconds_total", c, "Prompt process time", stats.prompt_seconds)
    _item(out, "llamacpp:tokens_predicted_total", c, "Number of generation tokens processed.", stats.predicted_tokens)
    _item(out, "llamacpp:tokens_predicted_seconds_total", c, "Predict process time", stats.predicted_seconds)
    _item(out, "llamacpp:n_decode_total", c, "Total number of llama_decode() calls", stats.n_decode)
    _item(out, "llamacpp:n_tokens_max", c, "Largest observed n_tokens.", stats.n_tokens_max)
    # llama-server's speculative-decoding counters: this server never drafts, so each is exactly 0 (it emits them
    # without a draft model too, and dashboards and llama.cpp's own tests expect the series)
    for name, help_ in (("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated"),
                        ("spec_decode_num_accepted_tokens_total",
                         "Speculative: Total draft tokens accepted by the target model"),
                        ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps")):
        _item(out, f"llamacpp:{name}", c, help_, 0)
    _item(out, "llamacpp:prompt_tokens_seconds", g, "Average prompt throughput in tokens/s.",
          stats.prompt_tokens / stats.prompt_seconds if stats.prompt_seconds else 0.0)
    _item(out, "llamacpp:predicted_tokens_seconds", g, "Average generation throughput in tokens/s.",
          stats.predicted_tokens / stats.predicted_seconds if stats.predicted_seconds else 0.0)
    _item(out, "llamacpp:requests_processing", g, "Number of requests processing.", n_processing)
    _item(out, "llamacpp:requests_deferred", g, "Number of requests deferred.", n_deferred)
    _item(out, "llamacpp:n_busy_slots_per_decode", g, "Average number of busy slots per llama_decode() call",
          stats.busy_slots / max(stats.n_decode, 1))

    out.append("# HELP rapidmoe:http_requests_total HTTP requests answered, by route and status.\n"
               "# TYPE rapidmoe:http_requests_total counter\n")
    for (route, status), n in sorted(requests.items()):
        out.append(f'rapidmoe:http_requests_total{{route="{route}",status="{status}"}} {n}\n')
    for name, v in (("finished", stats.requests_finished), ("cancelled", stats.requests_cancelled),
                    ("failed", stats.requests_failed), ("rejected", stats.requests_rejected)):
        _item(out, f"rapidmoe:requests_{name}_total", c, f"Generation requests {name}.", v)
    _item(out, "rapidmoe:decode_seconds_total", c, "Wall time inside llama_decode().", stats.decode_seconds)
    out.append("# HELP rapidmoe:llama_path_seconds_total llama.cpp perf counters: time in prompt batches "
               "(more than one token) and in single-token eval batches.\n"
               "# TYPE rapidmoe:llama_path_seconds_total counter\n"
               f'rapidmoe:llama_path_seconds_total{{path="prompt"}} {snap.llama_prompt_ms / 1e3:g}\n'
               f'rapidmoe:llama_path_seconds_total{{path="eval"}} {snap.llama_eval_ms / 1e3:g}\n'
               "# HELP rapidmoe:llama_path_tokens_total llama.cpp perf counters: tokens per path.\n"
               "# TYPE rapidmoe:llama_path_tokens_total counter\n"
               f'rapidmoe:llama_path_tokens_total{{path="prompt"}} {snap.llama_prompt_tokens}\n'
               f'rapidmoe:llama_path_tokens_total{{path="eval"}} {snap.llama_eval_tokens}\n')
    if has_residual:
        _item(out, "rapidmoe:moe_expert_slots_total", c, "Routed expert slots (tokens x top-k, all MoE layers).",
              snap.moe_slots)
        _item(out, "rapidmoe:moe_critical_slots_total", c, "Expert slots computed in high precision (WQ + WR).",
              snap.moe_critical_slots)
        _item(out, "rapidmoe:critical_expert_fraction", g, "Critical expert slots / expert slots since start.",
              snap.moe_critical_slots / snap.moe_slots if snap.moe_slots else 0.0)
        out.append("# HELP rapidmoe:moe_weight_bytes_total Estimated expert weight bytes read, per path.\n"
                   "# TYPE rapidmoe:moe_weight_bytes_total counter\n"
                   f'rapidmoe:moe_weight_bytes_total{{path="wq"}} {snap.moe_wq_bytes}\n'
                   f'rapidmoe:moe_weight_bytes_total{{path="wr"}} {snap.moe_wr_bytes}\n')
    return "".join(out)


def snapshot(llm: Any) -> EngineSnapshot:
    """Read llama.cpp's and the split's counters; call on the engine's worker thread."""
    t = llm.timings()
    layers = llm.moe_counters() if getattr(llm, "residual", None) is not None else []
    return EngineSnapshot(t.prompt_tokens, t.prompt_ms, t.decode_tokens, t.decode_ms,
                          sum(x.tokens for x in layers), sum(x.slots for x in layers),
                          sum(x.critical_slots for x in layers), sum(x.wq_bytes for x in layers),
                          sum(x.wr_bytes for x in layers))
