"""Which ggml type each tensor of a RESplit conversion gets: a pure function of the tensor's name and shape and the
preset. The converter (convert.py) writes these types; the planner (placement/typeplan.py) sizes them, so both
follow the same rules, row-size fallbacks included.

Routed experts: WQ and the sidecar part in the preset's types, or llama-quantize's fallback where a row is not
whole blocks of them (ggml_types.fit_type). Other tensors: the preset's own type for the token embedding / output
head where its rows fit; else, with a mixture preset (other = Q4_K_M, ...), llama-quantize's type for it; else F32
for vectors, norms, the router and biases, and preset.other where its rows fit (F16 where not).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..errors import ModelFileError
from ..ggml_types import fit_type, fits_rows
from ..moe_tensors import parse_expert
from .codecs import codec_of
from .presets import Preset

# kept F32 (outside a mixture): norms, the router (ffn_gate_inp), biases, DeepSeek's expert-selection bias
KEEP_F32_RE = re.compile(r"(_norm|_inp|\.bias$|exp_probs_b)")
NORM_RE = re.compile(r"_norm")
FLOAT_TYPES = ("F32", "F16", "BF16")

# a mixture's type for one non-expert tensor: (name, shape, stored type) -> type name
MixtureRule = Callable[[str, tuple[int, ...], str], str]


@dataclass(frozen=True)
class ExpertPlan:
    """One routed-expert tensor's split: its role and the types its WQ and sidecar parts get (after fallback)."""

    name: str
    role: str  # gate, up, down, gate_up
    wq: str
    hi: str  # the sidecar tensor's type (residual, or down's copy; REFINE1: the refine codec's bits: codecs/)
    fallbacks: tuple[tuple[str, str, str], ...]  # (part, asked type, type used) where the row size forced a change

    def describe_fallbacks(self) -> list[str]:
        return [f"{self.name} {part} {asked}->{used}" for part, asked, used in self.fallbacks]


def plan_expert(name: str, shape: tuple[int, ...], preset: Preset) -> ExpertPlan:
    """The types of a routed-expert tensor's WQ and sidecar parts (shape in ggml order: rows of shape[0]): the
    preset's, or its mix's entry for the tensor's layer and role."""
    e = parse_expert(name)
    if e is None:
        raise ValueError(f"{name} is not a routed-expert tensor")
    role = e.role
    n_in = int(shape[0])
    wq, hi = preset.expert_types(e.layer, role)
    asked = {"wq": wq, "sidecar": hi}
    # the sidecar part's fallback is its codec's (the refine codec's REFINE1, one bit per weight, is no ggml type and
    # has none: the converter refuses rows that are not whole Q3_K super-blocks)
    used = {"wq": fit_type(wq, n_in), "sidecar": codec_of(preset).fit_sidecar(hi, n_in)}
    fallbacks = tuple((part, asked[part], used[part]) for part in asked if used[part] != asked[part])
    return ExpertPlan(name, role, used["wq"], used["sidecar"], fallbacks)


def check_expert_plan(plan: ExpertPlan, n_in: int) -> None:
    """Refuse a routed-expert tensor whose WQ no quantized type takes."""
    if plan.wq == "F16":
        raise ModelFileError(f"tensor {plan.name} has rows of {n_in} values, which no quantized type "
                             f"takes (not a multiple of 32): its WQ would be F16, nothing to split")


def exact_mixture(types: Mapping[str, str]) -> MixtureRule:
    """A mixture rule from llama.cpp's own per-tensor plan (what `llama-quantize` of the file gives each tensor)."""
    def rule(name: str, shape: tuple[int, ...], stored: str) -> str:
        del shape, stored
        if name not in types:
            raise ModelFileError(f"llama.cpp's quantization plan has no tensor {name}")
        return types[name]
    return rule


def tensor_type(name: str, shape: tuple[int, ...], stored: str, preset: Preset, overrides: Mapping[str, str],
                mixture: MixtureRule | None = None) -> str:
    """Type name of a non-expert tensor in the WQ file. `overrides` are Preset.tensor_types of the file's names;
    `mixture` gives llama-quantize's type of each tensor when the preset's `other` is a mixture (required then)."""
    return tensor_choice(name, shape, stored, preset, overrides, mixture)[0]


def tensor_choice(name: str, shape: tuple[int, ...], stored: str, preset: Preset, overrides: Mapping[str, str],
                  mixture: MixtureRule | None = None) -> tuple[str, str]:
    """tensor_type, and the rule that chose it: "other" where the tensor took preset.other itself, else why not
    (the words `convert` prints for a tensor its --other-type leaves)."""
    if mixture is None and preset.other_mixture is not None:
        raise ValueError(f"preset {preset.name}: other = {preset.other} needs llama.cpp's per-tensor plan (mixture)")
    fixed = overrides.get(name)
    if fixed is not None and fits_rows(fixed, int(shape[0])):
        return fixed.upper(), f"the preset's own type for {name.removesuffix('.weight')}"
    if mixture is not None:
        ty = mixture(name, shape, stored)
        # a norm weight multiplies activations elementwise, which ggml's CPU does not do from a quantized type:
        # the pinned llama-quantize quantizes 2-D norms it does not recognize (qwen4exp's ple_norm_*: its own Q4_K_M
        # of that model aborts in binary_op); they stay as stored
        if NORM_RE.search(name) and ty not in FLOAT_TYPES:
            return stored, "a norm, kept as stored: ggml's CPU multiplies by norms only in float types"
        return ty, "other"
    if len(shape) == 1 or KEEP_F32_RE.search(name):
        return "F32", ("a vector" if len(shape) == 1 else
                       "routers (ffn_gate_inp), norms and biases stay F32, as in llama-quantize")
    other = preset.other.upper()
    if not fits_rows(other, int(shape[0])):
        return ("F16" if other != "F32" else other), f"rows of {int(shape[0])} values are not whole {other} blocks"
    return other, "other"
