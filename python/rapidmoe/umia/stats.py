"""What the arbitration chose during a run: the r histogram per MoE layer and phase, read from libllama."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PHASE_NAMES = ("decode", "prefill")


@dataclass(frozen=True)
class RHistogram:
    """counts[m, phase, r]: tokens of the m-th MoE layer (model layer layers[m]) given r critical experts."""

    layers: tuple[int, ...]
    k: int
    counts: np.ndarray  # int64 [n_moe_layers, 2, k + 1]

    @classmethod
    def from_raw(cls, raw: np.ndarray, moe_layers: list[int], k: int) -> RHistogram:
        return cls(tuple(moe_layers), k, raw[moe_layers, :, : k + 1].astype(np.int64))

    def tokens(self, phase: int | None = None) -> int:
        """Tokens routed (counted once per layer: the first MoE layer's count)."""
        c = self.counts[0] if self.counts.size else np.zeros((2, self.k + 1), np.int64)
        return int(c.sum() if phase is None else c[phase].sum())

    def mean_r(self, phase: int | None = None) -> np.ndarray:
        """Mean r per MoE layer (float64 [n_moe_layers]); 0 where the layer saw no token."""
        c = self.counts.sum(axis=1) if phase is None else self.counts[:, phase]
        n = c.sum(axis=-1)
        return np.where(n > 0, (c * np.arange(self.k + 1)).sum(axis=-1) / np.maximum(n, 1), 0.0)

    def critical_slots_per_token(self, phase: int | None = None) -> float:
        """Critical expert slots per token summed over the MoE layers: what the latency model prices."""
        return float(self.mean_r(phase).sum())

    def active_share(self, phase: int | None = None) -> np.ndarray:
        """Per MoE layer, the share of its tokens with at least one critical slot (float64 [n_moe_layers])."""
        c = self.counts.sum(axis=1) if phase is None else self.counts[:, phase]
        n = c.sum(axis=-1)
        return np.where(n > 0, 1.0 - c[:, 0] / np.maximum(n, 1), 0.0)

    def active_layers_per_token(self, phase: int | None = None) -> float:
        """MoE layers per token where the token had at least one critical slot (the latency model's a)."""
        return float(self.active_share(phase).sum())

    def table(self) -> str:
        """A text table: one row per layer and phase that saw tokens, the share of tokens at each r."""
        head = "layer  phase    tokens  mean r  " + " ".join(f"r={r:<4d}" for r in range(self.k + 1))
        rows = [head]
        for m, il in enumerate(self.layers):
            for ph, name in enumerate(PHASE_NAMES):
                c = self.counts[m, ph]
                n = int(c.sum())
                if n == 0:
                    continue
                mean = float((c * np.arange(self.k + 1)).sum() / n)
                shares = " ".join(f"{x / n:6.3f}" for x in c)
                rows.append(f"{il:5d}  {name:7s} {n:7d}  {mean:6.2f}  {shares}")
        return "\n".join(rows)
