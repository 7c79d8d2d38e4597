"""The routed-expert tensor names (rapidmoe.moe_tensors) against gguf-py's table of llama.cpp's tensor names."""
from __future__ import annotations

import re

import pytest
from gguf import MODEL_TENSOR, TENSOR_NAMES

from rapidmoe.moe_tensors import (
    GATE_UP,
    LLAMA_FFN_EXPS_REGEX,
    ROLES,
    STACKED,
    SUFFIXES,
    ExpertName,
    expert_name,
    is_expert,
    moe_layers,
    parse_expert,
)

# llama.cpp's routed-expert tensors, as gguf-py names them
ROUTED = {"gate": MODEL_TENSOR.FFN_GATE_EXP, "up": MODEL_TENSOR.FFN_UP_EXP, "down": MODEL_TENSOR.FFN_DOWN_EXP,
          "gate_up": MODEL_TENSOR.FFN_GATE_UP_EXP}
# every other per-layer tensor gguf-py knows that names experts: shared, chunked, the expert norm, the bias
NOT_ROUTED = (MODEL_TENSOR.FFN_GATE_SHEXP, MODEL_TENSOR.FFN_UP_SHEXP, MODEL_TENSOR.FFN_DOWN_SHEXP,
              MODEL_TENSOR.FFN_GATE_INP_SHEXP, MODEL_TENSOR.FFN_GATE_CHEXP, MODEL_TENSOR.FFN_UP_CHEXP,
              MODEL_TENSOR.FFN_DOWN_CHEXP, MODEL_TENSOR.FFN_NORM_EXP, MODEL_TENSOR.FFN_EXP_PROBS_B,
              MODEL_TENSOR.FFN_GATE_INP, MODEL_TENSOR.FFN_GATE, MODEL_TENSOR.FFN_UP, MODEL_TENSOR.FFN_DOWN)


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("suffix", SUFFIXES)
def test_names_parse_as_gguf_py_writes_them(role: str, suffix: str) -> None:
    name = TENSOR_NAMES[ROUTED[role]].format(bid=17) + "." + suffix
    assert expert_name(17, role, suffix) == name
    assert parse_expert(name, SUFFIXES) == ExpertName(17, role, suffix)
    assert (parse_expert(name) is not None) == (suffix == "weight") == is_expert(name)
    assert (parse_expert(name, STACKED) is not None) == (suffix != "scale")
    assert re.search(LLAMA_FFN_EXPS_REGEX, name)  # llama.cpp's -ot pattern (--n-cpu-moe) matches it


@pytest.mark.parametrize("tensor", NOT_ROUTED, ids=lambda t: t.name)
def test_other_tensors_are_not_routed_experts(tensor: MODEL_TENSOR) -> None:
    for suffix in ("weight", "bias", "scale", "wr"):
        assert parse_expert(TENSOR_NAMES[tensor].format(bid=3) + "." + suffix, SUFFIXES) is None


def test_moe_layers_and_malformed_names() -> None:
    names = ["token_embd.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.1.ffn_gate_up_exps.weight",
             "blk.1.ffn_down_exps.weight", "blk.2.ffn_gate_exps.weight", "blk.2.ffn_up_exps.weight",
             "blk.2.ffn_down_exps.weight", "blk.10.ffn_down_exps.wr", "blk.11.ffn_up_exps.scale"]
    assert moe_layers(names) == [1, 2]  # merged gate_up counts; sidecar forms and scales alone do not
    assert parse_expert("blk.1.ffn_gate_up_exps.weight") == ExpertName(1, GATE_UP, "weight")
    for bad in ("blk..ffn_up_exps.weight", "blk.x.ffn_up_exps.weight", "blk.1.ffn_up_exps", "blk.1.ffn_up_exps.hi.x",
                "xblk.1.ffn_up_exps.weight", "blk.1.ffn_upgate_exps.weight", "blk.1.ffn__exps.weight"):
        assert parse_expert(bad, SUFFIXES) is None, bad
    with pytest.raises(ValueError, match="no routed-expert tensor"):
        expert_name(0, "shexp")
