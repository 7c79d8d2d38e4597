"""llama.cpp's routed-expert tensor names, the one definition every module that looks for MoE layers uses: the
roles, the suffixes (the model's and RESplit's sidecar forms), parsing a name and finding the MoE layers of a file.

A routed-expert tensor is `blk.<layer>.ffn_<role>_exps.<suffix>`, stacked [n_in, n_out, n_expert] as llama.cpp's
shared MoE builder (build_moe_ffn) reads it. Names only: what a tensor's type or shape may be belongs to its user.
"""
from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from typing import NamedTuple

# roles: separate gate, up and down projections, or gate and up merged into one tensor (gate's rows, then up's:
# qwen35moe, deepseek2, ...); every MoE layer has down and either gate + up or gate_up
GATE, UP, DOWN, GATE_UP = "gate", "up", "down", "gate_up"
ROLES = (GATE, UP, DOWN, GATE_UP)

# suffixes: the model's weights (WQ in a RESplit pair), llama.cpp's per-expert scales ([n_expert]), and the RESplit
# sidecar's forms: wr (a residual), hi (down's high-precision copy), rf (the refine codec's bit planes)
WEIGHT, SCALE, RESIDUAL, COPY, REFINE = "weight", "scale", "wr", "hi", "rf"
SIDECAR_FORMS = (RESIDUAL, COPY, REFINE)
STACKED = (WEIGHT, *SIDECAR_FORMS)  # the forms stacked [n_in, n_out, n_expert]
SUFFIXES = (*STACKED, SCALE)

EXPERT_NAME_RE = re.compile(rf"^blk\.(\d+)\.ffn_({'|'.join(ROLES)})_exps\.({'|'.join(SUFFIXES)})$")

# llama.cpp's -ot pattern for the routed experts (common.h: LLM_FFN_EXPS_REGEX, llm_ffn_block_regex()), which also
# matches the chunked experts (_chexps) that RESplit does not split; a search pattern, not a full name
LLAMA_FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


class ExpertName(NamedTuple):
    layer: int
    role: str  # one of ROLES
    suffix: str  # one of SUFFIXES


def parse_expert(name: str, suffixes: Collection[str] = (WEIGHT,)) -> ExpertName | None:
    """The layer, role and suffix of a routed-expert tensor name whose suffix is one of `suffixes` (the weight by
    default), else None."""
    m = EXPERT_NAME_RE.match(name)
    if m is None or m.group(3) not in suffixes:
        return None
    return ExpertName(int(m.group(1)), m.group(2), m.group(3))


def is_expert(name: str) -> bool:
    """A routed-expert weight tensor (`blk.N.ffn_<role>_exps.weight`)."""
    return parse_expert(name) is not None


def expert_name(layer: int, role: str, suffix: str = WEIGHT) -> str:
    """The name of a routed-expert tensor."""
    if role not in ROLES or suffix not in SUFFIXES:
        raise ValueError(f"no routed-expert tensor has role {role!r} and suffix {suffix!r}")
    return f"blk.{layer}.ffn_{role}_exps.{suffix}"


def moe_layers(names: Iterable[str]) -> list[int]:
    """The layers that have routed experts (any role's weight: separate gate/up/down or merged gate_up), in order."""
    return sorted({e.layer for n in names if (e := parse_expert(n)) is not None})
