"""Bytes of a model under a type rule, grouped the way placement moves them: whole parts (attention, norms, ...),
one routed expert per MoE layer (the unit an expert cache holds), and the RESplit sidecar (always in DRAM); and how
much of each the CPU uses in place from the mapped file rather than repacked (resident.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ggml_types import tensor_bytes
from ..resplit.codecs import codec_of
from ..resplit.presets import Preset
from .resident import Repacks, machine_repacks, used_in_place
from .tensors import ROUTED, ModelShapes
from .typeplan import TypeRule, sidecar_bytes, sidecar_type


@dataclass(frozen=True)
class Footprint:
    parts: dict[str, int]  # part -> bytes of its (non-routed) tensors
    expert_bytes: dict[int, int]  # MoE layer -> bytes of ONE expert's gate+up+down in the main (WQ / Q4) form
    sidecar: dict[str, int] = field(default_factory=dict)  # RESplit .wr.gguf contents by role: label -> bytes
    n_expert: int = 0
    # what stays file-backed in CPU memory (used in place from the mapped file, not repacked): part -> bytes,
    # MoE layer -> its experts are, sidecar label -> bytes (repacking on; with it off everything is in place)
    in_place: dict[str, int] = field(default_factory=dict)
    experts_in_place: dict[int, bool] = field(default_factory=dict)
    sidecar_in_place: dict[str, int] = field(default_factory=dict)

    @property
    def routed_bytes(self) -> int:
        return sum(self.expert_bytes.values()) * self.n_expert


def footprint(model: ModelShapes, rule: TypeRule, preset: Preset | None = None,
              repacks: Repacks | None = None) -> Footprint:
    """Apply `rule` to every tensor; with a preset, also size the sidecar (gate/up residual, down copy/residual).
    repacks: what the CPU repacks (default: this machine's, resident.machine_repacks)."""
    repacks = repacks or machine_repacks()
    k = model.n_expert_used
    parts: dict[str, int] = {}
    experts: dict[int, int] = {}
    sidecar: dict[str, int] = {}
    in_place: dict[str, int] = {}
    experts_in_place: dict[int, bool] = {}
    sidecar_in_place: dict[str, int] = {}
    for t in model.tensors:
        ty = rule(t)
        n = tensor_bytes(ty, t.shape)
        plain = used_in_place(t, ty, repacks, k)
        if t.part != ROUTED:
            parts[t.part] = parts.get(t.part, 0) + n
            in_place[t.part] = in_place.get(t.part, 0) + (n if plain else 0)
            continue
        assert t.layer is not None and len(t.shape) == 3
        experts[t.layer] = experts.get(t.layer, 0) + n // t.shape[2]  # experts are the outermost dimension
        experts_in_place[t.layer] = experts_in_place.get(t.layer, True) and plain
        if preset is not None:
            codec = codec_of(preset)
            label = codec.footprint_label(t.role or "", preset)
            nb = sidecar_bytes(t, preset)
            sidecar[label] = sidecar.get(label, 0) + nb
            # the refine codec's bit planes have no repacked layout; a residual is repacked where the experts are
            side_plain = not codec.sidecar_repacks or plain or used_in_place(t, sidecar_type(t, preset), repacks, k)
            sidecar_in_place[label] = sidecar_in_place.get(label, 0) + (nb if side_plain else 0)
    return Footprint(parts, experts, sidecar, model.n_expert, in_place, experts_in_place, sidecar_in_place)
