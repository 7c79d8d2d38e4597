"""Every preset with every type flag (--wq, --wr, --other-type, with and without a --mix): the flag sets every tensor
it names, or the lines `convert` prints (resplit.report.flag_exceptions) name each one it leaves, with the reason.
Checked on a model's tensor table through the same type rules the converter writes (typechoice), without a build."""
from __future__ import annotations

from typing import Any

import pytest

from rapidmoe.moe_tensors import is_expert
from rapidmoe.resplit.codecs import codec_of
from rapidmoe.resplit.presets import OTHER_TYPES, PRESETS, WQ_TYPES, WR_TYPES, get_preset
from rapidmoe.resplit.report import flag_exceptions
from rapidmoe.resplit.typechoice import plan_expert, tensor_choice

# a two-layer qwen3moe-like table (ggml order: row length first), with one attention matrix whose rows of 100 values
# no quantized type's block divides, and one layer whose experts' rows (96) no K-quant super-block divides
TABLE: dict[str, tuple[int, ...]] = {
    "token_embd.weight": (256, 1000), "output_norm.weight": (256,), "output.weight": (256, 1000),
    **{f"blk.{il}.{n}": s for il in (0, 1) for n, s in {
        "attn_norm.weight": (256,), "attn_q.weight": (256, 256), "attn_k.weight": (256, 128),
        "attn_v.weight": (256, 128), "attn_output.weight": (256, 256), "ffn_norm.weight": (256,),
        "ffn_gate_inp.weight": (256, 8)}.items()},
    "blk.0.attn_odd.weight": (100, 64),
    "blk.0.ffn_gate_exps.weight": (256, 512, 8), "blk.0.ffn_up_exps.weight": (256, 512, 8),
    "blk.0.ffn_down_exps.weight": (512, 256, 8),
    "blk.1.ffn_gate_exps.weight": (96, 512, 8), "blk.1.ffn_up_exps.weight": (96, 512, 8),
    "blk.1.ffn_down_exps.weight": (512, 96, 8),
}
REFINE = [n for n, p in PRESETS.items() if codec_of(p).name == "q3k-refine1"]


def _report(preset: Any, table: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """What the converter records of the types it writes (the report's tensors, fallbacks and other_tensors)."""
    tensors, fallbacks, others = [], [], {}
    for name, shape in table.items():
        if is_expert(name):
            plan = plan_expert(name, shape, preset)
            copy = plan.role == "down" and preset.down_mode == "copy"
            tensors.append({"name": name, "wq_type": plan.wq, "sidecar_type": plan.hi, "sidecar_is_copy": copy})
            fallbacks += plan.describe_fallbacks()
        elif preset.other_mixture is None:  # (a mixture's types are llama.cpp's: no --other-type to check)
            ty, why = tensor_choice(name, shape, "F16", preset, preset.tensor_types(set(table)))
            others[name] = {"type": ty, "dims": len(shape), "rule": why}
    return {"tensors": tensors, "type_fallbacks": fallbacks, "other_tensors": others}


def _named(lines: list[str]) -> set[str]:
    return {n for line in lines for n in TABLE if n in line}


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("other", OTHER_TYPES)
def test_other_type_sets_every_non_expert_matrix_or_says_why(name: str, other: str) -> None:
    """The output head and token embedding included (refine's Q4_K head, the cpu presets' Q8_0 embedding gave way
    to the flag: issue 48); the routers stay F32 and the odd matrix takes F16 where the type's blocks do not fit its
    rows, and exactly those are named."""
    preset = get_preset(name, other=other)
    refine = codec_of(preset).name == "q3k-refine1"
    report = _report(preset, {n: s for n, s in TABLE.items() if not (refine and s[0] == 96)})
    left = {n for n, t in report["other_tensors"].items() if t["dims"] >= 2 and t["type"] != other}
    lines = flag_exceptions(report, {"--other-type": other})
    assert _named(lines) == left, lines
    assert report["other_tensors"]["output.weight"]["type"] == report["other_tensors"]["token_embd.weight"]["type"] \
        == other
    expected = set() if other == "F32" else {"blk.0.ffn_gate_inp.weight", "blk.1.ffn_gate_inp.weight"} | \
        ({"blk.0.attn_odd.weight"} if other == "Q8_0" else set())
    assert left == expected
    assert all("routers (ffn_gate_inp)" in line or "rows of 100 values are not whole Q8_0 blocks" in line
               for line in lines), lines


@pytest.mark.parametrize("name", [n for n in PRESETS if n not in REFINE])
@pytest.mark.parametrize(("flag", "field"), [("--wq", "wq"), ("--wr", "wr")])
def test_expert_type_flags_set_every_part_or_say_why(name: str, flag: str, field: str) -> None:
    """--wq and --wr on every residual preset, alone and under a --mix entry: the tensors they leave are the row-size
    fallbacks (layer 1's rows of 96) and the mix's, each named with its reason; down's copy is not --wr's."""
    for value in WQ_TYPES if field == "wq" else WR_TYPES:
        for mix in ("", "0.up=Q4_K/Q4_K"):
            try:
                preset = get_preset(name, **{field: value, "mix": mix or None})
            except ValueError:
                continue  # a combination the preset refuses (a down copy no better than its base): one line too
            report = _report(preset, TABLE)
            key = "wq_type" if field == "wq" else "sidecar_type"
            left = {t["name"] for t in report["tensors"]
                    if t[key] != value and not (field == "wr" and t["sidecar_is_copy"])}
            lines = flag_exceptions(report, {flag: value})
            assert _named(lines) == left, (name, value, mix, lines)
            assert all("(the mix's entry)" in line or "llama-quantize's fallback" in line for line in lines), lines
            if mix:
                assert any("blk.0.ffn_up_exps.weight at Q4_K (the mix's entry)" in line for line in lines) \
                    or value == "Q4_K", lines


@pytest.mark.parametrize("name", REFINE)
def test_refine_presets_take_no_expert_type_flag(name: str) -> None:
    """The refine codec fixes its base (Q3_K) and sidecar (one bit): another --wq or --wr is refused in one line,
    not left unapplied; REFINE1 and Q3_K, its own, set every routed expert."""
    for field, value in (("wq", "Q2_K"), ("wr", "Q4_K"), ("down_mode", "copy")):
        with pytest.raises(ValueError):
            get_preset(name, **{field: value})
    report = _report(get_preset(name, wq="Q3_K", wr="REFINE1"), {n: s for n, s in TABLE.items() if s[0] != 96})
    assert flag_exceptions(report, {"--wq": "Q3_K", "--wr": "REFINE1"}) == []
