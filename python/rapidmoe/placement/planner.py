"""The placement planner: which parts of an MoE model go to the GPU and which to the CPU under memory budgets.

  [shapes + types] -> Footprint -> [resident parts on the GPU] -> [WQ expert cache: hottest experts first]
                                -> [sidecar, misses, token embeddings in DRAM] -> Plan (+ the `run` flags)

Schemes: `resplit` (the paper's: every WQ on the GPU if it fits, else a per-layer cache of the most frequently
routed experts' WQ with misses run on the CPU from DRAM; WR sidecar always in DRAM), and the baselines with a
Q4_K_M-like all-Q4 model: `cpu-offload` (llama.cpp --n-cpu-moe / -ot exps=CPU: experts in DRAM, the rest on the
GPU) and `full-gpu` (everything on the GPU). Numbers only; nothing here loads a model or touches a device.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import RapidMoEError
from ..resplit.codecs import codec_of
from ..resplit.presets import Preset
from .footprint import Footprint, footprint
from .frequency import ExpertFrequency
from .tensors import EMBEDDINGS, PARTS, ROUTED, ModelShapes
from .typeplan import native_types, q4_k_m_types, resplit_types
from .units import format_size

log = logging.getLogger(__name__)

GPU, CPU = "GPU", "CPU"
SCHEMES = ("resplit", "cpu-offload", "full-gpu")
DEFAULT_RESERVE = 1 << 30  # GPU memory left for llama.cpp's compute buffers and the CUDA context (an estimate)
# host memory llama.cpp and llama-cpp-python hold besides the weights once a model is loaded, per vocabulary entry:
# the tokenizer's tables (tokens, merges, maps). Measured 620-700 B per token on the 32k and 50k vocabularies of the
# synthetic models (tests/placement/test_resident_memory.py); the process itself (Python, libraries) is not counted
RUNTIME_BYTES_PER_TOKEN = 700
NOT_EXPRESSIBLE = ("per-expert caching inside one stacked ffn_*_exps tensor cannot be expressed with -ot or "
                   "--n-cpu-moe today; the flags keep whole layers' experts on the GPU instead")


class PlanError(RapidMoEError, ValueError):
    """Arguments the planner cannot work with (unknown scheme, negative budgets, missing preset)."""


@dataclass(frozen=True)
class Row:
    part: str
    device: str  # GPU or CPU
    bytes: int
    detail: str = ""


@dataclass(frozen=True)
class Realization:
    """How `rapidmoe-cli run` realizes a plan today."""

    args: tuple[str, ...]  # placement flags for `run` (and for stock llama.cpp where they coincide)
    hit_rate: float  # GPU hit rate of the placement these flags give
    exact: bool  # False: the planned per-expert cache is coarsened to whole layers
    note: str = ""


@dataclass(frozen=True)
class Plan:
    model: str
    scheme: str  # resplit, cpu-offload, full-gpu (resplit without a usable GPU: cpu-only)
    types: str  # the type mixture, in words
    n_ctx: int
    gpu_mem: int | None  # budgets in bytes; None: unbounded (the plan says what is needed)
    cpu_mem: int | None
    rows: tuple[Row, ...]
    n_moe_layers: int
    n_expert: int
    experts_on_gpu: int  # (layer, expert) pairs whose main-form weights are GPU-resident
    hit_rate: float  # share of routed expert slots (frequency-weighted) served from GPU-resident weights
    cached: dict[int, tuple[int, ...]]  # MoE layer -> experts whose weights are on the GPU
    problems: tuple[str, ...]  # why it does not fit; empty when it does
    realization: Realization
    frequency_source: str = "uniform"
    notes: tuple[str, ...] = field(default_factory=tuple)
    # of `dram`, the bytes the CPU uses in place from the mapped .gguf files (file-backed pages: token embeddings,
    # norms, anything it does not repack, the refine codec's bit planes); the rest is anonymous memory
    dram_file: int = 0
    # realized with the per-expert WQ cache (realize.py: every stacked expert tensor stays whole in host memory, in
    # the plain layout, as does the sidecar): host bytes and, of them, file-backed ones; 0 when the plan has no cache
    cache_dram: int = 0
    cache_dram_file: int = 0
    runtime: int = 0  # host memory besides weights and KV cache once loaded: the tokenizer (an estimate)

    @property
    def vram(self) -> int:
        return sum(r.bytes for r in self.rows if r.device == GPU)

    @property
    def dram(self) -> int:
        return sum(r.bytes for r in self.rows if r.device == CPU)

    @property
    def dram_anon(self) -> int:
        return self.dram - self.dram_file

    @property
    def resident(self) -> int:
        """The process's host memory after load (RSS, beyond the process itself), as the flags realize the plan."""
        return self.dram + self.runtime

    @property
    def resident_cached(self) -> int:
        """The same when the per-expert cache realizes the plan (0: the plan has none)."""
        return self.cache_dram + self.runtime if self.cache_dram else 0

    @property
    def fits(self) -> bool:
        return not self.problems

    def device_bytes(self, device: str, part: str) -> int:
        return sum(r.bytes for r in self.rows if r.device == device and r.part == part)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["cached"] = {str(k): list(v) for k, v in self.cached.items()}
        d.update(vram=self.vram, dram=self.dram, dram_anon=self.dram_anon, resident=self.resident,
                 resident_cached=self.resident_cached, fits=self.fits)
        return d


def plan(model: ModelShapes, scheme: str = "resplit", *, preset: Preset | None = None, gpu_mem: int | None = None,
         cpu_mem: int | None = None, n_ctx: int = 4096, reserve: int = DEFAULT_RESERVE,
         frequency: ExpertFrequency | None = None, as_stored: bool = False) -> Plan:
    """Plan one scheme for `model` under the budgets (bytes). `preset` is required for resplit, unless `as_stored`.

    as_stored: size every tensor in the type the file stores it, for a file that is loaded as it is (`run
    --gpu-mem` on a .wq.gguf, or on any MoE GGUF without a sidecar); a preset then only sizes the sidecar, and
    None means there is none."""
    if scheme not in SCHEMES:
        raise PlanError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    for name, v in (("gpu_mem", gpu_mem), ("cpu_mem", cpu_mem), ("reserve", reserve)):
        if v is not None and v < 0:
            raise PlanError(f"{name} must be >= 0, got {v}")
    if n_ctx < 1:
        raise PlanError(f"n_ctx must be >= 1, got {n_ctx}")
    layers = model.moe_layers
    freq = (frequency or ExpertFrequency.uniform(layers, model.n_expert)).for_model(layers, model.n_expert)
    form = "WQ" if scheme == "resplit" else "Q4_K_M-like"
    if as_stored:
        sidecar = preset if scheme == "resplit" else None
        fp = footprint(model, native_types(model), sidecar)
        types = "as stored"
        if sidecar is not None:
            types += f", sidecar of preset {sidecar.name}: WR {sidecar.wr}, down {sidecar.down_mode} {sidecar.down_hi}"
            types += " (per layer and role as its mix gives)" if sidecar.mix else ""
        elif scheme == "resplit":
            types += ", no sidecar"
        form = "WQ" if sidecar is not None else "as stored"
    elif scheme == "resplit":
        if preset is None:
            raise PlanError("the resplit scheme needs a preset")
        fp = footprint(model, resplit_types(preset, model), preset)
        types = (f"preset {preset.name}: WQ {preset.wq}, WR {preset.wr}, down {preset.down_mode} "
                 f"{preset.down_hi}, other {preset.other}" + (" (experts per layer and role as its mix gives)"
                                                               if preset.mix else ""))
    else:
        fp = footprint(model, q4_k_m_types(model))
        types = "Q4_K_M-like: llama-quantize's Q4_K_M type rules"
    # a codec (the refine codec) that computes its critical slots on the CPU from the WQ experts themselves: they
    # stay in DRAM
    codec = codec_of(preset) if scheme == "resplit" and preset is not None else None
    cpu_experts = codec.title if codec is not None and codec.cpu_experts else None
    b = _Builder(model, fp, scheme, n_ctx, reserve, gpu_mem, freq, form, cpu_experts)
    return b.build(types, cpu_mem)


def plan_all(model: ModelShapes, preset: Preset, **kw: object) -> list[Plan]:
    """The RESplit plan and both baselines under the same budgets."""
    return [plan(model, s, preset=preset, **kw) for s in SCHEMES]  # type: ignore[arg-type]


@dataclass
class _Builder:
    model: ModelShapes
    fp: Footprint
    scheme: str
    n_ctx: int
    reserve: int
    gpu_mem: int | None
    freq: ExpertFrequency
    form: str = "WQ"  # what the routed experts' main form is called in the rows
    # every routed expert in DRAM whatever the GPU budget: the codec (its title) whose critical slots need them there
    cpu_experts: str | None = None

    def base_rows(self, device: str) -> list[Row]:
        """Everything but the routed experts and the sidecar: parts, KV cache, reserve. llama.cpp keeps the token
        embeddings (the input layer) on the CPU even with every layer offloaded."""
        rows = [Row(p, CPU if p == EMBEDDINGS else device, self.fp.parts[p]) for p in PARTS
                if p in self.fp.parts and p != ROUTED]
        rows.append(Row("KV cache", device, self.model.kv_cache_bytes(self.n_ctx), f"F16, {self.n_ctx} tokens"))
        if device == GPU:
            rows.append(Row("reserve", GPU, self.reserve, "compute buffers, CUDA context (estimate)"))
        return rows

    def build(self, types: str, cpu_mem: int | None) -> Plan:
        notes: list[str] = []
        rows = self.base_rows(GPU)
        base = sum(r.bytes for r in rows if r.device == GPU)
        cpu_only = self.scheme == "resplit" and self.gpu_mem is not None and self.gpu_mem < base
        if cpu_only:
            rows = self.base_rows(CPU)
            if self.gpu_mem:
                notes.append(f"the GPU budget is below the {format_size(base)} that the non-expert tensors, KV "
                             "cache and reserve need; planned CPU-only"
                             + (" (split routing runs on the CPU)" if self.fp.sidecar else ""))
            log.info("planner: GPU budget %s < base %d, CPU-only", self.gpu_mem, base)
            cached: dict[int, tuple[int, ...]] = {}
        elif self.scheme == "cpu-offload" or self.cpu_experts:
            cached = {}
            if self.cpu_experts:
                notes.append(f"{self.cpu_experts} computes its critical experts on the CPU from the WQ experts "
                             "themselves: every routed expert stays in DRAM")
        elif self.scheme == "full-gpu":
            cached = {il: tuple(range(self.model.n_expert)) for il in self.fp.expert_bytes}
        else:
            budget = None if self.gpu_mem is None else self.gpu_mem - base
            cached = self.choose_cache(budget)
        rows += self.expert_rows(cached)
        rows += [Row(label, CPU, n, "RESplit sidecar") for label, n in self.fp.sidecar.items()]
        n_cached = sum(len(v) for v in cached.values())
        hit = self.hit_rate(cached)
        real = self.realize(cached, hit, cpu_only, base)
        if not real.exact:
            notes.append(NOT_EXPRESSIBLE + f" (hit rate {real.hit_rate:.1%} instead of {hit:.1%})")
        scheme = "cpu-only" if cpu_only else self.scheme
        cache_dram, cache_file = self.cache_host(rows, cached) if cached and not real.exact else (0, 0)
        p = Plan(model=self.model.name, scheme=scheme, types=types, n_ctx=self.n_ctx, gpu_mem=self.gpu_mem,
                 cpu_mem=cpu_mem, rows=tuple(r for r in rows if r.bytes or r.part == "KV cache"),
                 n_moe_layers=len(self.fp.expert_bytes), n_expert=self.model.n_expert, experts_on_gpu=n_cached,
                 hit_rate=hit, cached=cached, problems=(), realization=real, frequency_source=self.freq.source,
                 notes=tuple(notes), dram_file=self.file_backed(rows, cached), cache_dram=cache_dram,
                 cache_dram_file=cache_file, runtime=RUNTIME_BYTES_PER_TOKEN * self.model.n_vocab)
        return _with_problems(p)

    def file_backed(self, rows: list[Row], cached: dict[int, tuple[int, ...]]) -> int:
        """Of the CPU rows, the bytes used in place from the mapped files (repacking on, as the flags load it)."""
        fp, n = self.fp, self.model.n_expert
        out = 0
        for r in rows:
            if r.device != CPU:
                continue
            if r.part in fp.in_place:
                out += fp.in_place[r.part]
            elif r.part in fp.sidecar_in_place:
                out += fp.sidecar_in_place[r.part]
        out += sum(eb * (n - len(cached.get(il, ()))) for il, eb in fp.expert_bytes.items()
                   if fp.experts_in_place.get(il, False))
        return out

    def cache_host(self, rows: list[Row], cached: dict[int, tuple[int, ...]]) -> tuple[int, int]:
        """Host bytes and file-backed bytes when the per-expert cache realizes the plan: the CPU rows plus the cached
        experts (the stacked tensors stay whole), every routed expert and the sidecar in the plain layout, in place."""
        fp = self.fp
        routed = fp.routed_bytes
        on_cpu = [r for r in rows if r.device == CPU and r.part != ROUTED]
        host = sum(r.bytes for r in on_cpu) + routed
        file = routed + sum(fp.in_place.get(r.part, 0) for r in on_cpu if r.part in fp.in_place)
        file += sum(fp.sidecar.values())  # the plain layout (repacking off under a cache): used in place
        return host, file

    def choose_cache(self, budget: int | None) -> dict[int, tuple[int, ...]]:
        """Greedy by routed share: the globally most-routed (layer, expert) pairs first, which maximises the hit
        rate for equal-sized experts; ties go to lower-ranked experts, then shallower layers, so a uniform table
        spreads the cache evenly over layers."""
        return greedy_cache(self.freq.share, self.fp.expert_bytes, self.model.n_expert, budget)

    def expert_rows(self, cached: dict[int, tuple[int, ...]]) -> list[Row]:
        eb, n_expert = self.fp.expert_bytes, self.model.n_expert
        on_gpu = sum(eb[il] * len(v) for il, v in cached.items())
        total = self.fp.routed_bytes
        form = self.form
        n_all = len(eb) * n_expert
        n_gpu = sum(len(v) for v in cached.values())
        return [Row(ROUTED, GPU, on_gpu, f"{form}, {n_gpu} of {n_all} experts"),
                Row(ROUTED, CPU, total - on_gpu,
                    f"{form}, {n_all - n_gpu} of {n_all} experts" + (", CPU-centric misses" if n_gpu else ""))]

    def hit_rate(self, cached: dict[int, tuple[int, ...]]) -> float:
        layers = list(self.fp.expert_bytes)
        if not layers:
            return 0.0
        return sum(float(self.freq.share[il][list(cached.get(il, ()))].sum()) for il in layers) / len(layers)

    def realize(self, cached: dict[int, tuple[int, ...]], hit: float, cpu_only: bool, base: int) -> Realization:
        n_layer, n_expert, eb = self.model.n_layer, self.model.n_expert, self.fp.expert_bytes
        ctx = ("-c", str(self.n_ctx))
        if cpu_only:
            return Realization(("-ngl", "0", *ctx), 0.0, True)
        if all(len(cached.get(il, ())) == n_expert for il in eb):
            return Realization(("-ngl", "999", *ctx), 1.0, True)
        if not cached:
            return Realization(("-ngl", "999", "--n-cpu-moe", str(n_layer), *ctx), 0.0, True,
                               "or -ot exps=CPU: every routed expert in DRAM")
        # whole layers, deepest first, as many as the planned cache's bytes allow (--n-cpu-moe N: layers < N on CPU)
        room = sum(eb[il] * len(v) for il, v in cached.items())
        first_gpu = n_layer
        for il in sorted(eb, reverse=True):
            if eb[il] * n_expert > room:
                break
            room -= eb[il] * n_expert
            first_gpu = il
        gpu_layers = [il for il in eb if il >= first_gpu]
        layer_hit = len(gpu_layers) / len(eb)
        return Realization(("-ngl", "999", "--n-cpu-moe", str(first_gpu), *ctx), layer_hit, False,
                           f"whole layers {first_gpu}-{n_layer - 1} on the GPU" if gpu_layers else
                           "no whole layer fits; every routed expert in DRAM")


def greedy_cache(share: dict[int, np.ndarray], expert_bytes: dict[int, int], n_expert: int,
                 budget: int | None) -> dict[int, tuple[int, ...]]:
    """The planner's static cache: (layer, expert) pairs by routed share, globally, while they fit in `budget` bytes
    (None: everything). Ties go to lower-ranked experts, then shallower layers."""
    eb = expert_bytes
    if budget is None or budget >= sum(eb.values()) * n_expert:
        return {il: tuple(range(n_expert)) for il in eb}
    order = []
    for il, sh in share.items():
        ranked = sorted(range(n_expert), key=lambda e: (-sh[e], e))
        order += [(-sh[e], rank, il, e) for rank, e in enumerate(ranked)]
    order.sort()
    chosen: dict[int, list[int]] = {}
    left = budget
    for _, _, il, e in order:
        if eb[il] <= left:
            chosen.setdefault(il, []).append(e)
            left -= eb[il]
    return {il: tuple(sorted(v)) for il, v in sorted(chosen.items())}


def _with_problems(p: Plan) -> Plan:
    problems = []
    if p.gpu_mem is not None and p.vram > p.gpu_mem:
        problems.append(f"needs {format_size(p.vram)} of GPU memory, the budget is {format_size(p.gpu_mem)}")
    if p.cpu_mem is not None and p.dram > p.cpu_mem:
        problems.append(f"needs {format_size(p.dram)} of CPU memory, the budget is {format_size(p.cpu_mem)}")
    return Plan(**{**p.__dict__, "problems": tuple(problems)})
