"""The residual sidecar's format: tensor names, metadata keys, and the check that pairs it with its base.

Version 1. Its tensors are its codec's (codecs/; `codec` names it, absent: the residual codec's classic sidecar):
`blk.N.ffn_{gate,up}_exps.wr` (residuals, and `ffn_down_exps.wr` in residual mode) or `blk.N.ffn_down_exps.hi` (the
high-precision copy of down used by critical experts), each with the base tensor's shape [n_in, n_out, n_expert];
the refine codec's (`codec` = "q3k-refine1") `blk.N.ffn_{gate,up,down}_exps.rf`, I8 with ne = [n_in/8, n_out,
n_expert]: one refinement bit per weight of the Q3_K base. `type_fallbacks` (when present) lists the parts whose row
size made them take llama-quantize's fallback type instead of the preset's. A sidecar belongs to exactly one
`.wq.gguf`, and the conversion records what every load checks (docs/resplit.md, Pairing): the pair id (the source's
tensor table and sampled data, the preset, the imatrix); the base's size and tensor table (`base_layout_sha256`) and
a sampled fingerprint of its tensor data (`base_samples`, fingerprint.py); the sidecar's own size and header
(`header_sha256`) and sampled data (`data_samples`). `rapidmoe-cli inspect --verify` adds the full hashes of the
base (`base_sha256`) and of the sidecar's data (`data_sha256`). Sidecars written before these existed load with a
warning, checked as their version was.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from gguf import GGUFWriter

from ..errors import ModelFileError
from ..ggufio import GGUFFile, GGUFFormatError
from .codecs import by_sidecar_id, codec_of, sidecar_ids
from .fingerprint import DEFAULT_SCHEME, DIGEST_CHARS, SampleScheme, sample_digests
from .presets import Preset

FORMAT_VERSION = 1
SIDECAR_ARCH = "rapidmoe-residual"
KEY = "rapidmoe.residual."
# the fingerprint keys (all or none: a sidecar with some of them is damaged); values written as placeholders of
# their final length first and replaced in place once both files are complete, header_sha256 last
FINGERPRINT_KEYS = ("samples.window", "samples.budget", "samples.min_windows", "base_samples", "data_samples",
                    "data_sha256", "header_sha256")
_SHA_LEN = 64

log = logging.getLogger(__name__)


def _placeholder(n: int) -> str:
    return "0" * n


def add_metadata(w: GGUFWriter, *, preset: Preset, pair_id: str, base_arch: str, n_layer: int, n_expert: int,
                 n_base_tensors: int, n_sidecar_tensors: int, type_fallbacks: list[str] | None = None,
                 scheme: SampleScheme | None = None) -> None:
    """The sidecar's metadata, with placeholders for what `stamp` records. scheme: how tensor data are sampled
    (default DEFAULT_SCHEME)."""
    scheme = scheme or DEFAULT_SCHEME
    w.add_string("general.type", "rapidmoe.residual")
    w.add_uint32(KEY + "format_version", FORMAT_VERSION)
    w.add_string(KEY + "pair_id", pair_id)
    w.add_string(KEY + "base_sha256", _placeholder(_SHA_LEN))
    w.add_string(KEY + "base_layout_sha256", _placeholder(_SHA_LEN))
    w.add_uint32(KEY + "samples.window", scheme.window)
    w.add_uint64(KEY + "samples.budget", scheme.budget)
    w.add_uint32(KEY + "samples.min_windows", scheme.min_windows)
    w.add_string(KEY + "base_samples", _placeholder(DIGEST_CHARS * n_base_tensors))
    w.add_string(KEY + "data_samples", _placeholder(DIGEST_CHARS * n_sidecar_tensors))
    w.add_string(KEY + "data_sha256", _placeholder(_SHA_LEN))
    w.add_string(KEY + "header_sha256", _placeholder(_SHA_LEN))
    w.add_string(KEY + "base_architecture", base_arch)
    w.add_uint32(KEY + "base_block_count", n_layer)
    w.add_uint32(KEY + "base_expert_count", n_expert)
    sidecar_id = codec_of(preset).sidecar_id
    if sidecar_id is not None:  # absent: the classic residual sidecar (the C++ loader's residual codec)
        w.add_string(KEY + "codec", sidecar_id)
    for k, v in preset.record().items():
        w.add_string(KEY + f"preset.{k}", str(v))
    if type_fallbacks:  # "<tensor> <wq|sidecar> <asked>-><used>": rows the preset's type could not take
        w.add_array(KEY + "type_fallbacks", type_fallbacks)


# -- hashes -----------------------------------------------------------------------------------------------------
# A split file (llama.cpp's gguf-split parts, ggufio.GGUFFile.shards) is hashed as its parts one after another; for
# one file every hash is what it was before splits existed.
def file_sha256(path: str | os.PathLike[str] | GGUFFile, start: int = 0) -> str:
    """sha256 of the file's bytes from `start` to its end; of a GGUFFile, of each part's bytes from its data start
    (start > 0) or whole (start = 0), the parts in order."""
    h = hashlib.sha256()
    parts = [(s.path, s.data_start if start else 0) for s in path.shards] if isinstance(path, GGUFFile) else \
        [(Path(path), start)]
    for p, at in parts:
        with p.open("rb") as f:
            f.seek(at)
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def layout_sha256(base: str | os.PathLike[str] | GGUFFile) -> str:
    """sha256 of what a load relies on that the header alone gives: the file's size and every tensor's name, type,
    shape and absolute data offset, in file order (a split file: every part's size, and each tensor's part). Cheap
    (no tensor data is read); any rewrite of the file that moves, retypes, reshapes, adds or drops a tensor, or
    changes its length, changes it."""
    r = base if isinstance(base, GGUFFile) else GGUFFile(base)
    h = hashlib.sha256(f"size {r.path.stat().st_size}\n".encode())
    split = len(r.shards) > 1
    if split:
        h.update(("parts " + " ".join(str(p.stat().st_size) for p in r.paths) + "\n").encode())
    part = {id(s): i for i, s in enumerate(r.shards)}
    for t in r.tensors:
        shape = ",".join(str(int(x)) for x in t.shape)
        where = f"\t{part[id(t._file)]}" if split else ""
        h.update(f"{t.name}\t{int(t.tensor_type)}\t{shape}\t{t.data_offset}{where}\n".encode())
    return h.hexdigest()


def header_sha256(side: GGUFFile) -> str:
    """sha256 of the sidecar's size and every header byte (metadata, tensor table, padding up to the data), its
    own value counted as the placeholder (a split sidecar: its total size and every part's header)."""
    at = side.value_offsets[KEY + "header_sha256"]
    with side.path.open("rb") as f:
        head = bytearray(f.read(side.data_start))
    head[at: at + _SHA_LEN] = _placeholder(_SHA_LEN).encode()
    h = hashlib.sha256(f"size {side.size}\n".encode())
    h.update(head)
    for part in side.shards[1:]:
        with part.path.open("rb") as f:
            h.update(f.read(part.data_start))
    return h.hexdigest()


def scheme_of(meta: dict[str, Any]) -> SampleScheme:
    return SampleScheme(int(meta["samples.window"]), int(meta["samples.budget"]), int(meta["samples.min_windows"]))


# -- conversion: record -----------------------------------------------------------------------------------------
def _stamp(side: GGUFFile, key: str, value: str) -> None:
    """Replace a placeholder in the sidecar's header with its value (same length, so nothing moves and `side`'s
    offsets stay right)."""
    at = side.value_offsets.get(KEY + key)
    if at is None or side.get(KEY + key) != _placeholder(len(value)):
        raise RuntimeError(f"sidecar header has no {len(value)}-character placeholder for {key}")
    with side.path.open("r+b") as f:
        f.seek(at)
        f.write(value.encode())


def stamp(sidecar_path: Path | GGUFFile, base_path: Path | GGUFFile) -> None:
    """Record, once both files are complete, the base's hashes and samples, then the sidecar's own (either may be a
    GGUFFile: the parts of a split file being written)."""
    base = base_path if isinstance(base_path, GGUFFile) else GGUFFile(base_path)
    side = sidecar_path if isinstance(sidecar_path, GGUFFile) else GGUFFile(sidecar_path)
    scheme = scheme_of(read_sidecar_meta(side))
    _stamp(side, "base_sha256", file_sha256(base))
    _stamp(side, "base_layout_sha256", layout_sha256(base))
    _stamp(side, "base_samples", "".join(sample_digests(base, scheme)))
    _stamp(side, "data_samples", "".join(sample_digests(side, scheme)))
    _stamp(side, "data_sha256", file_sha256(side, side.data_start))
    _stamp(side, "header_sha256", header_sha256(side))  # reads the header's bytes from the file as stamped


# -- load: check ------------------------------------------------------------------------------------------------
def read_sidecar_meta(path: str | os.PathLike[str] | GGUFFile) -> dict[str, Any]:
    r = path if isinstance(path, GGUFFile) else GGUFFile(path)
    arch = r.get("general.architecture")
    if arch != SIDECAR_ARCH:
        raise ModelFileError(f"{r.path} is not a RapidMoE residual sidecar (its general.architecture is "
                             f"{arch!r}, not {SIDECAR_ARCH!r}: another kind of GGUF, or a damaged sidecar)")
    meta = {k[len(KEY):]: f.value for k, f in r.fields.items() if k.startswith(KEY)}
    meta["tensors"] = {t.name: (t.tensor_type.name, [int(x) for x in t.shape]) for t in r.tensors}
    return meta


PathOrFile = str | os.PathLike[str] | GGUFFile


def _path(f: PathOrFile) -> Path:
    return f.path if isinstance(f, GGUFFile) else Path(f)


def open_gguf(path: PathOrFile, role: str, other: PathOrFile | None = None) -> GGUFFile:
    """Parse one file of a pair (role: "base" or "sidecar"; other: the pair's other file, for the message);
    ModelFileError naming it if it cannot be."""
    if isinstance(path, GGUFFile):
        return path
    with_other = "" if other is None else f"; not used with {_path(other)}"
    try:
        return GGUFFile(path)
    except FileNotFoundError:
        raise ModelFileError(f"{role} {path} not found{with_other}") from None
    except (GGUFFormatError, OSError) as e:
        raise ModelFileError(f"{role} {path} is not a readable GGUF ({e}): damaged or incomplete{with_other}") \
            from None


def _check_complete(f: GGUFFile, role: str, other: Path) -> None:
    """The file holds all of its tensors' data (their offsets and sizes come from the header)."""
    missing = f.missing_data()
    if missing is not None:
        t, size = missing
        raise ModelFileError(f"{role} {f.path} is truncated: tensor {t.name} ends at byte "
                             f"{t.data_offset + t.n_bytes}, the file has {size} (an incomplete download or "
                             f"copy?); not used with {other}")


def _check_sidecar_header(side: GGUFFile, base_path: Path) -> bool:
    """The sidecar's header and size are as converted. False: a sidecar older than the fingerprints."""
    missing = [k for k in FINGERPRINT_KEYS if KEY + k not in side.fields]
    if len(missing) == len(FINGERPRINT_KEYS):
        return False
    if "header_sha256" not in missing and KEY + "header_sha256" not in side.value_offsets:  # not a string
        missing.append("header_sha256")
    if missing:
        raise ModelFileError(f"sidecar {side.path} is damaged: its header lacks {', '.join(missing)}; "
                             f"not used with {base_path}")
    if header_sha256(side) != side.get(KEY + "header_sha256"):
        raise ModelFileError(f"sidecar {side.path} is damaged: its size ({side.size} bytes) or its "
                             f"header (metadata, tensor table) differs from what its conversion recorded; not used "
                             f"with {base_path}: copy or download it again, or re-convert")
    return True


def _differing(f: GGUFFile, recorded: str, scheme: SampleScheme) -> list[str]:
    """Names of f's tensors whose sampled data differ from the recorded digests."""
    now = sample_digests(f, scheme)
    if len(recorded) != DIGEST_CHARS * len(now):
        return [f"(the tensor count: {len(recorded) // DIGEST_CHARS} recorded, {len(now)} now)"]
    return [t.name for i, (t, d) in enumerate(zip(f.tensors, now, strict=True))
            if recorded[DIGEST_CHARS * i: DIGEST_CHARS * (i + 1)] != d]


def _names(names: list[str], total: int) -> str:
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{', '.join(names[:3])}{more} ({len(names)} of {total} tensors)"


def _check_samples(base: GGUFFile, side: GGUFFile, meta: dict[str, Any]) -> None:
    scheme = scheme_of(meta)
    bad = _differing(side, meta["data_samples"], scheme)
    if bad:
        raise ModelFileError(f"sidecar {side.path} is damaged: the sampled data of {_names(bad, len(side.tensors))} "
                             f"differ from what its conversion recorded; not used with {base.path}: copy or "
                             "download it again, or re-convert")
    bad = _differing(base, meta["base_samples"], scheme)
    if bad:
        raise ModelFileError(f"sidecar {side.path} was not made from the data in {base.path}: the sampled data of "
                             f"{_names(bad, len(base.tensors))} differ from the base the sidecar recorded. Either the "
                             "sidecar comes from another model with the same layout (another seed or fine-tune): "
                             f"use the .wr.gguf converted together with {base.path.name}; or the base was changed "
                             "or damaged since: copy or download it again, or re-convert")


def _check_full(base: GGUFFile, side: GGUFFile, meta: dict[str, Any], fingerprinted: bool) -> None:
    if file_sha256(base) != meta["base_sha256"]:
        raise ModelFileError(f"{base.path} has changed since sidecar {side.path} was made (sha256 of the base "
                             "differs from the sidecar's record); re-convert the model")
    if fingerprinted and file_sha256(side, side.data_start) != meta["data_sha256"]:
        raise ModelFileError(f"sidecar {side.path} is damaged: the sha256 of its tensor data differs from what its "
                             f"conversion recorded; not used with {base.path}: copy or download it again, or "
                             "re-convert")


def check_pair(wq_path: PathOrFile, wr_path: PathOrFile, *, verify: bool = True,
               verify_data: bool = False) -> dict[str, Any]:
    """Refuse a sidecar that was not made from this base, or either file damaged; returns the sidecar's metadata,
    with "checked": what was compared.

    Always (headers only): both files hold all their tensors' data; the sidecar's size and header match its
    conversion's record; the pair id. verify: also the base's size and tensor table, and the sampled tensor data
    of both files (a few MB read; fingerprint.py). verify_data: also every byte (the base's full sha256 and the
    sidecar data's). A sidecar older than the fingerprints is checked as before, with a warning. Either argument
    may be an already parsed GGUFFile (its header is then not read again)."""
    base, side = open_gguf(wq_path, "base", wr_path), open_gguf(wr_path, "sidecar", wq_path)
    _check_complete(base, "base", side.path)
    _check_complete(side, "sidecar", base.path)
    fingerprinted = _check_sidecar_header(side, base.path)
    try:
        meta = read_sidecar_meta(side)
    except ModelFileError as e:
        raise ModelFileError(f"{e}; not used with {base.path}") from None
    checked = ["sizes", "pair id"] + (["sidecar header"] if fingerprinted else [])
    if int(meta.get("format_version", 0)) != FORMAT_VERSION:
        raise ModelFileError(f"{side.path} has sidecar format {meta.get('format_version')}, "
                             f"this RapidMoE reads {FORMAT_VERSION}")
    codec = by_sidecar_id(meta.get("codec"))
    if codec is None:
        raise ModelFileError(f"sidecar {side.path} holds codec {meta.get('codec')!r}, which this RapidMoE does not "
                             f"read (it reads {', '.join(sidecar_ids())} and the classic residual/copy sidecar); not "
                             f"used with {base.path}")
    lacking = [k for k in ("pair_id", "base_sha256") if k not in meta]  # written by every version
    if lacking:  # a KeyError before (fuzzing: sidecar seed 100 #162, a re-signed sidecar without its pair id)
        raise ModelFileError(f"sidecar {side.path} is damaged: its header lacks {', '.join(lacking)}; not used with "
                             f"{base.path}")
    base_id = base.get("rapidmoe.resplit.pair_id")
    if base_id != meta["pair_id"]:
        raise ModelFileError(f"sidecar {side.path} does not belong to {base.path}: pair id {meta['pair_id']} in the "
                             f"sidecar, {base_id or 'none (not a RESplit .wq.gguf)'} in the base (converted from "
                             "another model, or with another preset or importance matrix); use the .wr.gguf "
                             "converted together with this .wq.gguf")
    layout = meta.get("base_layout_sha256")
    if verify and layout is not None:
        if layout_sha256(base) != layout:
            raise ModelFileError(f"{base.path} has changed since sidecar {side.path} was made (its size or tensor "
                                 "table differs); re-convert the model")
        checked.append("base size and tensor table")
    if verify and fingerprinted:
        _check_samples(base, side, meta)
        checked.append("sampled tensor data of both")
    elif verify:
        log.warning("sidecar %s was made by an older RapidMoE that recorded no fingerprint of the tensor data: "
                    "a sidecar of another model with the same layout, or damaged data, is not seen at load; "
                    "re-convert%s", side.path,
                    "" if layout is not None else f" (checking the base by its full sha256: reads all of {base.path})")
    if verify_data or (verify and layout is None):
        _check_full(base, side, meta, fingerprinted)
        checked.append("sha256 of every byte of the base" + (" and of the sidecar's data" if fingerprinted else ""))
    problem = codec.validate({t.name: (t.tensor_type.name, [int(x) for x in t.shape]) for t in base.tensors},
                             meta["tensors"])
    if problem is not None:  # the loader checks the tensors against the loaded model again (its codec id)
        raise ModelFileError(f"sidecar {side.path} {problem}; not used with {base.path}")
    meta["checked"] = checked
    return meta
