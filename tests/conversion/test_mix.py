"""Per-layer / per-role routed-expert types (a preset's `mix`, rapidmoe/calibration/mix.py): the mix format and its
errors, the types and bits it gives, the greedy allocation on given measurements, a conversion whose tensors carry
the mixed types (read back from the files) and whose sidecar records the mix, split routing on the mixed pair
against an F32 model of its critical weights (gguf-py's numpy dequantization, not ours), and the measurement."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from reference.critical_model import write_critical_model
from reference.split_logits import STOCK_ORDER_ENV, all_logits, prompt_tokens, rel_error, stock_logits
from typer.testing import CliRunner

from rapidmoe import ModelFileError
from rapidmoe.calibration.mix import Sensitivity, allocate, measure_sensitivity, mix_preset
from rapidmoe.cli.app import app
from rapidmoe.ggml_types import bits_per_weight
from rapidmoe.ggufio import GGUFFile
from rapidmoe.placement.realize import sidecar_preset
from rapidmoe.resplit import convert, get_preset, read_sidecar_meta
from rapidmoe.resplit.presets import MixEntry, format_mix, parse_mix

MIX = "down=Q3_K,0.gate=Q4_K/Q3_K,1.down=Q4_K/Q6_K"


def test_mix_format_round_trips() -> None:
    entries = parse_mix(" 1.down=q4_k/q6_k, down=Q3_K ,0.gate=Q4_K/Q3_K")
    assert set(entries) == {MixEntry(None, "down", "Q3_K", None), MixEntry(0, "gate", "Q4_K", "Q3_K"),
                            MixEntry(1, "down", "Q4_K", "Q6_K")}
    assert format_mix(entries) == MIX
    assert parse_mix(format_mix(entries)) == tuple(sorted(entries, key=lambda e: (e.layer is not None, e.layer or 0)))


@pytest.mark.parametrize(("mix", "message"), [
    ("down", "is not [LAYER.]ROLE=WQ[/HI]"),
    ("ffn=Q2_K", "is not [LAYER.]ROLE=WQ[/HI]"),
    ("x.up=Q2_K", "is not [LAYER.]ROLE=WQ[/HI]"),
    ("up=", "is not [LAYER.]ROLE=WQ[/HI]"),
    ("up=Q9_K", "WQ type Q9_K not supported"),
    ("up=Q2_K/Q8_0", "WR type Q8_0 not supported"),
    ("down=Q3_K/Q3_K", "down copy type Q3_K not supported"),
    ("down=Q4_K", "would be no better than its base"),
    ("2.up=Q2_K,2.up=Q3_K", "2.up is given twice"),
])
def test_bad_mixes_are_refused(mix: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        get_preset("cpu-q8", mix=mix)


def test_the_refine_codec_takes_no_mix() -> None:
    with pytest.raises(ValueError, match="takes no mix"):
        get_preset("refine-q8", mix="down=Q3_K")


def test_types_and_bits_follow_the_mix() -> None:
    p = get_preset("cpu-q8", mix=MIX)
    assert p.expert_types(0, "gate") == ("Q4_K", "Q3_K")  # the layer's entry
    assert p.expert_types(0, "gate_up") == ("Q4_K", "Q3_K")  # a merged tensor takes gate's
    assert p.expert_types(0, "up") == ("Q2_K", "Q2_K")  # the preset's
    assert p.expert_types(0, "down") == ("Q3_K", "Q4_K")  # the role-wide entry, the preset's copy
    assert p.expert_types(1, "down") == ("Q4_K", "Q6_K")  # the layer's beats the role's
    # by hand, bits per weight: Q2_K 2.625, Q3_K 3.4375, Q4_K 4.5, Q6_K 6.5625; layers 0 and 1
    wq = ((4.5 + 2.625 + 3.4375) / 3 + (2.625 + 2.625 + 4.5) / 3) / 2
    crit0 = ((4.5 + 3.4375) + (2.625 + 2.625) + 4.5) / 3
    crit1 = ((2.625 + 2.625) * 2 + 6.5625) / 3
    b = p.bits([0, 1])
    assert b["wq"] == pytest.approx(wq) and b["critical"] == pytest.approx((crit0 + crit1) / 2)
    assert b["down_sidecar"] == pytest.approx((4.5 + 6.5625) / 2)
    assert p.bits() == b  # default: the layers the mix names
    assert get_preset("cpu-q8").bits([0, 1, 2]) == get_preset("cpu-q8").bits()  # no mix: the same everywhere


def _sens(table: dict[tuple[int, str], dict[str, float]], size: int = 1000) -> list[Sensitivity]:
    return [Sensitivity(layer, role, ty, kl, size, bits_per_weight(ty)) for (layer, role), kls in table.items()
            for ty, kl in kls.items()]


def test_allocation_spends_bits_where_they_save_most_kl() -> None:
    table = {(0, "down"): {"Q2_K": 0.010, "Q3_K": 0.003, "Q4_K": 0.001},
             (0, "gate"): {"Q2_K": 0.002, "Q3_K": 0.001, "Q4_K": 0.0005},
             (1, "down"): {"Q2_K": 0.001, "Q3_K": 0.0012, "Q4_K": 0.0011}}  # noisy: upgrades save nothing
    sens = _sens(table)
    q2, q3, q4 = 2.625, 3.4375, 4.5
    assert allocate(sens, q2) == dict.fromkeys(table, "Q2_K")
    # one step of 0.8125 bits on one tensor of three: (0, down) to Q3_K saves 0.007, the most per bit
    assert allocate(sens, (2 * q2 + q3) / 3) == {(0, "down"): "Q3_K", (0, "gate"): "Q2_K", (1, "down"): "Q2_K"}
    # 1.875 bits: Q4_K for (0, down) (0.009 saved over Q2_K, 0.0048 per bit) over Q3_K + gate's Q3_K
    got = allocate(sens, (2 * q2 + q4) / 3)
    assert got == {(0, "down"): "Q4_K", (0, "gate"): "Q2_K", (1, "down"): "Q2_K"}
    # everything affordable: (1, down) still stays at Q2_K (its upgrades measured no better)
    got = allocate(sens, 6.0)
    assert got == {(0, "down"): "Q4_K", (0, "gate"): "Q4_K", (1, "down"): "Q2_K"}
    with pytest.raises(Exception, match="below the cheapest types"):
        allocate(sens, 2.0)


def test_allocation_bills_a_row_size_fallback_at_the_type_written() -> None:
    """Rows that take no K-quant make Q2_K and Q4_K both a 4.5-bit fallback: the tensor costs 4.5 bits whichever is
    chosen (the lower-KL one), and a budget below that is refused, not met on paper."""
    sens = [Sensitivity(0, "down", "Q2_K", 0.010, 1000, 4.5), Sensitivity(0, "down", "Q4_K", 0.004, 1000, 4.5),
            Sensitivity(0, "gate", "Q2_K", 0.002, 1000, 2.625), Sensitivity(0, "gate", "Q4_K", 0.001, 1000, 4.5)]
    assert allocate(sens, (4.5 + 2.625) / 2) == {(0, "down"): "Q4_K", (0, "gate"): "Q2_K"}
    with pytest.raises(Exception, match=r"below the cheapest types' 3\.562"):
        allocate(sens, 3.0)


def test_mix_preset_gives_a_q4_k_down_a_larger_copy() -> None:
    p = mix_preset(get_preset("cpu-q8"), {(0, "down"): "Q4_K", (0, "gate"): "Q3_K", (0, "up"): "Q2_K"})
    assert p.mix == "0.gate=Q3_K,0.up=Q2_K,0.down=Q4_K/Q5_K" and p.name == "cpu-q8+mix"
    assert p.expert_types(0, "down") == ("Q4_K", "Q5_K")


@pytest.fixture(scope="module")
def mixed_pair(make_tiny, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:  # type: ignore[no-untyped-def]
    src = make_tiny("qwen3moe", "f16")
    res = convert(src, tmp_path_factory.mktemp("mix"), get_preset("cpu-q8", mix=MIX), progress=False)
    return src, res.wq_path, res.wr_path


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in GGUFFile(path).tensors}


def test_conversion_writes_the_mixed_types_and_records_the_mix(mixed_pair: tuple[Path, Path, Path]) -> None:
    _, wq, wr = mixed_pair
    base, side = _types(wq), _types(wr)
    layers = sorted({int(n.split(".")[1]) for n in base if n.endswith("_exps.weight")})
    assert len(layers) >= 2
    for il in layers:
        want = {"gate": ("Q4_K", "Q3_K") if il == 0 else ("Q2_K", "Q2_K"), "up": ("Q2_K", "Q2_K"),
                "down": ("Q4_K", "Q6_K") if il == 1 else ("Q3_K", "Q4_K")}
        for role, (wq_t, hi_t) in want.items():
            assert base[f"blk.{il}.ffn_{role}_exps.weight"] == wq_t
            assert side[f"blk.{il}.ffn_{role}_exps.{'hi' if role == 'down' else 'wr'}"] == hi_t
    assert read_sidecar_meta(wr)["preset.mix"] == MIX
    assert sidecar_preset(wr) == get_preset("cpu-q8", mix=MIX)


def test_a_sidecar_from_before_mixes_reads_back_without_one(mixed_pair: tuple[Path, Path, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Sidecars written before the mix field record no preset.mix: their preset reads back with none."""
    from rapidmoe.placement import realize  # noqa: PLC0415

    _, _, wr = mixed_pair
    meta = {k: v for k, v in read_sidecar_meta(wr).items() if k != "preset.mix"}
    monkeypatch.setattr(realize, "read_sidecar_meta", lambda _path: meta)
    assert realize.sidecar_preset(wr) == dataclasses.replace(get_preset("cpu-q8", mix=MIX), mix="")


def test_conversion_refuses_a_mix_the_model_cannot_take(make_tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = make_tiny("qwen3moe", "f16")
    with pytest.raises(ModelFileError, match=r"mix entry 99.down=Q3_K: .* has no routed experts in layer 99 "
                                             r"\(its MoE layers: 0-"):
        convert(src, tmp_path, get_preset("cpu-q8", mix="99.down=Q3_K"), progress=False)
    assert not list(tmp_path.iterdir())


@pytest.mark.usefixtures("plain_q8_0")
def test_split_routing_on_the_mixed_pair(mixed_pair: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, wq, wr = mixed_pair
    toks = prompt_tokens(wq)
    # r = 0: the .wq.gguf alone, bit for bit
    low = all_logits(wq, toks, residual_path=wr, n_critical=0)
    np.testing.assert_array_equal(low, all_logits(wq, toks))
    # r = k: every slot critical, an F32 model of the critical weights (K-quant dot products quantize the
    # activations to Q8_K, so float-level agreement, much closer than the base's)
    ref_path = tmp_path / "critical.gguf"
    write_critical_model(wq, wr, ref_path)
    ref = all_logits(ref_path, toks)
    f = GGUFFile(wq)
    k = int(f.get(f"{f.get('general.architecture')}.expert_used_count"))
    full = all_logits(wq, toks, residual_path=wr, n_critical=k)
    assert rel_error(full, ref) < 0.03, rel_error(full, ref)
    assert rel_error(full, ref) < 0.5 * rel_error(low, ref), (rel_error(full, ref), rel_error(low, ref))


@pytest.mark.stock
def test_the_mixed_wq_file_is_stocks_bit_for_bit(mixed_pair: tuple[Path, Path, Path], stock_bin: Path,
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mix's .wq.gguf is an ordinary llama.cpp file (Q2_K, Q3_K and Q4_K experts by layer and role): stock
    llama.cpp runs it, to the same logits as ours at r = 0 (our kernels that sum in another order switched off)."""
    for k, v in STOCK_ORDER_ENV.items():
        monkeypatch.setenv(k, v)
    _, wq, wr = mixed_pair
    toks = prompt_tokens(wq)
    ours = all_logits(wq, toks, residual_path=wr, n_critical=0)
    np.testing.assert_array_equal(ours, stock_logits(wq, toks, stock_bin, tmp_path))


def test_measured_sensitivity_orders_types(make_tiny) -> None:  # type: ignore[no-untyped-def]
    """Each tensor's KL shrinks from Q2_K to Q4_K (random weights: it orders, no more) and is never negative; a
    budget between the two makes a mix that the converter takes."""
    from testkit import TEXT  # noqa: PLC0415

    src = make_tiny("qwen3moe", "f16")
    sens = measure_sensitivity(src, TEXT.decode() * 40, ("Q2_K", "Q4_K"), n_ctx=64, chunks=2, threads=2,
                               progress=False)
    by = {(s.layer, s.role, s.type): s.kl for s in sens}
    keys = {(s.layer, s.role) for s in sens}
    assert len(sens) == 2 * len(keys) and {r for _, r in keys} == {"gate", "up", "down"}
    for layer, role in keys:
        assert 0 <= by[layer, role, "Q4_K"] < by[layer, role, "Q2_K"]
    choice = allocate(sens, 3.5)
    assert set(choice.values()) == {"Q2_K", "Q4_K"}
    get_preset("cpu-q8", mix=mix_preset(get_preset("cpu-q8"), choice).mix)


def test_cli_refuses_bad_mix_options(make_tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = make_tiny("qwen3moe", "f16")
    run = CliRunner().invoke
    res = run(app, ["convert", "--help"])
    assert res.exit_code == 0 and "--mix-bits" in res.output, res.output
    (tmp_path / "tiny.resplit.json").write_text("{}")  # an earlier conversion's: refused before measuring
    res = run(app, ["convert", str(src), "-o", str(tmp_path), "--name", "tiny", "--preset", "cpu-q8", "--mix-bits", "3",
                    "--mix-text", str(src)])
    assert res.exit_code != 0 and "tiny.resplit.json exists; pass --force" in res.output, res.output
    (tmp_path / "tiny.resplit.json").unlink()
    for args, message in [
        (["--mix", "down=Q9"], "WQ type Q9 not supported"),
        (["--mix-bits", "3", "--mix-text", str(src), "--mix-types", "Q2_K,IQ2_XXS"], "IQ2_XXS needs an importance"),
        (["--mix-bits", "3"], "--mix-bits needs --mix-text"),
        (["--mix-text", str(src)], "give --mix-bits too"),
        (["--mix", "down=Q3_K", "--mix-bits", "3", "--mix-text", str(src)], "not both"),
        (["--mix-bits", "3", "--mix-text", str(tmp_path / "none.txt")], "not found"),
    ]:
        res = run(app, ["convert", str(src), "-o", str(tmp_path), "--preset", "cpu-q8", *args])
        assert res.exit_code != 0 and message in res.output, (args, res.output)
        assert not list(tmp_path.glob("*.gguf"))
