"""RESplit presets: which ggml types hold WQ (low-bit, GPU-resident), WR (residual, CPU) and the critical down path.

Pure data and arithmetic (no extension import): bits per weight come from ggml_types (gguf-py's block sizes).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..ggml_types import bits_per_weight

# types the converter accepts for each role (the minimum set, plus what costs nothing to allow)
WQ_TYPES = ("IQ1_M", "IQ2_XXS", "IQ2_XS", "Q2_K", "IQ3_XXS", "Q3_K")
# a mix (per layer and role) may also give a tensor's WQ a Q4_K: the sensitive ones (calibration/mix.py)
MIX_WQ_TYPES = (*WQ_TYPES, "Q4_K")
WR_TYPES = ("Q2_K", "Q3_K", "Q4_K")
DOWN_COPY_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
OTHER_TYPES = ("Q8_0", "F16", "F32")
TENSOR_OVERRIDE_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16")
# llama-quantize's per-tensor mixtures (llama_ftype ids) for the non-expert tensors: each gets exactly the type a
# stock quantization of the same file to that mixture gives it (llama.cpp decides, through patch 0003), so the
# WQ file differs from a stock Q4_K_M (say) only in its routed experts
OTHER_MIXTURES = {"Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17}
# llama-quantize refuses these without an importance matrix (ggml asserts on the first three)
NEEDS_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS")
DOWN_MODES = ("copy", "residual", "refine")
# the refine codec (refine.py): WQ is Q3_K with scales fitted for a 16-level grid and the sidecar holds one
# refinement bit per weight of every role (gate, up and down), no scales of its own
REFINE_WR = "REFINE1"
REFINE_WQ = "Q3_K"
REFINE_CODEC = "q3k-refine1"  # the sidecar's rapidmoe.residual.codec
REFINE_BITS = 1.0
# the roles a mix entry names (a merged gate_up tensor takes gate's entry)
MIX_ROLES = ("gate", "up", "down")


@dataclass(frozen=True)
class MixEntry:
    """One entry of a preset's mix: the routed-expert types of one role in one layer (layer None: every layer)."""

    layer: int | None
    role: str
    wq: str
    hi: str | None  # the sidecar part's type (None: the preset's)

    def key(self) -> str:
        return self.role if self.layer is None else f"{self.layer}.{self.role}"

    def __str__(self) -> str:
        return f"{self.key()}={self.wq}" + (f"/{self.hi}" if self.hi is not None else "")


def parse_mix(text: str) -> tuple[MixEntry, ...]:
    """A mix string, `[LAYER.]ROLE=WQ[/HI]` entries separated by commas (e.g. `down=Q3_K,0.gate=Q4_K/Q3_K`), as
    entries; ValueError naming the bad entry. Types are upper-cased; a key given twice is an error."""
    out: list[MixEntry] = []
    seen: set[str] = set()
    for raw in (x.strip() for x in text.split(",")):
        if not raw:
            continue
        key, eq, types = raw.partition("=")
        layer_s, dot, role = key.strip().rpartition(".")
        if not eq or not types.strip() or role not in MIX_ROLES or (dot and not layer_s.isdigit()):
            raise ValueError(f"mix entry {raw!r} is not [LAYER.]ROLE=WQ[/HI] with ROLE one of {', '.join(MIX_ROLES)}")
        wq, _, hi = types.strip().partition("/")
        entry = MixEntry(int(layer_s) if dot else None, role, wq.strip().upper(), hi.strip().upper() or None)
        if entry.key() in seen:
            raise ValueError(f"mix entry {raw!r}: {entry.key()} is given twice")
        seen.add(entry.key())
        out.append(entry)
    return tuple(out)


def format_mix(entries: Iterable[MixEntry]) -> str:
    """The canonical mix string (role-wide entries first, then by layer and role)."""
    order = {r: i for i, r in enumerate(MIX_ROLES)}
    return ",".join(str(e) for e in sorted(entries, key=lambda e: (e.layer is not None, e.layer or 0, order[e.role])))


@dataclass(frozen=True)
class Preset:
    """One RESplit configuration. down_mode 'copy': critical experts use a `down_type` copy of down (the
    paper's choice); 'residual': down gets a WR residual like gate and up; 'refine' (with wr REFINE1 and wq Q3_K
    only): the refine codec, one refinement bit per weight of gate, up and down (refine.py)."""

    name: str
    wq: str  # routed experts, every expert, all of gate/up/down: the low-precision model
    wr: str  # residual W - deq(WQ) of gate/up (and of down in residual mode)
    down_mode: str = "copy"
    down_type: str = "Q4_K"  # the copy's type ('copy' mode only)
    other: str = "Q8_0"  # attention, shared experts, dense FFN, embeddings, output: one type or a mixture
    token_embd: str | None = None  # the token embedding's type over `other` (it is read one row per token)
    output: str | None = None  # the output head's type over `other`
    description: str = ""
    # per-layer / per-role routed-expert types over wq and the sidecar's (parse_mix's format; "" = none), e.g.
    # what calibration.mix.choose_mix measured on calibration text; recorded in the sidecar with the other fields
    mix: str = ""

    def __post_init__(self) -> None:
        if self.wq.upper() not in WQ_TYPES:
            raise ValueError(f"WQ type {self.wq} not supported; choose one of {', '.join(WQ_TYPES)}")
        if self.wr.upper() == REFINE_WR or self.down_mode == "refine":
            self._check_refine()
        elif self.wr.upper() not in WR_TYPES:
            raise ValueError(f"WR type {self.wr} not supported; choose one of {', '.join((*WR_TYPES, REFINE_WR))}")
        if self.down_mode not in DOWN_MODES:
            raise ValueError(f"down_mode must be one of {', '.join(map(repr, DOWN_MODES))}, not {self.down_mode!r}")
        if self.down_mode == "copy" and self.down_type.upper() not in DOWN_COPY_TYPES:
            raise ValueError(f"down copy type {self.down_type} not supported; "
                             f"choose one of {', '.join(DOWN_COPY_TYPES)}")
        if self.other.upper() not in OTHER_TYPES and self.other.upper() not in OTHER_MIXTURES:
            raise ValueError(f"type for other tensors {self.other} not supported; choose one of "
                             f"{', '.join(OTHER_TYPES + tuple(OTHER_MIXTURES))}")
        for role, ty in (("token_embd", self.token_embd), ("output", self.output)):
            if ty is not None and ty.upper() not in TENSOR_OVERRIDE_TYPES:
                raise ValueError(f"{role} type {ty} not supported; choose one of {', '.join(TENSOR_OVERRIDE_TYPES)}")
        if self.mix:
            self._check_mix()

    def _check_refine(self) -> None:
        """The refine codec comes whole: WR REFINE1, down_mode 'refine' (every role refined) and WQ Q3_K."""
        if self.wr.upper() != REFINE_WR:
            raise ValueError(f"down_mode 'refine' is the refine codec's: it needs WR {REFINE_WR}, not {self.wr} "
                             "(WR types are residuals with down 'copy' or 'residual')")
        if self.down_mode != "refine":
            raise ValueError(f"WR {REFINE_WR} (the refine codec) refines gate, up and down alike: down_mode must be "
                             f"'refine', not {self.down_mode!r}")
        if self.wq.upper() != REFINE_WQ:
            raise ValueError(f"WR {REFINE_WR} refines a {REFINE_WQ} base whose scales it fits itself; WQ {self.wq} "
                             f"cannot be refined (use WQ {REFINE_WQ}, or a residual WR type)")

    def _check_mix(self) -> None:
        """Every mix entry in the types its role takes; a down copy better than its base."""
        if self.is_refine:
            raise ValueError("the refine codec fits its own Q3_K base for every tensor: it takes no mix")
        for e in parse_mix(self.mix):
            if e.wq not in MIX_WQ_TYPES:
                raise ValueError(f"mix entry {e}: WQ type {e.wq} not supported; choose one of "
                                 f"{', '.join(MIX_WQ_TYPES)}")
            wq, hi = self.expert_types(e.layer, e.role)
            if e.role == "down" and self.down_mode == "copy":
                if hi not in DOWN_COPY_TYPES:
                    raise ValueError(f"mix entry {e}: down copy type {hi} not supported; choose one of "
                                     f"{', '.join(DOWN_COPY_TYPES)}")
                if bits_per_weight(hi) <= bits_per_weight(wq):
                    raise ValueError(f"mix entry {e}: down's copy ({hi}) would be no better than its base ({wq}); "
                                     f"give it a larger type (`{e.key()}={wq}/HI`)")
            elif hi not in WR_TYPES:
                raise ValueError(f"mix entry {e}: WR type {hi} not supported; choose one of {', '.join(WR_TYPES)}")

    def expert_types(self, layer: int | None, role: str) -> tuple[str, str]:
        """(WQ, sidecar) types asked for a routed-expert tensor of `role` in `layer`: the mix's entry for that
        layer and role, else its role-wide entry, else the preset's own (merged gate_up: gate's entry). A layer's
        entry without a sidecar type takes the role-wide entry's, else the preset's."""
        role = "gate" if role == "gate_up" else role
        hi = (self.down_hi if role == "down" else self.wr).upper()
        wq = self.wq.upper()
        if not self.mix:
            return wq, hi
        by_key = {e.key(): e for e in parse_mix(self.mix)}
        wide = by_key.get(role)
        own = by_key.get(f"{layer}.{role}") if layer is not None else None
        if wide is not None:
            wq, hi = wide.wq, wide.hi or hi
        if own is not None:
            wq, hi = own.wq, own.hi or hi
        return wq, hi

    @property
    def is_refine(self) -> bool:
        """Whether this preset uses the refine codec (refine.py) instead of a quantized residual or copy."""
        return self.down_mode == "refine"

    @property
    def codec(self) -> str | None:
        """The sidecar's codec name (rapidmoe.residual.codec), or None for the classic residual/copy sidecar."""
        return REFINE_CODEC if self.is_refine else None

    def tensor_types(self, names: set[str] | frozenset[str]) -> dict[str, str]:
        """Per-tensor types that override `other` in a file with these tensor names. The token embedding's
        override applies only where the file has its own output head: a tied embedding is also the output
        matmul, whose cost per token is the whole matrix, not one row."""
        out: dict[str, str] = {}
        if self.token_embd is not None and "output.weight" in names:
            out["token_embd.weight"] = self.token_embd.upper()
        if self.output is not None:
            out["output.weight" if "output.weight" in names else "token_embd.weight"] = self.output.upper()
        return out

    @property
    def other_mixture(self) -> int | None:
        """llama_ftype id when the non-expert tensors follow one of llama-quantize's mixtures, else None."""
        return OTHER_MIXTURES.get(self.other.upper())

    @property
    def down_hi(self) -> str:
        """Type of the sidecar's down tensor (the copy, or the residual; REFINE1 for the refine codec)."""
        return self.down_type if self.down_mode == "copy" else self.wr

    def bits(self, moe_layers: Iterable[int] | None = None, merged: Iterable[int] = ()) -> dict[str, float]:
        """Bits per routed-expert weight (gate, up and down of equal size): each part, the critical path, and the
        total stored. With a mix, averaged over `moe_layers` (default: the layers the mix names; none: one layer
        of role-wide entries), the `merged` layers' (one gate_up tensor) up in gate's types; without one the same
        in every layer. Requested types: a row size that needs llama-quantize's fallback is not counted here."""
        merged_set = set(merged)
        named = sorted({e.layer for e in parse_mix(self.mix) if e.layer is not None})
        layers: list[int | None] = [*(moe_layers if moe_layers is not None else named)] or [None]
        parts: dict[str, float] = dict.fromkeys(("wq", "wr_gate_up", "down_sidecar", "critical"), 0.0)
        for layer in layers:
            (gwq, gwr), (uwq, uwr), (dwq, dhi) = (
                self.expert_types(layer, "gate" if r == "up" and layer in merged_set else r) for r in MIX_ROLES)
            down_critical = _bits(dhi) if self.down_mode == "copy" else _bits(dwq) + _bits(dhi)
            parts["wq"] += (_bits(gwq) + _bits(uwq) + _bits(dwq)) / 3
            parts["wr_gate_up"] += (_bits(gwr) + _bits(uwr)) / 2
            parts["down_sidecar"] += _bits(dhi)
            parts["critical"] += (_bits(gwq) + _bits(gwr) + _bits(uwq) + _bits(uwr) + down_critical) / 3
        out = {k: v / len(layers) for k, v in parts.items()}
        out["sidecar"] = (2 * out["wr_gate_up"] + out["down_sidecar"]) / 3
        out["total_stored"] = out["wq"] + out["sidecar"]
        return {k: out[k] for k in ("wq", "wr_gate_up", "down_sidecar", "sidecar", "critical", "total_stored")}


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("paper", "IQ1_M", "Q2_K", "copy", "Q4_K",
           description="the paper's: IQ1_M + Q2_K residual for gate/up, Q4_K copy of down"),
    Preset("paper-residual", "IQ1_M", "Q2_K", "residual",
           description="IQ1_M + Q2_K residual for gate, up and down (smallest sidecar)"),
    Preset("iq2", "IQ2_XXS", "Q2_K", "copy", "Q4_K",
           description="IQ2_XXS + Q2_K residual, Q4_K down copy (better non-critical experts)"),
    Preset("cpu", "Q2_K", "Q2_K", "copy", "Q4_K", "Q4_K_M", token_embd="Q8_0",
           description="Q2_K + Q2_K residual, Q4_K down copy, other tensors as llama.cpp's Q4_K_M but the token "
                       "embedding in Q8_0 (free: one row read per token): K-quants are faster than IQ on CPUs"),
    Preset("cpu-fast", "Q2_K", "Q2_K", "copy", "Q4_K", "Q4_K_M", token_embd="Q8_0", output="Q4_K",
           # (the sidecar records the description; tests/fuzzing/regressions' byte offsets into a cpu-fast sidecar
           # assume its length: 120 characters)
           description="the cpu preset with the output head in Q4_K, which reads a third fewer bytes than Q6_K: faster "
                       "decode, some quality lost"),
    Preset("cpu-q8", "Q2_K", "Q2_K", "copy", "Q4_K", "Q8_0",
           description="the cpu preset with every non-expert matrix in Q8_0 (more accurate attention, more bytes)"),
    Preset("dense", "Q3_K", "Q4_K", "residual",
           description="Q3_K + Q4_K residual everywhere (highest quality, largest)"),
    Preset("refine", REFINE_WQ, REFINE_WR, "refine", other="Q4_K_M", token_embd="Q8_0", output="Q4_K",
           description="the refine codec: a stock-runnable Q3_K base fitted for one refinement bit per weight of "
                       "gate, up and down (4.44 bpw on the critical path); other tensors as cpu-fast"),
    Preset("refine-hq", REFINE_WQ, REFINE_WR, "refine", other="Q4_K_M", token_embd="Q8_0",
           description="the refine preset with llama.cpp Q4_K_M's Q6_K output head (as cpu against cpu-fast)"),
    Preset("refine-q8", REFINE_WQ, REFINE_WR, "refine",
           description="the refine preset with every non-expert matrix in Q8_0 (as cpu-q8)"),
)}


def _bits(name: str) -> float:
    """Bits per weight of a WQ, WR or down type (the refine codec's WR: one bit)."""
    return REFINE_BITS if name.upper() == REFINE_WR else bits_per_weight(name)


# `convert`'s preset when none is named: on a machine with a GPU the paper's (WQ small enough for the device), on
# one without the preset whose whole-model frontier lies below stock K-quants' at every r on both trained models,
# r = 1 with lower KL than stock Q4_K_M at 0.81-0.83x its bytes (bench/results/frontier-tiny-moe-a-refine-hq.md,
# frontier-tiny-moe-b-refine-hq.md); cpu-fast decodes faster but has 1.6-2.3x Q4_K_M's KL at r = 1 there
GPU_DEFAULT = "paper"
CPU_DEFAULT = "refine-hq"
# auto's CPU preset for a model the refine codec cannot take (merged gate_up experts, per-expert scales, rows that
# are not whole Q3_K super-blocks: resplit.convert.refine_obstacle): the residual preset with the same Q6_K head
CPU_FALLBACK = "cpu"


def default_preset(has_gpu: bool) -> str:
    """The preset `convert --preset auto` picks: GPU_DEFAULT where llama.cpp sees a GPU, else CPU_DEFAULT."""
    return GPU_DEFAULT if has_gpu else CPU_DEFAULT


def get_preset(name: str, **overrides: str | None) -> Preset:
    """A named preset, optionally with some of its types replaced (e.g. wq='IQ2_XS'). A new `other` is the type of
    every non-expert matrix: it replaces the preset's own token-embedding and output-head types too, unless those
    are given as well."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    base = PRESETS[name]
    fields: dict[str, str | None] = {k: v for k, v in overrides.items() if v is not None}
    if not fields:
        return base
    if "other" in fields:
        fields = {"token_embd": None, "output": None, **fields}
    return Preset(**{**base.__dict__, **fields, "name": f"{name}+custom"})
