"""Bytes of a model under a type rule, grouped the way placement moves them: whole parts (attention, norms, ...),
one routed expert per MoE layer (the unit an expert cache holds), and the RESplit sidecar (always in DRAM).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ggml_types import tensor_bytes
from ..resplit.presets import Preset
from .tensors import ROUTED, ModelShapes
from .typeplan import TypeRule, sidecar_bytes


@dataclass(frozen=True)
class Footprint:
    parts: dict[str, int]  # part -> bytes of its (non-routed) tensors
    expert_bytes: dict[int, int]  # MoE layer -> bytes of ONE expert's gate+up+down in the main (WQ / Q4) form
    sidecar: dict[str, int] = field(default_factory=dict)  # RESplit .wr.gguf contents by role: label -> bytes
    n_expert: int = 0

    @property
    def routed_bytes(self) -> int:
        return sum(self.expert_bytes.values()) * self.n_expert


def footprint(model: ModelShapes, rule: TypeRule, preset: Preset | None = None) -> Footprint:
    """Apply `rule` to every tensor; with a preset, also size the sidecar (gate/up residual, down copy/residual)."""
    parts: dict[str, int] = {}
    experts: dict[int, int] = {}
    sidecar: dict[str, int] = {}
    for t in model.tensors:
        n = tensor_bytes(rule(t), t.shape)
        if t.part != ROUTED:
            parts[t.part] = parts.get(t.part, 0) + n
            continue
        assert t.layer is not None and len(t.shape) == 3
        experts[t.layer] = experts.get(t.layer, 0) + n // t.shape[2]  # experts are the outermost dimension
        if preset is not None:
            label = _sidecar_label(t.role or "", preset)
            sidecar[label] = sidecar.get(label, 0) + sidecar_bytes(t, preset)
    return Footprint(parts, experts, sidecar, model.n_expert)


def _sidecar_label(role: str, preset: Preset) -> str:
    if preset.is_refine:
        return "refinement bits (REFINE1, gate/up/down)"
    if role == "down":
        if preset.down_mode == "copy":
            return f"down copy ({preset.down_hi})"
        return f"WR down residual ({preset.wr})"
    return f"WR gate/up residual ({preset.wr})"
