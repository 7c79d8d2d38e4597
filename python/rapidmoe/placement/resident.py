"""Which host memory a loaded model's weights take: anonymous memory (a weight the CPU backend repacks is copied out
of the file into its own buffer; patch 0022 then releases the mapped pages it came from) or the file's pages (a
weight used in place from the mapped GGUF: token embeddings, norms, F32 routers, types or shapes the CPU does not
repack, everything when repacking is off, the refine codec's bit planes). Either way a weight is resident once.

The question per weight is the one llama.cpp's loader asks (does the CPU run its op with the weight in CPU_REPACK?),
answered by the compiled build for this CPU (rapidmoe._core.cpu_repacks); without the build, by llama.cpp's x86 rules
for this CPU's flags (/proc/cpuinfo), with our repack patches (0006 Q2_K, 0016 Q8_0, 0017 Q6_K, 0021 Q3_K).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from ..ggml_types import ggml_type
from .tensors import EMBEDDINGS, ROUTED, TensorShape

# (ggml type name, ggml shape, op "mul_mat" | "mul_mat_id", top-k) -> the CPU keeps it repacked
Repacks = Callable[[str, tuple[int, ...], str, int], bool]


def machine_repacks() -> Repacks:
    """This build's and CPU's rule (cached per question)."""
    try:
        from .._runtime import _core  # noqa: PLC0415  (the compiled part where built; planning works without it)
    except ImportError:
        return _x86_rule(_cpu_flags())

    @functools.lru_cache(maxsize=4096)
    def repacks(type_name: str, shape: tuple[int, ...], op: str, k: int) -> bool:
        return bool(_core.cpu_repacks(int(ggml_type(type_name)), list(shape), op, k))

    return repacks


def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return frozenset(line.split(":", 1)[-1].split())


def _x86_rule(flags: frozenset[str]) -> Repacks:
    """llama.cpp's x86 repack choices (ggml-cpu/repack.cpp's optimal type: rows in groups of 8, Q8_0 of 4) with our
    patches, for a CPU with these flags."""
    types = set()
    if "avx2" in flags:
        types |= {"Q4_0", "Q4_K", "IQ4_NL", "Q2_K", "Q8_0", "Q6_K"}
    if "avx512_vnni" in flags or "avx512vnni" in flags:
        types.add("Q3_K")

    def repacks(type_name: str, shape: tuple[int, ...], op: str, k: int) -> bool:
        del op, k
        rows = shape[1] if len(shape) > 1 else 1
        return type_name in types and rows % (4 if type_name == "Q8_0" else 8) == 0

    return repacks


def used_in_place(t: TensorShape, type_name: str, repacks: Repacks, n_expert_used: int, repack: bool = True) -> bool:
    """Whether the weight `t`, stored as `type_name`, stays in the mapped file when it lives in CPU memory."""
    if not repack or t.part == EMBEDDINGS or len(t.shape) < 2:  # token embeddings: GET_ROWS, never repacked
        return True
    return not repacks(type_name, tuple(t.shape), "mul_mat_id" if t.part == ROUTED else "mul_mat", n_expert_used)


def process_memory() -> tuple[int, int] | None:
    """This process's resident memory now: (anonymous, file-backed) bytes from /proc/self/status (RssAnon,
    RssFile; shared memory counts as anonymous); None where the system has no such file."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    kib = {k: int(v.split()[0]) for k, _, v in (x.partition(":") for x in lines)
           if k in ("RssAnon", "RssFile", "RssShmem")}
    if "RssAnon" not in kib or "RssFile" not in kib:
        return None
    return (kib["RssAnon"] + kib.get("RssShmem", 0)) * 1024, kib["RssFile"] * 1024
