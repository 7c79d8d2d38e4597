"""The residual sidecar's format: tensor names, metadata keys, and the check that pairs it with its base.

Version 1. Tensors: `blk.N.ffn_{gate,up}_exps.wr` (residuals, and `ffn_down_exps.wr` in residual mode) or
`blk.N.ffn_down_exps.hi` (the high-precision copy of down used by critical experts), each with the base
tensor's shape [n_in, n_out, n_expert]; `type_fallbacks` (when present) lists the parts whose row size made them
take llama-quantize's fallback type instead of the preset's. A sidecar belongs to exactly one `.wq.gguf`: same pair
id, and the base's recorded hashes: `base_layout_sha256` (file size and tensor table: names, types, shapes, offsets) is
checked at every load, reading the base's header only; `base_sha256` (every byte) on request
(`rapidmoe-cli inspect --verify`). Sidecars written before the layout hash existed are checked by the full hash.
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gguf import GGUFWriter

from ..errors import ModelFileError
from ..ggufio import GGUFFile
from .presets import Preset

FORMAT_VERSION = 1
SIDECAR_ARCH = "rapidmoe-residual"
KEY = "rapidmoe.residual."
_HASH_PLACEHOLDER = "0" * 64  # written first, replaced in place once the base file is complete

log = logging.getLogger(__name__)


def sidecar_name(base_name: str, role: str, down_mode: str) -> str:
    stem = base_name.removesuffix(".weight")
    return f"{stem}.hi" if role == "down" and down_mode == "copy" else f"{stem}.wr"


def add_metadata(w: GGUFWriter, *, preset: Preset, pair_id: str, base_arch: str, n_layer: int, n_expert: int,
                 type_fallbacks: list[str] | None = None) -> None:
    w.add_string("general.type", "rapidmoe.residual")
    w.add_uint32(KEY + "format_version", FORMAT_VERSION)
    w.add_string(KEY + "pair_id", pair_id)
    w.add_string(KEY + "base_sha256", _HASH_PLACEHOLDER)
    w.add_string(KEY + "base_layout_sha256", _HASH_PLACEHOLDER)
    w.add_string(KEY + "base_architecture", base_arch)
    w.add_uint32(KEY + "base_block_count", n_layer)
    w.add_uint32(KEY + "base_expert_count", n_expert)
    for k, v in asdict(preset).items():
        w.add_string(KEY + f"preset.{k}", str(v))
    if type_fallbacks:  # "<tensor> <wq|sidecar> <asked>-><used>": rows the preset's type could not take
        w.add_array(KEY + "type_fallbacks", type_fallbacks)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def layout_sha256(base: str | os.PathLike[str] | GGUFFile) -> str:
    """sha256 of what a load relies on that the header alone gives: the file's size and every tensor's name, type,
    shape and absolute data offset, in file order. Cheap (no tensor data is read); any rewrite of the file that
    moves, retypes, reshapes, adds or drops a tensor, or changes its length, changes it."""
    r = base if isinstance(base, GGUFFile) else GGUFFile(base)
    h = hashlib.sha256(f"size {r.path.stat().st_size}\n".encode())
    for t in r.tensors:
        shape = ",".join(str(int(x)) for x in t.shape)
        h.update(f"{t.name}\t{int(t.tensor_type)}\t{shape}\t{t.data_offset}\n".encode())
    return h.hexdigest()


def stamp_base_hash(sidecar_path: Path, digest: str, key: str = "base_sha256") -> None:
    """Replace the placeholder of a base hash in the sidecar's header (same length, so nothing moves)."""
    with sidecar_path.open("r+b") as f:
        head = f.read(1 << 16)
        at = head.find((KEY + key).encode())
        pos = head.find(_HASH_PLACEHOLDER.encode(), at)
        if at < 0 or pos < 0:
            raise RuntimeError(f"sidecar header has no {key} placeholder")
        f.seek(pos)
        f.write(digest.encode())


def stamp_base(sidecar_path: Path, base_path: Path) -> None:
    """Record the finished base's full and layout hashes in the sidecar."""
    stamp_base_hash(sidecar_path, file_sha256(base_path))
    stamp_base_hash(sidecar_path, layout_sha256(base_path), "base_layout_sha256")


def read_sidecar_meta(path: str | os.PathLike[str] | GGUFFile) -> dict[str, Any]:
    r = path if isinstance(path, GGUFFile) else GGUFFile(path)
    if r.get("general.architecture") != SIDECAR_ARCH:
        raise ModelFileError(f"{r.path} is not a RapidMoE residual sidecar")
    meta = {k[len(KEY):]: f.value for k, f in r.fields.items() if k.startswith(KEY)}
    meta["tensors"] = {t.name: (t.tensor_type.name, [int(x) for x in t.shape]) for t in r.tensors}
    return meta


def check_pair(wq_path: str | os.PathLike[str] | GGUFFile, wr_path: str | os.PathLike[str] | GGUFFile, *,
               verify: bool = True, verify_data: bool = False) -> dict[str, Any]:
    """Refuse a sidecar that was not made from this base; returns the sidecar's metadata.

    Always: the pair id. verify: the base's size and tensor table against the layout hash the sidecar recorded
    (the header only; a sidecar older than that hash gets the full hash instead, with a warning). verify_data: also
    every byte against the full sha256 (reads the whole base). Either argument may be an already parsed GGUFFile
    (its header is then not read again)."""
    base = wq_path if isinstance(wq_path, GGUFFile) else GGUFFile(wq_path)
    side = wr_path if isinstance(wr_path, GGUFFile) else GGUFFile(wr_path)
    wq_path, wr_path = base.path, side.path
    meta = read_sidecar_meta(side)
    if int(meta.get("format_version", 0)) != FORMAT_VERSION:
        raise ModelFileError(f"{wr_path} has sidecar format {meta.get('format_version')}, "
                             f"this RapidMoE reads {FORMAT_VERSION}")
    base_id = base.get("rapidmoe.resplit.pair_id")
    if base_id != meta["pair_id"]:
        raise ModelFileError(f"sidecar {wr_path} does not belong to {wq_path} "
                             f"(pair id {meta['pair_id']} vs {base_id or 'none: not a RESplit .wq.gguf'})")
    layout = meta.get("base_layout_sha256")
    if verify and layout is not None and layout_sha256(base) != layout:
        raise ModelFileError(f"{wq_path} has changed since sidecar {wr_path} was made (its size or tensor table "
                             "differs); re-convert the model")
    if verify and layout is None and not verify_data:
        log.warning("sidecar %s was made by an older RapidMoE without a layout hash: checking the base by its full "
                    "sha256 (reads all of %s); re-convert for a check that reads the header only", wr_path, wq_path)
    if (verify_data or (verify and layout is None)) and file_sha256(wq_path) != meta["base_sha256"]:
        raise ModelFileError(f"{wq_path} has changed since sidecar {wr_path} was made (sha256 differs); "
                             "re-convert the model")
    return meta
