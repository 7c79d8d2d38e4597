"""The fuzz targets: for an index, the input's files and the command that reads them, made deterministically from
(seed, target, index); and the checks of a command's output files.

model    the default model (F16) or its .wq.gguf (k-quants), mutated by structure; `run` (some with --trace),
         `inspect`, and a few `convert`, half with the default preset (whose output directory must hold nothing
         after a failure)
sidecar  the .wr.gguf of the default model's cpu-fast conversion, mutated by structure and, three times in four,
         re-signed (its sampled digests and header hash recomputed) so that the pairing checks pass and the C++
         loader sees the damage; `run --residual` and `inspect --residual`
imatrix, frequency, policy, trace: the Python readers (readers.py), many inputs per second
upstream the model target's mutants (same index, same bytes) loaded by llama.cpp alone: which of its asserts a file
         reaches when nothing checks it first (the measurement behind rapidmoe's own checks; not a target to pass)
"""
from __future__ import annotations

import base64
import random
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import mutate_misc
from .gguf_layout import Edit, Layout, parse, write_mutant
from .mutate_gguf import MODEL_OPS, SIDECAR_OPS, Op, mutate

RUN_ARGS = ["-p", "Hello world", "-n", "2", "-c", "128", "--temp", "0", "-t", "1"]


@dataclass
class Bases:
    """The files mutants are made from (made once per directory) and their parsed layouts."""

    dir: Path
    model: Path  # the default model, F16
    wq: Path  # its cpu-fast conversion
    wr: Path
    data: dict[str, bytes] = field(default_factory=dict)
    layout: dict[str, Layout] = field(default_factory=dict)
    seeds: dict[str, Any] = field(default_factory=dict)

    def path(self, name: str) -> Path:
        return {"model": self.model, "wq": self.wq, "wr": self.wr}[name]

    def load(self, name: str) -> tuple[bytes, Layout]:
        if name not in self.data:
            seed = self.seeds.get(name)
            self.data[name] = seed if isinstance(seed, bytes) else self.path(name).read_bytes()
            self.layout[name] = parse(self.data[name])
        return self.data[name], self.layout[name]


def prepare_bases(dir: Path, model: Path | None = None) -> Bases:  # noqa: A002
    """The default model (or `model`), its cpu-fast conversion and the seeds of the reader targets, in `dir`."""
    from rapidmoe.default_model import ensure_default_model  # noqa: PLC0415
    from rapidmoe.resplit.convert import convert  # noqa: PLC0415
    from rapidmoe.resplit.presets import get_preset  # noqa: PLC0415

    dir = dir.resolve()  # noqa: A001 - the cases run in their own directories: a relative base path (the default
    # --bases) was looked up there, and every sidecar case of a long run ended as "model file not found"
    dir.mkdir(parents=True, exist_ok=True)
    src = model if model is not None else ensure_default_model(progress=False)
    split = dir / "split"
    wq, wr = split / "base.wq.gguf", split / "base.wr.gguf"
    if not (wq.exists() and wr.exists()):
        shutil.rmtree(split, ignore_errors=True)
        staging = dir / "split.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staged = staging / "base.gguf"
        staging.mkdir()
        staged.symlink_to(src.resolve())
        res = convert(staged, split, get_preset("cpu-fast"), progress=False)
        res.wq_path.rename(wq)
        res.wr_path.rename(wr)
        shutil.rmtree(staging)
    b = Bases(dir, src, wq, wr)
    b.seeds["policy"] = mutate_misc.policy_seed()
    b.seeds["trace"] = [mutate_misc.trace_seed(dir / "seed-trace.bin", p) for p in (False, True)]
    b.seeds["imatrix"] = mutate_misc.imatrix_seed(dir / "seed-imatrix.gguf")
    b.seeds["legacy_imatrix"] = mutate_misc.legacy_imatrix_seed()
    return b


@dataclass
class Case:
    """One input: what to write, the command, what to check afterwards, and the recipe that remakes it."""

    target: str
    index: int
    argv: list[str]
    recipe: dict[str, Any]
    timeout_scale: float = 1.0  # convert takes longer than run
    check: Callable[[Path, int], str | None] | None = None  # (workdir, exit status) -> problem with outputs
    kind: str = ""  # the command it runs, for the counts (model: run, run --trace, inspect, convert [cpu-fast])


def _blob(b: bytes) -> str:
    return base64.b64encode(zlib.compress(b, 9)).decode()


def unblob(s: str) -> bytes:
    return zlib.decompress(base64.b64decode(s))


def _resign(path: Path) -> bool:
    """Recompute a mutated sidecar's sampled digests and header hash in place, where its header still parses and
    has them: the pairing checks then pass, and what they would have caught reaches the loader."""
    from rapidmoe.ggufio import GGUFFile  # noqa: PLC0415
    from rapidmoe.resplit import sidecar  # noqa: PLC0415
    from rapidmoe.resplit.fingerprint import sample_digests  # noqa: PLC0415

    try:
        side = GGUFFile(path)
        meta = sidecar.read_sidecar_meta(side)
        at_samples = side.value_offsets[sidecar.KEY + "data_samples"]
        side.value_offsets[sidecar.KEY + "header_sha256"]
        digests = "".join(sample_digests(side, sidecar.scheme_of(meta)))
    except Exception:  # noqa: BLE001 - any damage that stops the re-signing leaves the mutant as it is
        return False
    if len(digests) == len(meta.get("data_samples", "")):
        with path.open("r+b") as f:
            f.seek(at_samples)
            f.write(digests.encode())
    h = sidecar.header_sha256(GGUFFile(path))
    with path.open("r+b") as f:
        f.seek(GGUFFile(path).value_offsets[sidecar.KEY + "header_sha256"])
        f.write(h.encode())
    return True


def materialize(bases: Bases, recipe: dict[str, Any], workdir: Path) -> None:
    """Write a case's input files into workdir (mutant.gguf, mutant.json, ...) from its recipe."""
    # the outputs of the case before, with the temporary names a killed or sanitizer-halted run leaves (.tmpPID)
    for p in [workdir / "out", *workdir.glob("trace.bin*")]:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    if "edits" in recipe:
        data, _ = bases.load(recipe["base"])
        dst = workdir / recipe["file"]
        write_mutant(dst, data, [Edit.from_json(e) for e in recipe["edits"]])
        if recipe.get("resign"):
            _resign(dst)
    else:
        (workdir / recipe["file"]).write_bytes(unblob(recipe["bytes"]))


def _rng(seed: int, target: str, index: int) -> random.Random:
    return random.Random(f"{seed}/{target}/{index}")


def _gguf_recipe(rng: random.Random, bases: Bases, base: str, ops: dict[str, tuple[Op, float]],
                 file: str) -> dict[str, Any]:
    data, lay = bases.load(base)
    names, edits = mutate(rng, lay, data, ops)
    return {"base": base, "file": file, "ops": names, "edits": [e.to_json() for e in edits]}


def _check_convert(workdir: Path, rc: int) -> str | None:
    from rapidmoe.ggufio import GGUFFile  # noqa: PLC0415

    out = workdir / "out"
    files = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if rc != 0:
        return f"convert failed but left {files}" if files else None
    for name in files:
        if name.endswith(".gguf"):
            f = GGUFFile(out / name)
            if f.missing_data() is not None:
                return f"convert succeeded but {name} is incomplete"
        if ".tmp" in name:
            return f"convert succeeded but left {name}"
    return None if any(n.endswith(".wr.gguf") for n in files) else f"convert succeeded without a sidecar: {files}"


def _check_trace(workdir: Path, rc: int) -> str | None:
    from rapidmoe.trace import TraceError, read_trace  # noqa: PLC0415

    left = sorted(p.name for p in workdir.iterdir() if p.name.startswith("trace.bin"))
    if rc != 0:
        return f"run failed but left {left}" if left else None
    if left != ["trace.bin"]:
        return f"run succeeded, trace files: {left}"
    try:
        read_trace(workdir / "trace.bin")
    except TraceError as e:
        return f"run succeeded but its trace does not read: {e}"
    return None


def model_case(bases: Bases, seed: int, index: int, convert_share: float = 0.02, upstream: bool = False) -> Case:
    """upstream: the same mutant (same index) loaded by llama.cpp alone, without rapidmoe's checks."""
    rng = _rng(seed, "model", index)
    base = "model" if rng.random() < 0.6 else "wq"
    recipe = _gguf_recipe(rng, bases, base, MODEL_OPS, "mutant.gguf")
    if upstream:
        return Case("upstream", index, ["--reader", "llama-load", "mutant.gguf"], recipe)
    r = rng.random()
    if r < convert_share:  # half with the default preset (auto), which inspects the file before it converts
        preset = ["--preset", "cpu-fast"] if r < convert_share / 2 else []
        argv = ["convert", "mutant.gguf", "-o", "out", *preset]
        return Case("model", index, argv, recipe, 4.0, _check_convert, "convert" + (" cpu-fast" if preset else ""))
    r = (r - convert_share) / (1 - convert_share)  # the other cases, spread alike whatever the convert share
    if r < 0.15:
        return Case("model", index, ["inspect", "mutant.gguf"], recipe, kind="inspect")
    if r < 0.25:
        return Case("model", index, ["run", "mutant.gguf", *RUN_ARGS, "--trace", "trace.bin"], recipe,
                    check=_check_trace, kind="run --trace")
    return Case("model", index, ["run", "mutant.gguf", *RUN_ARGS], recipe, kind="run")


def sidecar_case(bases: Bases, seed: int, index: int) -> Case:
    rng = _rng(seed, "sidecar", index)
    recipe = _gguf_recipe(rng, bases, "wr", SIDECAR_OPS, "mutant.wr.gguf")
    recipe["resign"] = rng.random() < 0.75
    wq = "{wq}"  # the base's path, filled in when the case runs (records stay valid elsewhere)
    if rng.random() < 0.15:
        return Case("sidecar", index, ["inspect", wq, "--residual", "mutant.wr.gguf"], recipe)
    return Case("sidecar", index, ["run", wq, "--residual", "mutant.wr.gguf", "-r", "2", *RUN_ARGS], recipe)


READER_OPS = {k: v for k, v in MODEL_OPS.items() if not k.startswith("tok_")}


def reader_case(bases: Bases, seed: int, index: int, kind: str) -> Case:
    rng = _rng(seed, kind, index)
    if kind in ("imatrix", "frequency") and rng.random() < 0.5:  # a GGUF imatrix (both read it)
        recipe = _gguf_recipe(rng, bases, "imatrix", READER_OPS, "input.gguf")
    else:
        if kind == "imatrix":
            data, file = mutate_misc.mutate_legacy_imatrix(rng, bases.seeds["legacy_imatrix"]), "input.dat"
        elif kind == "frequency":
            data, file = mutate_misc.mutate_json(rng, mutate_misc.frequency_seed(rng)), "input.json"
        elif kind == "policy":
            data, file = mutate_misc.mutate_json(rng, bases.seeds["policy"]), "input.json"
        else:
            data, file = mutate_misc.mutate_trace(rng, rng.choice(bases.seeds["trace"])), "input.bin"
        recipe = {"file": file, "bytes": _blob(data)}
    return Case(kind, index, ["--reader", kind, recipe["file"]], recipe, 0.25)


TARGETS = ("model", "sidecar", "imatrix", "frequency", "policy", "trace")  # and "upstream", a measurement


def make_case(bases: Bases, target: str, seed: int, index: int, convert_share: float = 0.02) -> Case:
    if target in ("model", "upstream"):
        return model_case(bases, seed, index, convert_share, upstream=target == "upstream")
    if target == "sidecar":
        return sidecar_case(bases, seed, index)
    return reader_case(bases, seed, index, target)
