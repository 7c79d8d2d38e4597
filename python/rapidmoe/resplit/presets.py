"""RESplit presets: which ggml types hold WQ (low-bit, GPU-resident), WR (residual, CPU) and the critical down path,
and which codec (codecs/) writes the sidecar.

Pure data and arithmetic (no extension import): bits per weight come from ggml_types (gguf-py's block sizes).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from ..ggml_types import bits_per_weight
from ..moe_tensors import GATE, GATE_UP
from .codecs import codec_of, down_modes, named_by, wq_types
from .codecs.refine import BASE as REFINE_WQ
from .codecs.refine import BITS as REFINE_WR
from .codecs.refine import RefineCodec

# the residual codec's types, named here too (convert's flags, calibration/mix.py)
from .codecs.residual import DOWN_COPY_TYPES as DOWN_COPY_TYPES
from .codecs.residual import MIX_WQ_TYPES as MIX_WQ_TYPES
from .codecs.residual import WQ_TYPES as WQ_TYPES
from .codecs.residual import WR_TYPES as WR_TYPES

OTHER_TYPES = ("Q8_0", "F16", "F32")
TENSOR_OVERRIDE_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "F16")
# llama-quantize's per-tensor mixtures (llama_ftype ids) for the non-expert tensors: each gets exactly the type a
# stock quantization of the same file to that mixture gives it (llama.cpp decides, through patch 0003), so the
# WQ file differs from a stock Q4_K_M (say) only in its routed experts
OTHER_MIXTURES = {"Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17}
# llama-quantize refuses these without an importance matrix (ggml asserts on the first three)
NEEDS_IMATRIX = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS")
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
    """One RESplit configuration. The residual codec (codecs/residual.py): down_mode 'copy': critical experts use a
    `down_type` copy of down (the paper's choice); 'residual': down gets a WR residual like gate and up. The refine
    codec (codecs/refine.py; wr REFINE1, down_mode 'refine' and wq Q3_K only): one refinement bit per weight of gate,
    up and down."""

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
    # the sidecar's codec by its registry name (codecs/); None: the one the WR type and down mode name (the refine
    # codec's REFINE1 or 'refine', else the residual codec). Set to its codec's name once made
    codec: str | None = None

    def __post_init__(self) -> None:
        if self.wq.upper() not in wq_types():
            raise ValueError(f"WQ type {self.wq} not supported; choose one of {', '.join(wq_types())}")
        codec = codec_of(self)
        codec.check_preset(self)
        if self.down_mode not in codec.down_modes:
            if self.down_mode in down_modes():
                raise ValueError(f"{codec.title} takes down_mode {', '.join(map(repr, codec.down_modes))}, not "
                                 f"{self.down_mode!r}")
            raise ValueError(f"down_mode must be one of {', '.join(map(repr, down_modes()))}, not {self.down_mode!r}")
        if self.other.upper() not in OTHER_TYPES and self.other.upper() not in OTHER_MIXTURES:
            raise ValueError(f"type for other tensors {self.other} not supported; choose one of "
                             f"{', '.join(OTHER_TYPES + tuple(OTHER_MIXTURES))}")
        for role, ty in (("token_embd", self.token_embd), ("output", self.output)):
            if ty is not None and ty.upper() not in TENSOR_OVERRIDE_TYPES:
                raise ValueError(f"{role} type {ty} not supported; choose one of {', '.join(TENSOR_OVERRIDE_TYPES)}")
        if self.mix:
            if codec.no_mix is not None:
                raise ValueError(f"{codec.title} {codec.no_mix}: it takes no mix")
            codec.check_mix(self, parse_mix(self.mix))
        object.__setattr__(self, "codec", codec.name)  # (a frozen dataclass) the same preset, however it was named

    def expert_types(self, layer: int | None, role: str) -> tuple[str, str]:
        """(WQ, sidecar) types asked for a routed-expert tensor of `role` in `layer`: the mix's entry for that
        layer and role, else its role-wide entry, else the preset's own (merged gate_up: gate's entry). A layer's
        entry without a sidecar type takes the role-wide entry's, else the preset's."""
        role = GATE if role == GATE_UP else role
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

    def record(self) -> dict[str, object]:
        """The preset's fields as the sidecar, the report and the pair id record them: `codec` only where it names
        another codec than the WR type and down mode do (so a preset of today's codecs records what it recorded
        before presets named their codec, and converts to the same bytes)."""
        out = asdict(self)
        if self.codec is None or self.codec == named_by(self.wr, self.down_mode).name:
            del out["codec"]
        return out

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
        side_bits = codec_of(self).sidecar_bits
        merged_set = set(merged)
        named = sorted({e.layer for e in parse_mix(self.mix) if e.layer is not None})
        layers: list[int | None] = [*(moe_layers if moe_layers is not None else named)] or [None]
        parts: dict[str, float] = dict.fromkeys(("wq", "wr_gate_up", "down_sidecar", "critical"), 0.0)
        for layer in layers:
            (gwq, gwr), (uwq, uwr), (dwq, dhi) = (
                self.expert_types(layer, "gate" if r == "up" and layer in merged_set else r) for r in MIX_ROLES)
            down_critical = side_bits(dhi) if self.down_mode == "copy" else bits_per_weight(dwq) + side_bits(dhi)
            parts["wq"] += (bits_per_weight(gwq) + bits_per_weight(uwq) + bits_per_weight(dwq)) / 3
            parts["wr_gate_up"] += (side_bits(gwr) + side_bits(uwr)) / 2
            parts["down_sidecar"] += side_bits(dhi)
            parts["critical"] += (bits_per_weight(gwq) + side_bits(gwr) + bits_per_weight(uwq) + side_bits(uwr)
                                  + down_critical) / 3
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
                       "gate, up and down (4.44 bpw on the critical path); other tensors as cpu-fast",
           codec=RefineCodec.name),
    Preset("refine-hq", REFINE_WQ, REFINE_WR, "refine", other="Q4_K_M", token_embd="Q8_0",
           description="the refine preset with llama.cpp Q4_K_M's Q6_K output head (as cpu against cpu-fast)",
           codec=RefineCodec.name),
    Preset("refine-q8", REFINE_WQ, REFINE_WR, "refine",
           description="the refine preset with every non-expert matrix in Q8_0 (as cpu-q8)", codec=RefineCodec.name),
)}


# `convert`'s preset when none is named: on a machine with a GPU the paper's (WQ small enough for the device), on
# one without the preset whose whole-model frontier lies below stock K-quants' at every r on both trained models,
# r = 1 with lower KL than stock Q4_K_M at 0.81-0.83x its bytes (bench/results/frontier-tiny-moe-a-refine-hq.md,
# frontier-tiny-moe-b-refine-hq.md); cpu-fast decodes faster but has 1.6-2.3x Q4_K_M's KL at r = 1 there
GPU_DEFAULT = "paper"
CPU_DEFAULT = "refine-hq"
# auto's CPU preset for a model the refine codec cannot take (merged gate_up experts, per-expert scales, rows that
# are not whole Q3_K super-blocks: resplit.convert.codec_obstacle): the residual preset with the same Q6_K head
CPU_FALLBACK = "cpu"


def default_preset(has_gpu: bool) -> str:
    """The preset `convert --preset auto` picks: GPU_DEFAULT where llama.cpp sees a GPU, else CPU_DEFAULT."""
    return GPU_DEFAULT if has_gpu else CPU_DEFAULT


def get_preset(name: str, **overrides: str | None) -> Preset:
    """A named preset, optionally with some of its types replaced (e.g. wq='IQ2_XS'). A new `other` is the type of
    every non-expert matrix: it replaces the preset's own token-embedding and output-head types too, unless those
    are given as well. A new WR type or down mode names the codec again (codecs.named_by), unless one is given."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    base = PRESETS[name]
    fields: dict[str, str | None] = {k: v for k, v in overrides.items() if v is not None}
    if not fields:
        return base
    if "other" in fields:
        fields = {"token_embd": None, "output": None, **fields}
    if "wr" in fields or "down_mode" in fields:
        fields = {"codec": None, **fields}
    return Preset(**{**base.__dict__, **fields, "name": f"{name}+custom"})
