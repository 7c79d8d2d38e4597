"""Machine profiles: the hardware numbers the cost model (cost.py) prices a placement with.

A profile is a small frozen dataclass, loadable from JSON (`load_machine(path)`) so a measured machine can replace
the built-in ones. The built-in profiles are datasheet figures with assumed efficiencies, not measurements: each
says where its numbers come from. They exist so that plans and the cache simulator can project tok/s for
machines we do not have; every number they give is a projection.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import RapidMoEError
from .units import parse_size

GB = 1e9


class MachineError(RapidMoEError, ValueError):
    """A machine profile that cannot be read or has impossible values."""


@dataclass(frozen=True)
class MachineProfile:
    name: str
    gpu_mem: int  # bytes of GPU memory
    gpu_bw: float  # bytes/s the GPU's kernels read from its memory (effective, not peak)
    gpu_flops: float  # FLOP/s of the GPU's quantized matmul kernels (effective)
    pcie_bw: float  # bytes/s host -> device copies (pinned memory, effective)
    cpu_bw: float  # bytes/s the CPU's matmul kernels read from DRAM (effective)
    cpu_flops: float  # FLOP/s of the CPU's quantized matmul kernels on all cores (effective)
    cpu_cores: int
    sync_s: float = 30e-6  # one CPU <-> GPU hand-over (kernel launch, small activation copy, event wait)
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("gpu_bw", "gpu_flops", "pcie_bw", "cpu_bw", "cpu_flops"):
            if not getattr(self, f) > 0:
                raise MachineError(f"machine {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        if self.gpu_mem < 0 or self.cpu_cores < 1 or self.sync_s < 0:
            raise MachineError(f"machine {self.name!r}: gpu_mem >= 0, cpu_cores >= 1 and sync_s >= 0 are needed")

    def with_gpu_mem(self, gpu_mem: int) -> MachineProfile:
        return MachineProfile(**{**asdict(self), "gpu_mem": gpu_mem})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any], origin: str = "profile") -> MachineProfile:
        names = {f.name for f in fields(MachineProfile)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise MachineError(f"{origin}: unknown machine fields {', '.join(unknown)} "
                               f"(known: {', '.join(sorted(names))})")
        required = [f.name for f in fields(MachineProfile) if f.name not in ("sync_s", "source", "name")]
        missing = [n for n in required if n not in d]
        if missing:
            raise MachineError(f"{origin}: machine profile lacks {', '.join(missing)}")
        d = dict(d)
        d.setdefault("name", origin)
        if isinstance(d["gpu_mem"], str):
            d["gpu_mem"] = parse_size(d["gpu_mem"])
        try:
            return MachineProfile(**d)
        except TypeError as e:
            raise MachineError(f"{origin}: {e}") from None


# The host: a one-socket server that can hold DeepSeek-V3's experts in DRAM (Intel Xeon 4th gen, 32 cores, 8 channels
# of DDR5-4800: 307 GB/s peak; llama.cpp's CPU matmuls reach roughly 60-70 % of peak in decode, assumed 200 GB/s).
# CPU quantized-matmul throughput in prefill: assumed 1.5 TFLOP/s on 32 cores (AVX-512 VNNI kernels, not AMX).
_HOST = {"cpu_bw": 200 * GB, "cpu_flops": 1.5e12, "cpu_cores": 32}
# PCIe 4.0 x16: 32 GB/s per direction on paper, ~25 GB/s for pinned host-to-device copies (assumed). RapidMoE's
# paper (section 2.2) quotes 12.3 ms for 8 DeepSeek-V3 experts over PCIe 4.0, i.e. ~29 GB/s at 8 bits per weight.
_PCIE4 = 25 * GB

MACHINES: dict[str, MachineProfile] = {
    "24gb": MachineProfile(
        name="24gb", gpu_mem=24 << 30, gpu_bw=0.8 * 1008 * GB, gpu_flops=100e12, pcie_bw=_PCIE4, sync_s=30e-6,
        source="RTX 4090 datasheet (24 GiB, 1008 GB/s, 165 TFLOP/s FP16 dense) at an assumed 80 % of bandwidth and "
               "100 TFLOP/s for quantized matmuls; PCIe 4.0 x16 at 25 GB/s; host: 32-core Xeon, 8x DDR5-4800 at "
               "200 GB/s effective (assumed)", **_HOST),  # type: ignore[arg-type]
    "48gb": MachineProfile(
        name="48gb", gpu_mem=48 << 30, gpu_bw=0.8 * 960 * GB, gpu_flops=100e12, pcie_bw=_PCIE4, sync_s=30e-6,
        source="RTX 6000 Ada datasheet (48 GiB, 960 GB/s, 182 TFLOP/s FP16 dense) at an assumed 80 % of bandwidth and "
               "100 TFLOP/s for quantized matmuls; PCIe 4.0 x16 at 25 GB/s; host as 24gb", **_HOST),  # type: ignore[arg-type]
}


def load_machine(spec: str | os.PathLike[str]) -> MachineProfile:
    """A built-in profile by name (24gb, 48gb) or a JSON file of MachineProfile fields (gpu_mem may be "24GiB")."""
    key = os.fspath(spec)
    if key.lower() in MACHINES:
        return MACHINES[key.lower()]
    p = Path(key)
    if not p.is_file():
        raise MachineError(f"unknown machine {key!r}: give a JSON profile file or one of {', '.join(MACHINES)}")
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise MachineError(f"cannot read machine profile {p}: {e}") from None
    if not isinstance(d, dict):
        raise MachineError(f"{p}: a machine profile is a JSON object")
    return MachineProfile.from_dict(d, origin=str(p))
