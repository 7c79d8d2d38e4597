"""How often each routed expert is chosen, per MoE layer: the input to expert caching.

Sources: a `.npy` array [n_moe_layers or n_layer, n_expert]; a JSON list of per-layer lists, or an object
{"<layer>": [counts...]}; or a llama.cpp GGUF imatrix (ours or llama-imatrix's), whose `.counts` of each
routed-expert weight are the number of tokens routed to each expert during calibration. No table: uniform.
Counts may also be summed router weights instead of token counts; the planner only uses their proportions.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import RapidMoEError
from ..moe_tensors import DOWN, parse_expert
from ..resplit.imatrix import read_imatrix


class FrequencyError(RapidMoEError, ValueError):
    """A frequency table that cannot be read or does not match the model."""


@dataclass(frozen=True)
class ExpertFrequency:
    """Per MoE layer, a share of that layer's routed slots per expert (each row sums to 1)."""

    share: dict[int, np.ndarray]  # MoE layer index -> [n_expert] float64, sums to 1
    source: str  # "uniform" or the file it came from

    @staticmethod
    def uniform(layers: list[int], n_expert: int) -> ExpertFrequency:
        return ExpertFrequency({il: np.full(n_expert, 1.0 / n_expert) for il in layers}, "uniform")

    @staticmethod
    def from_counts(counts: dict[int, np.ndarray], source: str) -> ExpertFrequency:
        """Normalise per layer; a layer with no counts at all becomes uniform."""
        share = {}
        for il, c in counts.items():
            c = np.asarray(c, dtype=np.float64).reshape(-1)
            if (c < 0).any() or not np.isfinite(c).all():
                raise FrequencyError(f"{source}: layer {il} has negative or non-finite counts")
            if c.size == 0:
                raise FrequencyError(f"{source}: layer {il} has no experts")
            total = c.sum()
            if not np.isfinite(total):
                raise FrequencyError(f"{source}: layer {il}'s counts sum past the float range")
            share[il] = c / total if total > 0 else np.full(c.size, 1.0 / c.size)
        return ExpertFrequency(share, source)

    def for_model(self, layers: list[int], n_expert: int) -> ExpertFrequency:
        """Check the table covers exactly these MoE layers with n_expert experts each."""
        if sorted(self.share) != sorted(layers):
            raise FrequencyError(f"{self.source}: frequency table has layers {_ranges(sorted(self.share))}, "
                                 f"the model's MoE layers are {_ranges(layers)}")
        for il, s in self.share.items():
            if s.size != n_expert:
                raise FrequencyError(f"{self.source}: layer {il} has {s.size} experts, the model has {n_expert}")
        return self


def _ranges(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]} ({len(layers)})" if layers else "none"


def _rows_to_layers(rows: np.ndarray, layers: list[int], n_layer: int, source: str) -> dict[int, np.ndarray]:
    """A 2-D table is either one row per MoE layer or one row per layer (dense layers' rows ignored)."""
    if rows.ndim != 2:
        raise FrequencyError(f"{source}: expected a 2-D table [layers, experts], got shape {rows.shape}")
    if rows.shape[0] == len(layers):
        return {il: rows[i] for i, il in enumerate(layers)}
    if rows.shape[0] == n_layer:
        return {il: rows[il] for il in layers}
    raise FrequencyError(f"{source}: table has {rows.shape[0]} rows; the model has {len(layers)} MoE layers "
                         f"({n_layer} layers in all)")


def read_frequency(path: str | os.PathLike[str], layers: list[int], n_layer: int) -> dict[int, np.ndarray]:
    """Raw per-layer counts from a .npy, .json or GGUF imatrix file (see the module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise FrequencyError(f"frequency file not found: {p}")
    with p.open("rb") as f:
        magic = f.read(4)
    try:
        if magic == b"GGUF":
            return _from_imatrix(p)
        if p.suffix == ".npy":
            return _rows_to_layers(np.load(p, allow_pickle=False).astype(np.float64), layers, n_layer, str(p))
        data = json.loads(p.read_text())
    except (ValueError, OSError, RecursionError) as e:
        if isinstance(e, FrequencyError):
            raise
        raise FrequencyError(f"cannot read frequency table {p}: {e}") from e
    if isinstance(data, dict) and "layers" in data:
        data = data["layers"]
    if isinstance(data, dict):
        try:
            return {int(k): np.asarray(v, dtype=np.float64) for k, v in data.items()}
        except (TypeError, ValueError, OverflowError) as e:
            raise FrequencyError(f"{p}: expected {{\"<layer>\": [counts...]}}: {e}") from e
    if isinstance(data, list):
        try:
            rows = np.asarray(data, dtype=np.float64)
        except (TypeError, ValueError, OverflowError) as e:
            raise FrequencyError(f"{p}: expected rows of counts, all of one length ({e})") from e
        return _rows_to_layers(rows, layers, n_layer, str(p))
    raise FrequencyError(f"{p}: expected a list of per-layer count lists or an object of them")


def _from_imatrix(p: Path) -> dict[int, np.ndarray]:
    im = read_imatrix(p)
    out: dict[int, np.ndarray] = {}
    for name, c in im.counts.items():
        e = parse_expert(name)  # gate's, up's or gate_up's counts: the tokens routed to each expert
        if e is not None and e.role != DOWN and e.layer not in out:
            out[e.layer] = np.asarray(c, dtype=np.float64).reshape(-1)
    if not out:
        raise FrequencyError(f"{p}: imatrix has no routed-expert entries (blk.N.ffn_up_exps.weight); "
                             "it cannot give expert frequencies")
    return out


def load_frequency(path: str | os.PathLike[str] | None, layers: list[int], n_layer: int,
                   n_expert: int) -> ExpertFrequency:
    """The frequency table for a model, checked against its MoE layers; uniform when path is None."""
    if path is None:
        return ExpertFrequency.uniform(layers, n_expert)
    counts = read_frequency(path, layers, n_layer)
    return ExpertFrequency.from_counts(counts, str(path)).for_model(layers, n_expert)
