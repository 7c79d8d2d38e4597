"""Structure-aware mutations of GGUF files: the header, KV types, lengths and values (hyperparameters, tokenizer
tables), the tensor table (names, dims, types, offsets, alignment), truncation and data bytes; for a residual
sidecar also its pairing metadata and its tensors' names, shapes and types against the base.

Every operator returns edits (gguf_layout.Edit) of the base file, named by the operator, so a mutant is
(base, edits) and reproduces from a few bytes of JSON. Which file a mutant is run against is the harness's.
"""
from __future__ import annotations

import random
import struct
from collections.abc import Callable
from dataclasses import dataclass

from .gguf_layout import ARRAY, KV, SCALARS, STRING, Edit, Layout, StrSpan, encode_kv, encode_string

U32 = [0, 1, 2, 3, 4, 7, 8, 9, 15, 16, 31, 32, 63, 64, 255, 256, 511, 512, 513, 4096, 32255, 32256, 32257, 65535,
       65536, 2**31 - 1, 2**31, 2**32 - 1]
U64 = [*U32, 2**32, 2**40, 2**48, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
FLOATS = [0.0, -0.0, 1.0, -1.0, 1e-30, 1e30, 3.4e38, -3.4e38, float("inf"), float("-inf"), float("nan")]
N_GGML_TYPES = 40  # ggml_type values of the pin are 0..39 (some retired: ggml rejects them)
SPECIAL_IDS = ("bos", "eos", "padding", "unknown", "eot", "eom", "sep", "mask", "fim_pre", "fim_suf", "fim_mid")
# hyperparameter keys llama.cpp reads for qwen3moe and friends that the base file may lack
EXTRA_KEYS = ("general.alignment", "{a}.expert_shared_count", "{a}.attention.sliding_window", "{a}.rope.scaling.type",
              "{a}.rope.scaling.factor", "{a}.leading_dense_block_count", "{a}.expert_group_count",
              "{a}.expert_weights_scale", "{a}.attention.q_lora_rank", "{a}.n_deepstack_layers",
              "{a}.rope.dimension_sections", "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.scores")


def _pack(vtype: int, value: float | int | bool) -> bytes:
    fmt = SCALARS[vtype][0]
    if fmt in ("<f", "<d"):
        return struct.pack(fmt, float(value))
    if fmt == "<?":
        return struct.pack("<B", int(value) & 0xFF)
    bits = SCALARS[vtype][1] * 8
    v = int(value) % (1 << bits)  # wrap into the type's range, two's complement for signed
    return v.to_bytes(SCALARS[vtype][1], "little")


def interesting(rng: random.Random, vtype: int, current: float | int | None = None) -> bytes:
    """A boundary value of a GGUF scalar type, or one near the current value."""
    if SCALARS[vtype][0] in ("<f", "<d"):
        return _pack(vtype, rng.choice(FLOATS))
    near = [] if current is None else [int(current) + d for d in (-1, 1)] + [int(current) * 2, int(current) // 2]
    return _pack(vtype, rng.choice(U64 + near + [-1, -2]))


def u32(v: int) -> bytes:
    return struct.pack("<I", v % 2**32)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v % 2**64)


def _put(off: int, b: bytes) -> Edit:
    return Edit(off, len(b), b)


def replace_string(s: StrSpan, new: bytes) -> Edit:
    return Edit(s.off, 8 + len(s.text), encode_string(new))


@dataclass(frozen=True)
class Ctx:
    """What an operator sees: the base's bytes and layout, and the random source."""

    rng: random.Random
    lay: Layout
    data: bytes

    def kv_where(self, pred: Callable[[KV], bool]) -> KV | None:
        cands = [kv for kv in self.lay.kvs if pred(kv)]
        return self.rng.choice(cands) if cands else None

    @property
    def arch(self) -> str:
        kv = self.lay.kv("general.architecture")
        if kv is None:
            return "llama"
        return self.data[kv.value_off + 8: kv.end].decode("utf-8", "replace")


Op = Callable[[Ctx], list[Edit]]


# ---- header -------------------------------------------------------------------------------------------------
def header(c: Ctx) -> list[Edit]:
    which = c.rng.randrange(4)
    if which == 0:
        return [_put(c.rng.randrange(4), bytes([c.rng.randrange(256)]))]  # the magic
    if which == 1:
        return [_put(4, u32(c.rng.choice([0, 1, 2, 4, 2**31, 2**32 - 1])))]
    off = c.lay.n_tensors_off if which == 2 else c.lay.n_kv_off
    cur = len(c.lay.tensors) if which == 2 else len(c.lay.kvs)
    return [_put(off, u64(c.rng.choice([cur - 1, cur + 1, 0, cur * 2, *U64])))]


# ---- KV pairs -----------------------------------------------------------------------------------------------
def kv_type(c: Ctx) -> list[Edit]:
    kv = c.rng.choice(c.lay.kvs)
    return [_put(kv.type_off, u32(c.rng.choice([*range(14), 2**31, 2**32 - 1])))]


def kv_strlen(c: Ctx) -> list[Edit]:
    kv = c.rng.choice(c.lay.kvs)
    s = kv.key
    if kv.vtype == STRING and c.rng.random() < 0.6:
        s = StrSpan(kv.value_off, c.data[kv.value_off + 8: kv.end])
    elif kv.items and c.rng.random() < 0.6:
        s = c.rng.choice(kv.items)
    n = len(s.text)
    return [_put(s.off, u64(c.rng.choice([n - 1, n + 1, 0, n + 8, *U64])))]


def kv_array_count(c: Ctx) -> list[Edit]:
    kv = c.kv_where(lambda kv: kv.vtype == ARRAY)
    if kv is None:
        return []
    return [_put(kv.count_off, u64(c.rng.choice([kv.count - 1, kv.count + 1, 0, 1, kv.count * 2, *U64])))]


def kv_array_subtype(c: Ctx) -> list[Edit]:
    kv = c.kv_where(lambda kv: kv.vtype == ARRAY)
    if kv is None:
        return []
    return [_put(kv.value_off, u32(c.rng.choice([*range(14), 100, 2**32 - 1])))]


def kv_scalar(c: Ctx) -> list[Edit]:
    """A hyperparameter or tokenizer id set to a boundary value (most llama.cpp asserts sit behind these)."""
    kv = c.kv_where(lambda kv: kv.vtype in SCALARS)
    if kv is None:
        return []
    (cur,) = struct.unpack_from(SCALARS[kv.vtype][0], c.data, kv.value_off)
    return [_put(kv.value_off, interesting(c.rng, kv.vtype, cur))]


def kv_array_item(c: Ctx) -> list[Edit]:
    """One element of a numeric array (token types, scores, rope sections) set to a boundary value."""
    kv = c.kv_where(lambda kv: kv.vtype == ARRAY and kv.sub_type in SCALARS and kv.count > 0)
    if kv is None:
        return []
    size = SCALARS[kv.sub_type][1]
    off = kv.items_off + size * c.rng.randrange(kv.count)
    return [_put(off, interesting(c.rng, kv.sub_type))]


def kv_key(c: Ctx) -> list[Edit]:
    kv = c.rng.choice(c.lay.kvs)
    other = c.rng.choice(c.lay.kvs).key.text
    flipped = bytearray(kv.key.text or b"k")
    flipped[c.rng.randrange(len(flipped))] ^= 1 << c.rng.randrange(8)
    new = c.rng.choice([other, bytes(flipped), b"", b"\xff\xfe", b"x" * 300, kv.key.text + b"\0"])
    return [replace_string(kv.key, new)]


def kv_drop(c: Ctx) -> list[Edit]:
    i = c.rng.randrange(len(c.lay.kvs))
    kv = c.lay.kvs[i]
    edits = [Edit(kv.key.off, kv.end - kv.key.off, b"")]
    if c.rng.random() < 0.8:  # a consistent file without that key
        edits.append(_put(c.lay.n_kv_off, u64(len(c.lay.kvs) - 1)))
    return edits


def kv_insert(c: Ctx) -> list[Edit]:
    """A KV the base lacks (alignment, optional hyperparameters) or a second copy of one it has."""
    if c.rng.random() < 0.3:
        kv = c.rng.choice(c.lay.kvs)
        raw = c.data[kv.key.off: kv.end]
    else:
        key = c.rng.choice(EXTRA_KEYS).format(a=c.arch).encode()
        vt = c.rng.choice([4, 4, 4, 5, 6, 10, STRING, ARRAY])
        if vt == STRING:
            value = encode_string(c.rng.choice([b"", b"yarn", b"\xff" * 3]))
        elif vt == ARRAY:
            n = c.rng.choice([0, 1, 3, 4, 100])
            value = u32(5) + u64(n) + b"".join(_pack(5, c.rng.choice([0, 1, 64, -1, 2**31 - 1])) for _ in range(n))
        else:
            value = interesting(c.rng, vt)
        raw = encode_kv(key, vt, value)
    at = c.rng.choice([c.lay.kvs[0].key.off, c.lay.kvs[-1].end])
    return [Edit(at, 0, raw), _put(c.lay.n_kv_off, u64(len(c.lay.kvs) + 1))]


# ---- tokenizer ----------------------------------------------------------------------------------------------
def _tokens(c: Ctx) -> KV | None:
    return c.lay.kv("tokenizer.ggml.tokens")


def tok_dup(c: Ctx) -> list[Edit]:
    """Two tokens made equal (llama.cpp's vocab loader asserts on it)."""
    kv = _tokens(c)
    if kv is None or len(kv.items) < 2:
        return []
    i, j = c.rng.sample(range(len(kv.items)), 2)
    return [replace_string(kv.items[j], kv.items[i].text)]


def tok_edit(c: Ctx) -> list[Edit]:
    kv = _tokens(c) if c.rng.random() < 0.7 else c.lay.kv("tokenizer.ggml.merges")
    if kv is None or not kv.items:
        return []
    j = c.rng.randrange(len(kv.items))
    junk = bytes(c.rng.randrange(256) for _ in range(c.rng.randrange(1, 12)))
    new = c.rng.choice([b"", b"\xff\xfe", b"a" * 5000, junk, b"a b c", b" ", b"abc", b"\0", kv.items[j].text * 2])
    return [replace_string(kv.items[j], new)]


def tok_nul(c: Ctx) -> list[Edit]:
    """NUL bytes in token strings. llama.cpp reads a token up to its first NUL (gguf_get_arr_str's C string), so
    another token's text followed by NULs is that token twice (its vocab loader asserts), a token cut at a NUL
    inside is a shorter one, and a token that starts with one is empty: named `[EMPTY_<id>]`, two of them are fine,
    one beside a token spelled that way is a duplicate again."""
    kv = _tokens(c)
    if kv is None or len(kv.items) < 2:
        return []
    i, j = c.rng.sample(range(len(kv.items)), 2)
    a, b = kv.items[i].text, kv.items[j].text
    which = c.rng.randrange(4)
    if which == 0:  # token j read as token i (`Ġso\0\0e` as `Ġso`): as long as j's text where it was longer
        return [replace_string(kv.items[j], a + b"\0" * max(1, len(b) - len(a)))]
    if which == 1:  # a NUL inserted between two characters (UTF-8 stays valid)
        s = b.decode("utf-8", "surrogateescape")
        k = c.rng.randrange(len(s) + 1)
        new = s[:k].encode("utf-8", "surrogateescape") + b"\0" + s[k:].encode("utf-8", "surrogateescape")
        return [replace_string(kv.items[j], new)]
    if which == 2:  # two tokens empty as read: one all NULs, one of no bytes
        return [replace_string(kv.items[j], b"\0" * len(b)), replace_string(kv.items[i], b"")]
    return [replace_string(kv.items[i], b"\0"), replace_string(kv.items[j], f"[EMPTY_{i}]".encode())]


def tok_special(c: Ctx) -> list[Edit]:
    """A special-token id out of the vocabulary (set, or added where the file lacks it)."""
    tokens = _tokens(c)
    n = len(tokens.items) if tokens is not None else 32000
    value = u32(c.rng.choice([n - 1, n, n + 1, 2**31, 2**32 - 1, 0]))
    name = c.rng.choice(SPECIAL_IDS)
    kv = c.lay.kv(f"tokenizer.ggml.{name}_token_id")
    if kv is not None and kv.vtype == 4:
        return [_put(kv.value_off, value)]
    raw = encode_kv(f"tokenizer.ggml.{name}_token_id".encode(), 4, value)
    return [Edit(c.lay.kvs[-1].end, 0, raw), _put(c.lay.n_kv_off, u64(len(c.lay.kvs) + 1))]


# ---- tensor table -------------------------------------------------------------------------------------------
def tensor_name(c: Ctx) -> list[Edit]:
    t = c.rng.choice(c.lay.tensors)
    other = c.rng.choice(c.lay.tensors).name.text
    flipped = bytearray(t.name.text)
    flipped[c.rng.randrange(len(flipped))] ^= 1 << c.rng.randrange(8)
    new = c.rng.choice([other, bytes(flipped), b"", b"n" * 64, b"n" * 65, b"blk.99.ffn_up_exps.weight",
                        t.name.text.replace(b"blk.0.", b"blk.7."), t.name.text + b"\xff"])
    return [replace_string(t.name, new)]


def tensor_ndims(c: Ctx) -> list[Edit]:
    t = c.rng.choice(c.lay.tensors)
    nd = len(t.dims)
    if c.rng.random() < 0.5:  # consistent: drop or add a trailing dim (1 or something else)
        if nd > 1 and c.rng.random() < 0.5:
            return [_put(t.ndims_off, u32(nd - 1)), Edit(t.dim_offs[-1], 8, b"")]
        extra = c.rng.choice([1, 1, 2, 0])
        return [_put(t.ndims_off, u32(nd + 1)), Edit(t.dim_offs[-1] + 8, 0, u64(extra))]
    return [_put(t.ndims_off, u32(c.rng.choice([0, 1, 2, 3, 4, 5, 8, 2**31, 2**32 - 1])))]


def tensor_dim(c: Ctx) -> list[Edit]:
    t = c.rng.choice(c.lay.tensors)
    i = c.rng.randrange(len(t.dims))
    d = t.dims[i]
    return [_put(t.dim_offs[i], u64(c.rng.choice([0, 1, d - 1, d + 1, d * 2, d // 2, d + 32, d + 256, *U64])))]


def tensor_dims_swap(c: Ctx) -> list[Edit]:
    """Same element count, another shape (llama.cpp's shape check), or one tensor given another's shape."""
    t = c.rng.choice([t for t in c.lay.tensors if len(t.dims) > 1] or c.lay.tensors)
    if len(t.dims) > 1 and c.rng.random() < 0.6:
        i, j = c.rng.sample(range(len(t.dims)), 2)
        return [_put(t.dim_offs[i], u64(t.dims[j])), _put(t.dim_offs[j], u64(t.dims[i]))]
    o = c.rng.choice(c.lay.tensors)
    return [Edit(t.ndims_off, 4 + 8 * len(t.dims), u32(len(o.dims)) + b"".join(u64(d) for d in o.dims))]


def tensor_type(c: Ctx) -> list[Edit]:
    t = c.rng.choice(c.lay.tensors)
    return [_put(t.type_off, u32(c.rng.choice([*range(N_GGML_TYPES), 40, 41, 100, 2**31, 2**32 - 1])))]


def tensor_offset(c: Ctx) -> list[Edit]:
    t = c.rng.choice(c.lay.tensors)
    o = c.rng.choice(c.lay.tensors).offset
    a = c.lay.alignment
    size = c.lay.size - c.lay.data_start
    new = c.rng.choice([t.offset + 1, t.offset - 1, t.offset + a, t.offset - a, o, 0, size, size - a, size + a,
                        2**62, 2**63, 2**64 - 1, 2**64 - a])
    return [_put(t.offset_off, u64(new))]


def alignment(c: Ctx) -> list[Edit]:
    v = c.rng.choice([0, 1, 2, 3, 8, 16, 31, 48, 64, 4096, 2**31, 2**32 - 1])
    vt = c.rng.choice([4, 4, 4, 10, 5, 6, STRING])
    value = encode_string(b"32") if vt == STRING else _pack(vt, v)
    kv = c.lay.kv("general.alignment")
    if kv is not None:
        return [Edit(kv.key.off, kv.end - kv.key.off, encode_kv(b"general.alignment", vt, value))]
    return [Edit(c.lay.kvs[-1].end, 0, encode_kv(b"general.alignment", vt, value)),
            _put(c.lay.n_kv_off, u64(len(c.lay.kvs) + 1))]


# ---- bytes --------------------------------------------------------------------------------------------------
def truncate(c: Ctx) -> list[Edit]:
    r = c.rng.random()
    if r < 0.35:
        at = c.rng.randrange(c.lay.header_end)
    elif r < 0.5:
        t = c.rng.choice(c.lay.tensors)
        at = c.rng.randrange(t.name.off, t.end + 1)
    else:
        at = c.rng.randrange(c.lay.header_end, c.lay.size)
    return [Edit(at, c.lay.size - at, b"")]


def zero_span(c: Ctx) -> list[Edit]:
    """A zeroed 4 KiB page (a bad sector, an interrupted copy): in the header half the time."""
    end = c.lay.header_end if c.rng.random() < 0.5 else c.lay.size
    at = c.rng.randrange(max(1, end - 4096))
    n = min(4096, c.lay.size - at)
    return [_put(at, bytes(n))]


def data_bytes(c: Ctx) -> list[Edit]:
    """Flipped bits, or NaN/Inf/huge halves and floats, in a tensor's data."""
    t = c.rng.choice(c.lay.tensors)
    start = c.lay.data_start + t.offset
    if start >= c.lay.size:
        return []
    at = c.rng.randrange(start, min(c.lay.size, start + (1 << 20)))
    if c.rng.random() < 0.5:
        return [_put(at, bytes([c.data[at] ^ (1 << c.rng.randrange(8))]))]
    pat = c.rng.choice([b"\x00\x7c", b"\x00\xfe", b"\xff\x7b", b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\xff" * 4])
    n = c.rng.choice([1, 16, 256, 4096])
    blob = (pat * n)[: max(0, min(len(pat) * n, c.lay.size - at))]
    return [_put(at, blob)]


def append(c: Ctx) -> list[Edit]:
    return [Edit(c.lay.size, 0, bytes(c.rng.randrange(256) for _ in range(c.rng.choice([1, 31, 4096]))))]


def havoc(c: Ctx) -> list[Edit]:
    """A few random bytes of the header (outside the long tokenizer strings as often as inside)."""
    out = []
    for _ in range(c.rng.randrange(1, 5)):
        at = c.rng.randrange(c.lay.header_end)
        out.append(_put(at, bytes([c.rng.randrange(256)])))
    return out


# ---- sidecar ------------------------------------------------------------------------------------------------
def side_rename(c: Ctx) -> list[Edit]:
    """A sidecar tensor named for another layer, role or form (.wr/.hi/.rf), or for no expert tensor at all."""
    t = c.rng.choice(c.lay.tensors)
    name = t.name.text.decode()
    layer, _, rest = name.removeprefix("blk.").partition(".")
    role, _, form = rest.removeprefix("ffn_").partition("_exps.")
    choice = c.rng.randrange(4)
    if choice == 0:
        layer = c.rng.choice(["0", "1", "2", "99", "-1", "2147483648", "x", ""])
    elif choice == 1:
        role = c.rng.choice(["gate", "up", "down", "gate_up", "norm", ""])
    elif choice == 2:
        form = c.rng.choice(["wr", "hi", "rf", "weight", "", "wr.wr"])
    else:
        return [replace_string(t.name, c.rng.choice([b"output.weight", b"token_embd.weight", b"blk.0.attn_q.weight",
                                                      b"blk.0.ffn_up_exps", b"blk..ffn__exps."]))]
    return [replace_string(t.name, f"blk.{layer}.ffn_{role}_exps.{form}".encode())]


# types a sidecar tensor may plausibly hold, and some it may not (I8, I32, the retired ids)
SIDE_TYPES = [0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 24, 26, 30, 4, 5, 31]


def side_type(c: Ctx) -> list[Edit]:
    t = c.rng.choice(c.lay.tensors)
    return [_put(t.type_off, u32(c.rng.choice(SIDE_TYPES)))]


def side_shape(c: Ctx) -> list[Edit]:
    """Shapes that disagree with the base's expert tensors: experts +-1, rows or columns changed, a 4th dim."""
    t = c.rng.choice(c.lay.tensors)
    dims = list(t.dims)
    i = c.rng.randrange(len(dims))
    dims[i] = c.rng.choice([dims[i] + 1, dims[i] - 1, dims[i] * 2, dims[i] // 2, dims[i] // 8, 1, 0])
    if c.rng.random() < 0.2:
        dims.append(c.rng.choice([1, 2]))
    return [Edit(t.ndims_off, 4 + 8 * len(t.dims), u32(len(dims)) + b"".join(u64(d) for d in dims))]


def side_meta(c: Ctx) -> list[Edit]:
    """The pairing metadata: pair id, format version, codec, the base's recorded shape."""
    key = c.rng.choice(["pair_id", "format_version", "codec", "base_block_count", "base_expert_count",
                        "preset.down_mode", "samples.window", "samples.budget", "samples.min_windows"])
    kv = c.lay.kv(f"rapidmoe.residual.{key}")
    if key == "codec":
        raw = encode_kv(b"rapidmoe.residual.codec", STRING,
                        encode_string(c.rng.choice([b"q3k-refine1", b"", b"other"])))
        if kv is not None:
            return [Edit(kv.key.off, kv.end - kv.key.off, raw)]
        return [Edit(c.lay.kvs[-1].end, 0, raw), _put(c.lay.n_kv_off, u64(len(c.lay.kvs) + 1))]
    if kv is None:
        return []
    if kv.vtype == STRING:
        cur = c.data[kv.value_off + 8: kv.end]
        new = c.rng.choice([b"", cur[:-1], cur + b"0", bytes(len(cur)), b"residual", b"q"])
        return [Edit(kv.value_off, kv.end - kv.value_off, encode_string(new))]
    if kv.vtype in SCALARS:
        (cur_v,) = struct.unpack_from(SCALARS[kv.vtype][0], c.data, kv.value_off)
        return [_put(kv.value_off, interesting(c.rng, kv.vtype, cur_v))]
    return []


MODEL_OPS: dict[str, tuple[Op, float]] = {
    "header": (header, 1), "kv_type": (kv_type, 2), "kv_strlen": (kv_strlen, 2), "kv_array_count": (kv_array_count, 2),
    "kv_array_subtype": (kv_array_subtype, 1), "kv_scalar": (kv_scalar, 6), "kv_array_item": (kv_array_item, 2),
    "kv_key": (kv_key, 2), "kv_drop": (kv_drop, 3), "kv_insert": (kv_insert, 3), "tok_dup": (tok_dup, 1),
    "tok_edit": (tok_edit, 2), "tok_nul": (tok_nul, 2), "tok_special": (tok_special, 2),
    "tensor_name": (tensor_name, 3), "tensor_ndims": (tensor_ndims, 2), "tensor_dim": (tensor_dim, 3),
    "tensor_dims_swap": (tensor_dims_swap, 3), "tensor_type": (tensor_type, 3), "tensor_offset": (tensor_offset, 3),
    "alignment": (alignment, 1), "truncate": (truncate, 2), "zero_span": (zero_span, 2), "data_bytes": (data_bytes, 2),
    "append": (append, 1), "havoc": (havoc, 1),
}
SIDECAR_OPS: dict[str, tuple[Op, float]] = {
    **{k: v for k, v in MODEL_OPS.items() if not k.startswith("tok_")},
    # the sidecar's own operators weigh most: their mutants reach the C++ attach (rapidmoe-residual.cpp)
    "side_rename": (side_rename, 12), "side_type": (side_type, 12), "side_shape": (side_shape, 12),
    "side_meta": (side_meta, 4),
}


def keep_data_aligned(lay: Layout, edits: list[Edit]) -> list[Edit]:
    """Edits of the header only that change its length, completed by new padding so that the tensor data stays
    aligned (moved as a whole by a multiple of the alignment): the file stays well-formed, and what the loader sees
    is the edited field itself, not a shifted data section. Other edits are returned as they are."""
    if not edits or any(e.offset + e.remove > lay.header_end for e in edits):
        return edits
    delta = sum(len(e.insert) - e.remove for e in edits)
    if delta == 0:
        return edits
    pad = -(lay.header_end + delta) % lay.alignment
    return [*edits, Edit(lay.header_end, lay.data_start - lay.header_end, bytes(pad))]


def mutate(rng: random.Random, lay: Layout, data: bytes, ops: dict[str, tuple[Op, float]],
           n_ops: int | None = None) -> tuple[list[str], list[Edit]]:
    """1-3 operators (weighted) applied to the base; their names and edits. Operators that found nothing to edit
    (e.g. no array) are retried with another."""
    names = list(ops)
    weights = [ops[n][1] for n in names]
    want = n_ops if n_ops is not None else rng.choice([1, 1, 1, 2, 2, 3])
    c = Ctx(rng, lay, data)
    done: list[str] = []
    edits: list[Edit] = []
    for _ in range(want * 4):
        if len(done) == want:
            break
        name = rng.choices(names, weights)[0]
        e = ops[name][0](c)
        if e:
            done.append(name)
            edits.extend(e)
    if rng.random() < 0.8:
        edits = keep_data_aligned(lay, edits)
    return done, edits
