"""What an expert cache is asked to be: the policy names, the rapidmoe policy's refresh and MoEpic's settings, and
`ExpertCacheConfig`, the one argument that asks `rapidmoe.Llama` for a per-expert WQ cache
(`Llama(..., expert_cache=ExpertCacheConfig(experts={layer: [ids]}, device="RPC0[...]"))`). Pure data and checks
that need no model; the checks against a model and the run-time handle are in rapidmoe.cache.runtime.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from ...errors import RapidMoEError


class CachePolicy(str, Enum):
    """The expert-cache policies (docs/execution.md): the runtime realizes each (`ExpertCacheConfig.policy`,
    `run`/`serve --cache-policy`), the simulator replays each (cache.simulator) and `plan --machine` prices each."""

    static = "static"
    rapidmoe = "rapidmoe"
    lru = "lru"
    moepic = "moepic"

    def __str__(self) -> str:  # the name users write, on every Python (3.12 formats mixed-in enums as Class.member)
        return self.value


class CachePolicyError(RapidMoEError, ValueError):
    """Arguments a cache policy or the replay cannot work with."""


@dataclass(frozen=True)
class RefreshSettings:
    """The rapidmoe policy's refresh: decayed routing counts (half-life in tokens), at most copies_per_step swaps after
    each step over all layers, a swap only when the incoming expert's score beats the outgoing one's by `margin`."""

    half_life_tokens: float = 64.0
    copies_per_step: int = 2
    margin: float = 0.25

    def __post_init__(self) -> None:
        if self.copies_per_step < 0 or not self.half_life_tokens > 0 or self.margin < 0:
            raise CachePolicyError("rapidmoe refresh needs copies_per_step >= 0, half_life_tokens > 0, margin >= 0")

    @property
    def decay_per_token(self) -> float:
        return float(0.5 ** (1.0 / self.half_life_tokens))  # float ** float is typed Any (it may be complex)


@dataclass(frozen=True)
class MoEpicConfig:
    """MoEpic's fixed point for a model (cache.moepic.moepic_config, plan_moepic)."""

    budgets: list[float]  # bytes per layer
    splits: list[float]
    capacity: list[int]  # top segments per layer (whole experts)
    stall_s: float  # expected stall per token, all layers
    all_converged: bool


@dataclass(frozen=True)
class MoEpicSettings:
    """The moepic policy at run time (ExpertCacheConfig(policy="moepic", moepic=...)): per MoE layer (in layer
    order) the top segment's share of the intermediate dimension (rounded down to whole rows and to the down
    projection's quantization block) and how many tops stay resident; work_slots experts per layer computed on
    the device per ubatch (0: the model's top-k). One value applies to every layer."""

    split: float | Sequence[float]
    capacity: int | Sequence[int]
    work_slots: int = 0

    def __post_init__(self) -> None:
        splits = [self.split] if isinstance(self.split, (int, float)) else list(self.split)
        caps = [self.capacity] if isinstance(self.capacity, int) else list(self.capacity)
        if any(not 0.0 <= float(x) <= 1.0 for x in splits) or any(int(c) < 0 for c in caps) or self.work_slots < 0:
            raise CachePolicyError("moepic settings need splits in [0, 1], capacities >= 0 and work_slots >= 0")

    @classmethod
    def from_config(cls, cfg: MoEpicConfig, work_slots: int = 0) -> MoEpicSettings:
        return cls(list(cfg.splits), list(cfg.capacity), work_slots)

    def per_layer(self, n_moe: int) -> tuple[list[float], list[int]]:
        splits = [float(self.split)] * n_moe if isinstance(self.split, (int, float)) else [float(x) for x in self.split]
        caps = [int(self.capacity)] * n_moe if isinstance(self.capacity, int) else [int(c) for c in self.capacity]
        if len(splits) != n_moe or len(caps) != n_moe:
            raise CachePolicyError(f"moepic settings give {len(splits)} splits and {len(caps)} capacities for "
                                   f"{n_moe} MoE layers")
        return splits, caps


@dataclass(frozen=True)
class ExpertCacheConfig:
    """A per-expert WQ cache for `rapidmoe.Llama(..., expert_cache=...)`.

    experts: {MoE layer: [expert ids]} whose WQ is copied to `device` (a device or buffer type name, e.g.
        "RPC0[127.0.0.1:50052]"); the routed experts must be in CPU memory (override_tensor="exps=CPU"; CPU weight
        repacking is turned off); the device computes the cached experts, the CPU the rest, each slot exactly as
        that backend alone would (docs/execution.md). Not with the moepic policy, which gives every MoE layer its
        own work area.
    policy: "static" (default: the set stays as given); "rapidmoe": after every decode step the set is refreshed
        from decayed per-expert routing counts, a bounded number of experts swapped (`refresh`); "lru":
        GPU-centric on-demand loading, each ubatch's missing experts copied into the least recently used slots
        before the layer computes; "moepic": MoEpic's split experts (`moepic`), tops of up to `capacity` experts
        resident, the rest fetched per ubatch, the next layer's predicted experts ahead.
    refresh: the rapidmoe policy's RefreshSettings (default RefreshSettings()).
    moepic: the moepic policy's MoEpicSettings (required with it, refused without it).
    async_copies: copies run on the device's transfer queue while compute goes on, each layer waiting for its own
        right before its device work (default); False: each batch of copies is waited for as soon as it is queued
        (the serial order).

    What the loaded model then does: `Llama.expert_cache` (rapidmoe.cache.runtime.ExpertCache)."""

    experts: Mapping[int, Sequence[int]] | None = None
    device: str | None = None
    policy: CachePolicy | str = CachePolicy.static
    refresh: RefreshSettings | None = None
    moepic: MoEpicSettings | None = None
    async_copies: bool = True

    def __post_init__(self) -> None:
        try:
            policy = CachePolicy(self.policy)
        except ValueError:
            raise RapidMoEError(f"ExpertCacheConfig.policy must be one of {', '.join(p.value for p in CachePolicy)}, "
                                f"got {self.policy!r}") from None
        object.__setattr__(self, "policy", policy)
        if policy is CachePolicy.moepic or self.moepic is not None:
            if policy is not CachePolicy.moepic or self.moepic is None:
                raise RapidMoEError('ExpertCacheConfig: policy="moepic" and moepic=MoEpicSettings(...) go together')
            if self.experts is not None:
                raise RapidMoEError("ExpertCacheConfig: the moepic policy gives every MoE layer its own work area: "
                                    "pass moepic=MoEpicSettings(...), not experts")
            return
        if self.experts is None:
            if policy is not CachePolicy.static or self.refresh is not None:
                raise RapidMoEError("ExpertCacheConfig.policy and .refresh need experts={layer: [expert ids]}")
            if self.device is not None:
                raise RapidMoEError("ExpertCacheConfig.device needs experts={layer: [expert ids]}")
            raise RapidMoEError('ExpertCacheConfig needs experts={layer: [expert ids]} (or policy="moepic" with '
                                "moepic=MoEpicSettings(...))")

