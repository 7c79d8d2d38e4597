"""Overlap of the CPU's residual work with the device's WQ work: modes and the timing it records.

With the routed WQ experts on another device (a GPU, an RPC stand-in), each split layer hands its critical
slots' residual matmuls to a worker thread (its own CPU backend) in a `begin` op and collects them in a `join`
op after the device's WQ matmuls, so both run at once (docs/execution.md). These are the Python-side names for
the modes and the per-stage timing the ops record.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import RapidMoEError

MODES = {"off": 0, "auto": 1, "on": 2}
STAGES = ("gate_up", "down")


def overlap_mode(mode: str) -> int:
    """The C mode for "off" (residual work after the device's), "auto" (overlap where WQ is on a device) or "on"
    (every split layer, also all-CPU: same results, for tests)."""
    try:
        return MODES[mode]
    except (KeyError, TypeError):
        raise RapidMoEError(f"overlap must be one of {', '.join(MODES)}, got {mode!r}") from None


@dataclass(frozen=True)
class StageTiming:
    """Sums over every begin/join pair of one stage (all layers), in milliseconds."""

    pairs: int  # begin/join pairs run (layers x graph computations)
    cpu_ms: float  # the worker computing the residual matmuls
    device_ms: float  # begin returned -> join started: the device's WQ work and the copies around it
    wait_ms: float  # join blocked on the worker after the device's results had arrived
    wall_ms: float  # begin started -> join done: the stage as the layer sees it

    @property
    def serial_ms(self) -> float:
        """What the stage would take with the two paths one after the other."""
        return self.cpu_ms + self.device_ms

    @property
    def hidden_ms(self) -> float:
        """Work of one path that ran while the other did (serial minus wall; 0 when nothing overlapped)."""
        return max(0.0, self.serial_ms - self.wall_ms)

    @property
    def hidden_fraction(self) -> float:
        """hidden_ms over the shorter path: 1 = the shorter path was hidden entirely."""
        shorter = min(self.cpu_ms, self.device_ms)
        return self.hidden_ms / shorter if shorter > 0 else 0.0


@dataclass(frozen=True)
class OverlapStats:
    gate_up: StageTiming
    down: StageTiming

    @classmethod
    def from_raw(cls, raw: Any) -> OverlapStats:
        """From `_core.overlap_stats` (int64 [2, 5]: pairs, then ns of cpu, device, wait, wall)."""
        stages = [StageTiming(int(r[0]), *(float(v) / 1e6 for v in r[1:5])) for r in raw]
        return cls(*stages)

    @property
    def pairs(self) -> int:
        return self.gate_up.pairs + self.down.pairs

    def as_dict(self) -> dict[str, dict[str, float]]:
        out = {}
        for name in STAGES:
            s: StageTiming = getattr(self, name)
            out[name] = {"pairs": s.pairs, "cpu_ms": s.cpu_ms, "device_ms": s.device_ms, "wait_ms": s.wait_ms,
                         "wall_ms": s.wall_ms, "hidden_ms": s.hidden_ms, "hidden_fraction": s.hidden_fraction}
        return out
