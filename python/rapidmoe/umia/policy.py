"""A UMIA policy: the parameters of the in-graph arbitration, their validation, JSON form and tensor layout.

For token t at MoE layer l in phase φ, with its top-k routing weights sorted w1 >= ... >= wk:

    tau(l, φ) = clamp(theta * a_l * b_φ, 0, 1)
        a_l = 1 + alpha * (1 - d_l)          d_l = m / (M - 1): depth of the m-th of M MoE layers (0 first)
                                             (or a_l = layer_scale[m] when an explicit profile is given)
        b_φ = 1 for decode, 1 + beta for prefill
        decode only: tau = 0 in MoE layers deeper than depth_cutoff (d_l > depth_cutoff)
    r = smallest r with w1 + ... + wr >= tau * (w1 + ... + wk), clamped to [r_min, r_max]

Fixed r is the special case r_min = r_max = r. docs/umia.md explains the choice.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import write_text
from ..errors import RapidMoEError

FORMAT = "rapidmoe-umia-policy"
VERSION = 1
PHASES = ("auto", "decode", "prefill")
_PHASE_MODE = {"auto": -1.0, "decode": 0.0, "prefill": 1.0}
_KEYS = {"format", "version", "theta", "alpha", "beta", "depth_cutoff", "r_min", "r_max", "phase", "layer_scale",
         "meta"}


class PolicyError(RapidMoEError, ValueError):
    """A UMIA policy (JSON file or arguments) with unknown keys, wrong types or out-of-range values."""


@dataclass(frozen=True)
class Policy:
    theta: float = 1.0  # share of the token's routing mass its critical experts must cover (decode, deepest layer)
    alpha: float = 0.0  # layer modulation: the first MoE layer's threshold is (1 + alpha) times the last one's
    beta: float = 0.0  # phase modulation: prefill thresholds are (1 + beta) times decode ones
    depth_cutoff: float = 1.0  # decode: MoE layers deeper than this fraction of the stack get no critical expert
    r_min: int = 0  # at least this many critical experts per token
    r_max: int | None = None  # at most this many (None: top-k)
    phase: str = "auto"  # "auto" (from the batch: <= 1 token per sequence is decode), or force one phase
    layer_scale: tuple[float, ...] | None = None  # explicit a_l per MoE layer (replaces alpha)
    meta: dict[str, Any] = field(default_factory=dict, compare=False)  # provenance (calibration), not used

    def __post_init__(self) -> None:
        for name in ("theta", "alpha", "beta", "depth_cutoff"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
                raise PolicyError(f"{name} must be a number, got {v!r:.40}")
        if not 0.0 <= self.theta <= 1.0:
            raise PolicyError(f"theta must be in [0, 1], got {self.theta}")
        if not 0.0 <= self.alpha <= 10.0:
            raise PolicyError(f"alpha must be in [0, 10], got {self.alpha}")
        if not 0.0 <= self.beta <= 10.0:
            raise PolicyError(f"beta must be in [0, 10], got {self.beta}")
        if not 0.0 <= self.depth_cutoff <= 1.0:
            raise PolicyError(f"depth_cutoff must be in [0, 1], got {self.depth_cutoff}")
        for name in ("r_min", "r_max"):
            v = getattr(self, name)
            if v is None and name == "r_max":
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise PolicyError(f"{name} must be an integer, got {v!r}")
            if not 0 <= v <= 64:
                raise PolicyError(f"{name} must be in 0..64, got {v}")
        if self.r_max is not None and self.r_max < self.r_min:
            raise PolicyError(f"r_max ({self.r_max}) must be >= r_min ({self.r_min})")
        if self.phase not in PHASES:
            raise PolicyError(f"phase must be one of {', '.join(PHASES)}, got {self.phase!r}")
        if self.layer_scale is not None:
            if not isinstance(self.layer_scale, (list, tuple)) or not self.layer_scale:
                raise PolicyError("layer_scale must be a non-empty list of numbers (one per MoE layer)")
            for v in self.layer_scale:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 100.0:
                    raise PolicyError(f"layer_scale values must be numbers in [0, 100], got {v!r}")
            object.__setattr__(self, "layer_scale", tuple(float(v) for v in self.layer_scale))

    @classmethod
    def fixed(cls, r: int) -> Policy:
        """Fixed r: each token's r highest-weight experts are critical, in every layer and phase."""
        return cls(theta=1.0, r_min=r, r_max=r)

    @property
    def is_fixed(self) -> bool:
        return self.r_max is not None and self.r_min == self.r_max

    def thresholds(self, n_moe_layers: int) -> np.ndarray:
        """tau per MoE layer (in order) and phase: float64 [n_moe_layers, 2] (decode, prefill)."""
        if self.layer_scale is not None:
            if len(self.layer_scale) != n_moe_layers:
                raise PolicyError(f"layer_scale has {len(self.layer_scale)} values, the model has "
                                  f"{n_moe_layers} MoE layers")
            a = np.asarray(self.layer_scale, dtype=np.float64)
        depth = np.arange(n_moe_layers) / max(n_moe_layers - 1, 1)
        if self.layer_scale is None:
            a = 1.0 + self.alpha * (1.0 - depth)
        tau = np.empty((n_moe_layers, 2))
        tau[:, 0] = np.where(depth > self.depth_cutoff + 1e-9, 0.0, self.theta * a)
        tau[:, 1] = self.theta * a * (1.0 + self.beta)
        return np.clip(tau, 0.0, 1.0)

    def to_array(self, n_layer: int, moe_layers: list[int], k: int) -> np.ndarray:
        """The policy tensor the graph op reads: float32 [n_layer + 1, 4] (layout in rapidmoe-llama.h)."""
        out = np.zeros((n_layer + 1, 4), dtype=np.float32)
        out[0, 0] = _PHASE_MODE[self.phase]
        r_min = min(self.r_min, k)
        r_max = k if self.r_max is None else min(self.r_max, k)
        tau = self.thresholds(len(moe_layers))
        for m, il in enumerate(moe_layers):
            out[il + 1] = (tau[m, 0], tau[m, 1], r_min, r_max)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_scale"] = list(self.layer_scale) if self.layer_scale is not None else None
        return {"format": FORMAT, "version": VERSION, **d}

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the JSON (to a temporary name, then renamed)."""
        return write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    def describe(self) -> str:
        if self.is_fixed:
            return f"fixed r={self.r_min}"
        scale = "profile" if self.layer_scale is not None else f"alpha={self.alpha:g}"
        r_max = "k" if self.r_max is None else str(self.r_max)
        cut = f" cutoff={self.depth_cutoff:g}" if self.depth_cutoff < 1.0 else ""
        return f"theta={self.theta:g} {scale} beta={self.beta:g}{cut} r in [{self.r_min}, {r_max}]"


def _finite(v: float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:  # an integer beyond the float range
        return False


def policy_from_dict(d: Any, *, source: str = "policy") -> Policy:
    """Validate a decoded JSON object (unknown keys and bad values are errors naming the key)."""
    if not isinstance(d, dict):
        raise PolicyError(f"{source}: a UMIA policy is a JSON object, got {type(d).__name__}")
    unknown = sorted(set(d) - _KEYS)
    if unknown:
        raise PolicyError(f"{source}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_KEYS))})")
    if d.get("format", FORMAT) != FORMAT:
        raise PolicyError(f"{source}: format is {d.get('format')!r}, expected {FORMAT!r}")
    if d.get("version", VERSION) != VERSION:
        raise PolicyError(f"{source}: version {d.get('version')!r} is not supported (this build reads {VERSION})")
    meta = d.get("meta", {})
    if not isinstance(meta, dict):
        raise PolicyError(f"{source}: meta must be an object")
    args = {k: v for k, v in d.items() if k not in ("format", "version", "meta")}
    try:
        return Policy(**args, meta=meta)
    except PolicyError as e:
        raise PolicyError(f"{source}: {e}") from None


def load_policy(path: str | os.PathLike[str]) -> Policy:
    """Read and validate a policy JSON file (PolicyError with the reason otherwise)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise PolicyError(f"policy file {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError(f"cannot read policy file {p}: {e}") from None
    try:
        d = json.loads(text)
    except (ValueError, RecursionError) as e:  # also a number past int's digit limit, arrays nested too deep
        raise PolicyError(f"{p}: not valid JSON ({e})") from None
    return policy_from_dict(d, source=str(p))
