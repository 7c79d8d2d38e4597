"""What Python knows about an attached residual sidecar: its pairing check, per-expert byte costs, and the
per-layer counters turned into a readable form. The graph work itself is C++ (src/rapidmoe_ggml/hooks).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import ModelFileError
from .ggufio import GGUFFile
from .moe_tensors import STACKED, parse_expert
from .resplit.codecs import by_sidecar_id
from .resplit.sidecar import check_pair, open_gguf


@dataclass(frozen=True)
class MoELayerCounters:
    layer: int
    tokens: int  # tokens routed through the layer
    slots: int  # expert slots: tokens x top-k
    critical_slots: int  # slots computed in high precision (WQ + WR)
    wq_bytes: int  # estimated bytes of WQ expert weights read: slots x one expert's gate+up+down, less down for
    #               critical slots in copy mode (their down comes from the copy; the CPU path skips WQ's)
    wr_bytes: int  # estimated bytes of sidecar weights read: critical slots x one expert's sidecar tensors

    @property
    def critical_fraction(self) -> float:
        return self.critical_slots / self.slots if self.slots else 0.0


@dataclass(frozen=True)
class ResidualInfo:
    path: Path
    n_expert_used: int
    down_mode: str  # "copy" or "residual"
    wq_bytes_per_expert: dict[int, int]  # layer -> bytes of one expert's WQ gate+up+down
    wr_bytes_per_expert: dict[int, int]  # layer -> bytes of one expert's sidecar tensors
    wq_down_bytes_per_expert: dict[int, int] = field(default_factory=dict)  # layer -> one expert's WQ down
    codec: str = "residual"  # the sidecar's codec by name (resplit/codecs/): "residual" or "q3k-refine1"

    def counters(self, raw: np.ndarray) -> list[MoELayerCounters]:
        out = []
        for il, (tokens, slots, crit) in enumerate(raw.tolist()):
            if il not in self.wq_bytes_per_expert:
                continue
            skipped = crit * self.wq_down_bytes_per_expert.get(il, 0) if self.down_mode == "copy" else 0
            out.append(MoELayerCounters(il, tokens, slots, crit, slots * self.wq_bytes_per_expert[il] - skipped,
                                        crit * self.wr_bytes_per_expert[il]))
        return out


def _per_expert_bytes(f: GGUFFile, role: str | None = None) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in f.tensors:
        e = parse_expert(t.name, STACKED)
        if e is not None and (role is None or e.role == role):
            if len(t.shape) < 3 or int(t.shape[2]) < 1:  # experts stacked in the third dimension
                raise ModelFileError(f"{f.path} is damaged: expert tensor {t.name} has shape {list(t.shape)}, not "
                                     "[n_in, n_out, n_expert]")
            out[e.layer] = out.get(e.layer, 0) + t.n_bytes // int(t.shape[2])
    return out


def load_residual_info(wq_path: str | os.PathLike[str], wr_path: str | os.PathLike[str], *,
                       verify: bool = True) -> ResidualInfo:
    """Check that the sidecar belongs to the base and that neither is damaged (ModelFileError otherwise) and read
    its costs. verify: also the base's tensor table and both files' sampled tensor data (check_pair)."""
    base, side = open_gguf(wq_path, "base", wr_path), open_gguf(wr_path, "sidecar", wq_path)
    meta = check_pair(base, side, verify=verify)
    codec = by_sidecar_id(meta.get("codec"))
    assert codec is not None  # check_pair refuses a codec this RapidMoE does not read
    arch = base.get("general.architecture")
    return ResidualInfo(path=Path(wr_path), n_expert_used=int(base.get(f"{arch}.expert_used_count", 0)),
                        down_mode=str(meta.get("preset.down_mode", "copy")),
                        wq_bytes_per_expert=_per_expert_bytes(base), wr_bytes_per_expert=_per_expert_bytes(side),
                        wq_down_bytes_per_expert=_per_expert_bytes(base, "down"),
                        codec=codec.name)
