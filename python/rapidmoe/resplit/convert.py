"""RESplit conversion: a full-precision MoE GGUF -> `<name>.wq.gguf` (runs in stock llama.cpp) + `<name>.wr.gguf`.

Streams tensor by tensor and expert by expert, each routed expert encoded by the preset's codec (codecs/): the
residual codec's W -> WQ = q(W); WR = q(W - deq(WQ)) for gate/up (and down in residual mode) or a high-precision
copy of down, every (de)quantization ggml's own through rapidmoe._core, so the residual is taken against exactly
what the kernels dequantize; the refine codec's ("q3k-refine1", refine.py) Q3_K bytes in WQ and refinement bits in
the sidecar (`.rf`, I8 [n_in/8, n_out, n_expert]). Outputs appear only when complete.
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from tqdm import tqdm

from ..atomic import OutputError, make_dir, outputs, replace_all
from ..errors import ModelFileError, RapidMoEError
from ..ggml_types import ggml_type, tensor_bytes
from ..ggufio import GGUFFile, Tensor, abandon_writer, copy_metadata, n_rows, plan_files, tensor_rows
from ..modelfile import require_moe
from ..moe_tensors import DOWN, GATE, GATE_UP, SCALE, UP, is_expert, moe_layers, parse_expert
from . import sidecar
from .codecs import DEFAULT, codec_of, encode_measured
from .fingerprint import sample_digests
from .imatrix import Imatrix
from .presets import NEEDS_IMATRIX, Preset, get_preset, parse_mix
from .report import ErrorAccumulator, TensorReport
from .typechoice import ExpertPlan, check_expert_plan, exact_mixture, plan_expert, tensor_choice

log = logging.getLogger(__name__)

# What converts is decided by the tensors, not by the architecture's name: every routed-expert tensor stacked as
# llama.cpp's shared MoE builder reads it (blk.N.ffn_{gate,up,down}_exps.weight, or the merged
# ffn_gate_up_exps.weight, each [n_in, n_out, n_expert]) is split; every other tensor (attention, shared experts,
# biases, per-expert scales, norms, chunk experts, ...) goes through the preset's non-expert rule.
LAYER_ROLE_SETS = (frozenset({GATE, UP, DOWN}), frozenset({GATE_UP, DOWN}))
INPUT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
               GGMLQuantizationType.Q8_0)


@dataclass(frozen=True)
class ConvertResult:
    wq_path: Path
    wr_path: Path
    report_path: Path
    seconds: float
    report: dict[str, object] = field(repr=False)


def _mixture_types(src: Path, ftype: int) -> dict[str, GGMLQuantizationType]:
    """Every tensor's type in a stock llama-quantize of `src` to llama_ftype `ftype` (llama.cpp's own choice)."""
    from .._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use)

    try:
        return {name: GGMLQuantizationType(ty) for name, ty in _core.quant_types(str(src), ftype)}
    except ValueError as e:
        raise ModelFileError(f"{src}: llama.cpp cannot plan this quantization mixture ({e})") from None


def _target_choice(t: Tensor, preset: Preset, mixture: dict[str, GGMLQuantizationType] | None = None,
                   overrides: dict[str, str] | None = None) -> tuple[GGMLQuantizationType, str]:
    """Type of a non-expert tensor in the WQ file and the rule that chose it (typechoice.tensor_choice; `mixture`:
    llama.cpp's plan)."""
    rule = exact_mixture({k: v.name for k, v in mixture.items()}) if mixture is not None else None
    ty, why = tensor_choice(t.name, tuple(int(x) for x in t.shape), t.tensor_type.name, preset, overrides or {}, rule)
    return ggml_type(ty), why


def _target_type(t: Tensor, preset: Preset, mixture: dict[str, GGMLQuantizationType] | None = None,
                 overrides: dict[str, str] | None = None) -> GGMLQuantizationType:
    """Type of a non-expert tensor in the WQ file (_target_choice's type)."""
    return _target_choice(t, preset, mixture, overrides)[0]


def _byte_shape(t: Tensor, qt: GGMLQuantizationType) -> tuple[int, ...]:
    from .._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use)

    dims = [int(x) for x in reversed(t.shape)]
    return (*dims[:-1], _core.row_size(int(qt), dims[-1]))


def _add_quant_info(w: GGUFWriter, name: str, byte_shape: tuple[int, ...], qt: GGMLQuantizationType) -> None:
    w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape, dtype=np.int64)), qt)


def _pair_id(reader: GGUFFile, src: Path, preset: Preset, imatrix_digest: str) -> str:
    """Deterministic id shared by both outputs: source tensor table and sampled tensor data (so two models of one
    layout, other seeds or fine-tunes, get different ids) + preset + imatrix."""
    h = hashlib.sha256()
    h.update(json.dumps(preset.record(), sort_keys=True).encode())
    codec = codec_of(preset)
    if codec.name != DEFAULT:  # the sidecar's codec (absent for the classic residual/copy sidecars)
        h.update(f"codec {codec.name}".encode())
    h.update(imatrix_digest.encode())
    h.update(str(reader.size).encode())
    for t in reader.tensors:
        h.update(f"{t.name}:{int(t.tensor_type)}:{list(map(int, t.shape))}:{int(t.data_offset)}".encode())
    h.update("".join(sample_digests(reader)).encode())
    return h.hexdigest()[:32]


def _imatrix_digest(im: Imatrix | None) -> str:
    if im is None:
        return "none"
    h = hashlib.sha256()
    for k in sorted(im.in_sum2):
        h.update(k.encode())
        h.update(np.ascontiguousarray(im.in_sum2[k]).tobytes())
    return h.hexdigest()


def _obstacle(reader: GGUFFile, experts: list[Tensor], preset: Preset) -> str | None:
    """What the preset's codec does not take in this model, as the message that refuses it (the refine codec: merged
    gate_up experts, per-expert scales, rows that are not whole Q3_K super-blocks). None: the model is fine."""
    listed = [(t.name, e.role, tuple(int(x) for x in t.shape)) for t in experts if (e := parse_expert(t.name))]
    scaled = [t.name for t in reader.tensors if parse_expert(t.name, (SCALE,)) is not None]
    return codec_of(preset).obstacle(listed, scaled, preset.name)


def codec_obstacle(src: Path, preset: str) -> str | None:
    """Why the codec of the preset named `preset` cannot convert the model at `src` (convert's refusal), or None
    where it can. `convert --preset auto` asks before it picks a preset, so the file is checked as convert checks it
    first (ModelFileError: not a readable MoE GGUF, or routed experts RESplit cannot split)."""
    require_moe(src)
    reader = GGUFFile(src)
    layers = expert_layers(reader, src)
    return _obstacle(reader, [t for roles in layers.values() for t in roles.values()], get_preset(preset))


def expert_layers(reader: GGUFFile, src: Path) -> dict[int, dict[str, Tensor]]:
    """The routed-expert tensors by layer and role, checked to be what RESplit splits (ModelFileError otherwise):
    stacked [n_in, n_out, n_expert] in a full-precision type, gate+up+down or gate_up+down in every MoE layer, one
    expert count per layer."""
    experts = [t for t in reader.tensors if is_expert(t.name)]
    if not experts:
        raise ModelFileError(f"{src} has no routed-expert tensors (blk.N.ffn_{{gate,up,down}}_exps.weight or "
                             "ffn_gate_up_exps.weight): nothing for RESplit to split")
    layers: dict[int, dict[str, Tensor]] = {}
    for t in experts:
        e = parse_expert(t.name)
        assert e is not None
        layers.setdefault(e.layer, {})[e.role] = t
        if GGMLQuantizationType(int(t.tensor_type)) not in INPUT_TYPES:
            raise ModelFileError(f"tensor {t.name} is {t.tensor_type.name}; RESplit needs F32/F16/BF16/Q8_0 "
                                 "input (convert from the original weights, not from a low-bit quantization)")
        if len(t.shape) != 3:
            raise ModelFileError(f"tensor {t.name} has shape {[int(x) for x in t.shape]}; RESplit splits stacked "
                                 "experts [n_in, n_out, n_expert]")
    for il, roles in sorted(layers.items()):
        if frozenset(roles) not in LAYER_ROLE_SETS:
            first = next(iter(roles.values())).name
            raise ModelFileError(f"tensor {first}: layer {il} has routed experts {'/'.join(sorted(roles))}; "
                                 "RESplit splits gate+up+down or merged gate_up+down (llama.cpp's gated layout)")
        counts = {int(t.shape[2]) for t in roles.values()}
        if len(counts) != 1:
            raise ModelFileError(f"tensor {roles['down'].name}: layer {il}'s expert tensors disagree on the "
                                 f"number of experts ({sorted(counts)})")
    return layers


class _Converter:
    def __init__(self, src: Path, preset: Preset, imatrix: Imatrix | None, report_experts: int | None) -> None:
        self.src, self.preset, self.imatrix, self.report_experts = src, preset, imatrix, report_experts
        self.reader = GGUFFile(src)
        self.arch = str(self.reader.get("general.architecture"))
        self.reports: list[TensorReport] = []
        self.plans: dict[str, ExpertPlan] = {}
        self.totals = ErrorAccumulator()
        self.others: dict[str, dict[str, object]] = {}  # non-expert tensor -> its type, dims and the rule's words
        self.sidecar_names: dict[str, str] = {}  # routed-expert tensor -> its sidecar tensor
        self.codec = codec_of(preset)

    # -- validation -------------------------------------------------------------------------------------
    def expert_tensors(self) -> list[Tensor]:
        return [t for t in self.reader.tensors if is_expert(t.name)]

    def moe_layers(self) -> list[int]:
        return moe_layers(t.name for t in self.expert_tensors())

    def validate(self) -> None:
        layers = expert_layers(self.reader, self.src)
        experts = self.expert_tensors()
        obstacle = _obstacle(self.reader, experts, self.preset)
        if obstacle is not None:
            raise ModelFileError(obstacle)
        if self.preset.mix:
            self.validate_mix(layers)
        self.plans = {t.name: plan_expert(t.name, tuple(int(x) for x in t.shape), self.preset) for t in experts}
        for t in experts:
            check_expert_plan(self.plans[t.name], int(t.shape[0]))
        p = self.preset
        needs = sorted({pl.wq for pl in self.plans.values() if pl.wq in NEEDS_IMATRIX})
        if self.imatrix is None and needs:
            raise RapidMoEError(f"{', '.join(needs)} {'needs' if len(needs) == 1 else 'need'} an importance matrix "
                                f"(preset {p.name}): pass --imatrix FILE (llama.cpp's) or --calib-text FILE to "
                                "compute one with our build")

    def validate_mix(self, layers: dict[int, dict[str, Tensor]]) -> None:
        """Every mix entry names an MoE layer of this model, and none an up of a merged gate_up layer (gate's entry
        types it): an entry that would change nothing is refused rather than recorded."""
        merged = {il for il, roles in layers.items() if GATE_UP in roles}
        for e in parse_mix(self.preset.mix):
            if e.layer is not None and e.layer not in layers:
                raise ModelFileError(f"mix entry {e}: {self.src.name} has no routed experts in layer {e.layer} "
                                     f"(its MoE layers: {_ranges(sorted(layers))})")
            if e.role == "up" and (e.layer in merged if e.layer is not None else merged == set(layers)):
                where = f"layer {e.layer}" if e.layer is not None else "every layer"
                raise ModelFileError(f"mix entry {e}: {where} of {self.src.name} stores gate and up as one gate_up "
                                     "tensor, which takes gate's entry; give the types as a gate entry")

    def merged_layers(self) -> list[int]:
        return sorted({e.layer for t in self.expert_tensors() if (e := parse_expert(t.name))
                       and e.role == GATE_UP})

    def fallbacks(self) -> list[str]:
        return [d for pl in self.plans.values() for d in pl.describe_fallbacks()]

    # -- one routed-expert tensor -------------------------------------------------------------------------
    def sample_experts(self, n_expert: int) -> set[int]:
        """The experts on which the reference types are measured (report_experts of them, evenly spread)."""
        if self.report_experts is None:
            return set(range(n_expert))
        picks = np.linspace(0, n_expert - 1, min(n_expert, self.report_experts)).round().astype(int)
        return {int(e) for e in picks}

    def convert_expert(self, t: Tensor) -> tuple[np.ndarray, np.ndarray]:
        """One routed-expert tensor, expert by expert through its codec's reference encoder: (WQ bytes [n_expert,
        n_out, WQ row], sidecar bytes [n_expert, n_out, sidecar row]). The report's "wq_only" is deq(WQ)'s error,
        "critical" the critical slot's weights', against the codec's reference types."""
        plan, codec = self.plans[t.name], self.codec
        n_in, n_out, n_expert = (int(x) for x in t.shape)
        copy = codec.is_copy(plan.role, self.preset)
        imat = self.imatrix.weights_for(t.name, n_expert, n_in) if self.imatrix is not None else None
        wq_out = np.empty((n_expert, n_out, tensor_bytes(plan.wq, (n_in,))), dtype=np.uint8)
        hi_out = np.empty(codec.sidecar_tensor((n_in, n_out, n_expert), plan.hi)[1], dtype=np.uint8)
        rep = TensorReport(t.name, plan.role, plan.wq, plan.hi, copy, fallbacks=plan.describe_fallbacks())
        ref_types = codec.reference_types(n_in)
        sample = self.sample_experts(n_expert)
        for e in range(n_expert):
            w = tensor_rows(t, e * n_out, n_out)
            im = imat[e] if imat is not None else None
            enc = encode_measured(codec, w, plan.wq, plan.hi, copy, im, ref_types if e in sample else (), rep)
            wq_out[e], hi_out[e] = enc.wq, enc.sidecar
        self.reports.append(rep)
        self.totals.merge(rep.acc)
        return wq_out, hi_out

    # -- the whole file -----------------------------------------------------------------------------------
    def run(self, wq_tmp: Path, wr_tmp: Path, pair_id: str, progress: bool) -> None:
        wq = GGUFWriter(wq_tmp, arch=self.arch)
        wr = GGUFWriter(wr_tmp, arch=sidecar.SIDECAR_ARCH)
        try:
            self.write(wq, wr, pair_id, progress)
            wq.close()
            wr.close()
        except BaseException:
            for w in (wq, wr):
                abandon_writer(w)
            raise

    def header(self, wq: GGUFWriter, wr: GGUFWriter, pair_id: str) -> list[tuple[Tensor, GGMLQuantizationType | None]]:
        """Both files' metadata and tensor tables, added to the writers; returns every source tensor in file order
        with its WQ type (None: a routed-expert tensor, split into WQ and the sidecar)."""
        p = self.preset
        copy_metadata(self.reader, wq, skip_prefixes=("rapidmoe.resplit.",))
        wq.add_string("rapidmoe.resplit.role", "wq")
        wq.add_string("rapidmoe.resplit.pair_id", pair_id)
        wq.add_string("rapidmoe.resplit.preset", p.name)
        wq.add_string("rapidmoe.resplit.wq_type", p.wq)
        sidecar.add_metadata(wr, preset=p, pair_id=pair_id, base_arch=self.arch,
                             n_layer=int(self.reader.get(f"{self.arch}.block_count", 0)),
                             n_expert=int(self.reader.get(f"{self.arch}.expert_count", 0)),
                             n_base_tensors=len(self.reader.tensors), n_sidecar_tensors=len(self.plans),
                             type_fallbacks=self.fallbacks())
        if self.fallbacks():
            wq.add_array("rapidmoe.resplit.type_fallbacks", self.fallbacks())
        plan: list[tuple[Tensor, GGMLQuantizationType | None]] = []
        mixture = _mixture_types(self.src, p.other_mixture) if p.other_mixture is not None else None
        overrides = p.tensor_types({t.name for t in self.reader.tensors})
        for t in self.reader.tensors:
            e = parse_expert(t.name)
            if e is not None:
                wq_t = ggml_type(self.plans[t.name].wq)
                _add_quant_info(wq, t.name, _byte_shape(t, wq_t), wq_t)
                side_name = self.sidecar_names[t.name] = self.codec.sidecar_name(t.name, e.role, p)
                side_t, side_shape = self.codec.sidecar_tensor(tuple(int(x) for x in t.shape), self.plans[t.name].hi)
                _add_quant_info(wr, side_name, side_shape, side_t)
                plan.append((t, None))
            else:
                qt, why = _target_choice(t, p, mixture, overrides)
                self.others[t.name] = {"type": qt.name, "dims": len(t.shape), "rule": why}
                if qt in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                    dt = np.dtype(np.float32 if qt == GGMLQuantizationType.F32 else np.float16)
                    shape = tuple(int(x) for x in reversed(t.shape))
                    wq.add_tensor_info(t.name, shape, dt, int(np.prod(shape)) * dt.itemsize, qt)
                else:
                    _add_quant_info(wq, t.name, _byte_shape(t, qt), qt)
                plan.append((t, qt))
        return plan

    def write(self, wq: GGUFWriter, wr: GGUFWriter, pair_id: str, progress: bool) -> None:
        """The reference writer: one tensor after another, routed experts one expert at a time through their codec's
        reference encoder (numpy for the refine codec, ggml for the residual codec) on this thread."""
        from .._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use)

        plan = self.header(wq, wr, pair_id)
        for w in (wq, wr):
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
        total = sum(int(t.n_bytes) for t, _ in plan)
        with tqdm(total=total, unit="B", unit_scale=True, desc="resplit", disable=not progress) as bar:
            for t, target in plan:
                bar.set_postfix_str(t.name, refresh=False)
                if target is None:
                    wq_data, hi_data = self.convert_expert(t)
                    wq.write_tensor_data(wq_data)
                    wr.write_tensor_data(hi_data)
                else:
                    if target == GGMLQuantizationType(int(t.tensor_type)):  # kept as stored (a mixture keeps some)
                        wq.write_tensor_data(np.asarray(t.data).reshape(-1).view(np.uint8))
                        bar.update(int(t.n_bytes))
                        continue
                    rows = tensor_rows(t, 0, n_rows(t))
                    if target == GGMLQuantizationType.F32:
                        data = rows.reshape(tuple(int(x) for x in reversed(t.shape)))
                    elif target == GGMLQuantizationType.F16:
                        data = rows.astype(np.float16).reshape(tuple(int(x) for x in reversed(t.shape)))
                    else:
                        data = _core.quantize(rows, int(target)).reshape(_byte_shape(t, target))
                    wq.write_tensor_data(data)
                bar.update(int(t.n_bytes))


def _ranges(xs: list[int]) -> str:
    """0-3, 5, 7-9"""
    out: list[str] = []
    for x in xs:
        if out and x == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{x}"
        else:
            out.append(str(x))
    return ", ".join(out)


def check_outputs(paths: list[Path], force: bool) -> None:
    """Refuse outputs that exist, unless force."""
    existing = [p for p in paths if p.exists()]
    if existing and not force:
        raise RapidMoEError(f"{existing[0]} exists; pass --force to overwrite")


def output_paths(out_dir: Path, name: str) -> tuple[Path, Path, Path]:
    return out_dir / f"{name}.wq.gguf", out_dir / f"{name}.wr.gguf", out_dir / f"{name}.resplit.json"


def journal_path(out_dir: Path, name: str) -> Path:
    """The journal of an unfinished conversion (parallel.py)."""
    return out_dir / f"{name}.resplit.journal"


ENCODERS = ("compiled", "numpy")


def convert(src: str | os.PathLike[str], out_dir: str | os.PathLike[str], preset: Preset, *,
            imatrix: Imatrix | None = None, name: str | None = None, force: bool = False, progress: bool = True,
            report_experts: int | None = 4, threads: int | None = None, resume: bool = False,
            encoder: str = "compiled", split_max_size: int = 0) -> ConvertResult:
    """Convert `src` into out_dir/<name>.wq.gguf + <name>.wr.gguf (+ <name>.resplit.json, the error report).

    report_experts: reference errors (plain Q4_K and Q8_0 of W) on this many experts per tensor (None: all).
    threads: worker threads (None: every core this process may use). resume: continue the unfinished conversion in
    out_dir (its `.partial` files and journal, parallel.py), each item it lists checked against its recorded hash;
    without one it starts afresh. encoder "numpy": the reference, one thread, numpy's refine codec and
    one expert at a time (no resume); "compiled" writes the same bytes. split_max_size: split each output in parts of
    at most this many bytes of tensor data (llama.cpp's gguf-split naming and keys: NAME.wq-00001-of-0000N.gguf, which
    llama.cpp loads from its first part); 0: one file each. The result names the first parts.
    """
    if encoder not in ENCODERS:
        raise RapidMoEError(f"encoder must be one of {', '.join(ENCODERS)}, not {encoder!r}")
    if threads is not None and threads < 1:
        raise RapidMoEError(f"threads must be at least 1, not {threads}")
    if split_max_size < 0:
        raise RapidMoEError(f"split_max_size must be positive (or 0: no split), not {split_max_size}")
    if (split_max_size or resume) and encoder == "numpy":
        raise RapidMoEError("split outputs (--split-max-size) and --resume need the compiled encoder")
    src_p = Path(src)
    require_moe(src_p)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise RapidMoEError(f"output {out} exists and is not a folder")
    base = name or src_p.name.removesuffix(".gguf")
    wq_path, wr_path, report_path = output_paths(out, base)
    check_outputs([wq_path, wr_path, report_path], force)
    conv = _Converter(src_p, preset, imatrix, report_experts)
    conv.validate()
    pair_id = _pair_id(conv.reader, src_p, preset, _imatrix_digest(imatrix))
    make_dir(out)
    t0 = time.perf_counter()
    if encoder == "numpy":
        # outputs(): complete or absent, also on a write error (one line) and on a signal that ends the process
        with outputs([wq_path, wr_path, report_path]) as (wq_tmp, wr_tmp, rep_tmp):
            conv.run(wq_tmp, wr_tmp, pair_id, progress)
            sidecar.stamp(wr_tmp, wq_tmp)
            seconds = time.perf_counter() - t0
            report = _report(conv, src_p, preset, imatrix, pair_id, seconds, [wq_tmp], [wr_tmp])
            rep_tmp.write_text(json.dumps(report, indent=1))
    else:
        report = _convert_parallel(conv, out, base, pair_id, threads, resume, force, progress, t0, split_max_size)
        seconds = float(report["seconds"])  # type: ignore[arg-type]
        files = report["files"]
        assert isinstance(files, dict)
        wq_path, wr_path = Path(files["wq"][0]), Path(files["wr"][0])
    for line in conv.fallbacks():
        log.info("resplit: row size needs a fallback type (as llama-quantize): %s", line)
    log.info("resplit: wrote %s and %s in %.1f s", wq_path, wr_path, seconds)
    return ConvertResult(wq_path, wr_path, report_path, seconds, report)


def _report(conv: _Converter, src: Path, preset: Preset, imatrix: Imatrix | None, pair_id: str, seconds: float,
            wq_files: list[Path], wr_files: list[Path]) -> dict[str, object]:
    return {
        "source": str(src), "preset": preset.record(),
        "bits": preset.bits(conv.moe_layers(), conv.merged_layers()), "pair_id": pair_id,
        **({"codec": conv.codec.name} if conv.codec.name != DEFAULT else {}),
        "imatrix": imatrix is not None, "seconds": round(seconds, 3),
        "files": {"wq_bytes": sum(p.stat().st_size for p in wq_files),
                  "wr_bytes": sum(p.stat().st_size for p in wr_files), "source_bytes": conv.reader.size},
        "total": conv.totals.summary(), "tensors": [r.summary() for r in conv.reports],
        "type_fallbacks": conv.fallbacks(),
        "other_tensors": conv.others,
    }


def _convert_parallel(conv: _Converter, out: Path, base: str, pair_id: str, threads: int | None, resume: bool,
                      force: bool, progress: bool, t0: float, split_max_size: int = 0) -> dict[str, object]:
    """The compiled encoder on `threads` threads, through resumable partial files (parallel.py)."""
    from . import parallel  # noqa: PLC0415  (tqdm and the pool: only for a conversion)

    wq_path, wr_path, report_path = output_paths(out, base)
    wq_w = GGUFWriter(None, arch=conv.arch, split_max_size=split_max_size)
    wr_w = GGUFWriter(None, arch=sidecar.SIDECAR_ARCH, split_max_size=split_max_size)
    plan = conv.header(wq_w, wr_w, pair_id)
    for w in (wq_w, wr_w):
        if len(w.tensors) == 1:  # fits in one part: not split (and gguf-py's warning about it not printed)
            w.split_max_size = 0
    wq_shards, wr_shards = plan_files(wq_w, wq_path), plan_files(wr_w, wr_path)
    shards = wq_shards + wr_shards
    finals = [sh.final for sh in shards]
    others = [p for p in _output_forms(out, base) if p not in finals]  # the other form: split, or not, or otherwise
    check_outputs(finals + others, force)
    items = parallel.make_items(conv, plan, shards, len(wq_shards))
    writer = parallel.ParallelWriter(conv, shards, items, journal_path(out, base), pair_id,
                                     threads or parallel.default_threads())
    existing = writer.existing()
    if existing and not resume:
        if not force:
            raise RapidMoEError(f"{existing[0]} is part of an unfinished conversion: pass --resume to continue it "
                                "or --force to start over")
        writer.discard()
    resuming = resume and bool(existing)
    if resume and not existing:
        log.info("resume: no unfinished conversion in %s; starting one", out)
    try:
        try:
            writer.open(resuming)
            writer.run(resuming, progress)
        finally:
            writer.files.close()
    except KeyboardInterrupt:
        raise parallel.Interrupted(_kept(writer, "interrupted")) from None
    except OSError as e:
        named = Path(e.filename) if isinstance(e.filename, (str, os.PathLike)) else None
        if named is not None and named not in writer.partials():
            raise
        raise OutputError(f"cannot write {_final_of(writer, named)}: {e.strerror or e}; "
                          f"{_kept(writer, 'stopped')}") from e
    conv.reports = writer.reports()
    for r in conv.reports:
        conv.totals.merge(r.acc)
    wq_parts, wr_parts = [sh.partial for sh in wq_shards], [sh.partial for sh in wr_shards]
    sidecar.stamp(GGUFFile(wr_parts[0], wr_parts), GGUFFile(wq_parts[0], wq_parts))
    report = _report(conv, conv.src, conv.preset, conv.imatrix, pair_id, time.perf_counter() - t0, wq_parts,
                     wr_parts)
    report["threads"] = writer.threads
    report["files"]["wq"] = [str(sh.final) for sh in wq_shards]  # type: ignore[index]
    report["files"]["wr"] = [str(sh.final) for sh in wr_shards]  # type: ignore[index]
    rep_part = report_path.with_name(report_path.name + ".partial")
    rep_part.write_text(json.dumps(report, indent=1))
    replace_all([(sh.partial, sh.final) for sh in shards] + [(rep_part, report_path)])
    writer.journal.unlink(missing_ok=True)
    for p in others:  # --force: the previous conversion's outputs of the other form
        p.unlink(missing_ok=True)
    return report


def _output_forms(out: Path, base: str) -> list[Path]:
    """Existing outputs of a conversion named `base`, in one file or split (any count)."""
    found = [p for p in output_paths(out, base)[:2] if p.exists()]
    five = "[0-9]" * 5
    for role in ("wq", "wr"):
        found += sorted(out.glob(f"{glob.escape(base)}.{role}-{five}-of-{five}.gguf"))
    return found


def _final_of(writer: Any, named: Path | None) -> str:
    for sh in writer.shards:
        if named == sh.partial:
            return str(sh.final)
    return ", ".join(str(sh.final) for sh in writer.shards)


def _kept(writer: Any, what: str) -> str:
    """What an unfinished conversion leaves: its partial files when it finished some items, else nothing."""
    done = len(writer.stats)
    if done == 0:
        writer.discard()
        return "nothing was kept"
    return (f"{what} after {done} of {len(writer.items)} parts; they are kept in {writer.shards[0].partial} (and the "
            f"other .partial files beside it, with {writer.journal.name}): the same command with --resume continues, "
            "--force starts over")
