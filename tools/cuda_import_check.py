"""Import check of a CUDA build of RapidMoE (tools/cuda_build_check.sh step 5).

Imports rapidmoe from $RAPIDMOE_CUDA_SITE (the CUDA build installed next to the Python sources), never from the
editable install, and checks: libggml-cuda.so is loaded, ggml lists the CUDA backend (with no device on a machine
without a GPU, and the GPUs where there are some), and a greedy run on the default model with every layer on the
CPU gives the same logits as the ordinary (CPU-only) install in a separate process, where one is importable.
Prints one summary line last; --json writes the details.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

PROMPT = "Once upon a time"


def _use_site(site: Path) -> None:
    """Make `import rapidmoe` find the package under site, ahead of an editable install's import hook."""
    sys.meta_path[:] = [f for f in sys.meta_path if "_editable_skbc_rapidmoe" not in type(f).__module__]
    sys.path[:] = [p for p in sys.path if not Path(p, "rapidmoe", "__init__.py").exists()]
    sys.path.insert(0, str(site))


def _logits(n_gpu_layers: int) -> dict[str, object]:
    import numpy as np

    import rapidmoe
    from rapidmoe.default_model import ensure_default_model

    llm = rapidmoe.Llama(str(ensure_default_model(progress=False)), n_ctx=128, n_gpu_layers=n_gpu_layers,
                         logits_all=True, verbose=False)
    toks = llm.tokenize(PROMPT.encode())
    llm.eval(toks)
    scores = np.asarray(llm.scores[: len(toks)], dtype=np.float32)
    return {"module": rapidmoe.__file__, "tokens": toks, "logits": scores.tolist()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reference-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reference_child:  # the ordinary install, CPU only
        print(json.dumps(_logits(0)))
        return 0

    site = Path(os.environ["RAPIDMOE_CUDA_SITE"]).resolve()
    _use_site(site)
    import numpy as np

    import rapidmoe
    from rapidmoe._runtime import LIB_DIR, _core

    where = Path(rapidmoe.__file__).resolve()
    if site not in where.parents:
        raise SystemExit(f"imported rapidmoe from {where}, not from the CUDA build in {site}")
    maps = Path("/proc/self/maps").read_text()
    # the mapped file is the soname's target (libggml-cuda.so.0.25.3, say), not the link named libggml-cuda.so
    cuda_lib = sorted({line.split()[-1] for line in maps.splitlines()
                       if Path(line.split()[-1]).name.startswith("libggml-cuda.so")})
    if not cuda_lib or not all(Path(p).resolve().parent == LIB_DIR.resolve() for p in cuda_lib):
        raise SystemExit(f"libggml-cuda.so from {LIB_DIR} is not loaded (mapped: {cuda_lib})")
    devices = [{"name": n, "description": d, "type": t, "backend": r} for n, d, t, r, _ in _core.devices()]
    cuda_devices = [d for d in devices if d["backend"] == "CUDA"]
    # ggml registers a backend with no device too (the device list then has none of it): ask its registry
    ggml = ctypes.CDLL(str(LIB_DIR / "libggml.so"))
    ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    ggml.ggml_backend_reg_get.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
    ggml.ggml_backend_reg_name.restype = ctypes.c_char_p
    ggml.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    regs = [ggml.ggml_backend_reg_get(i) for i in range(ggml.ggml_backend_reg_count())]
    backends = {ggml.ggml_backend_reg_name(r).decode(): int(ggml.ggml_backend_reg_dev_count(r)) for r in regs}
    if "CUDA" not in backends:
        raise SystemExit(f"ggml has no CUDA backend registered (backends: {backends})")
    if backends["CUDA"] != len(cuda_devices):
        raise SystemExit(f"CUDA registry has {backends['CUDA']} devices, the device list {len(cuda_devices)}")
    out: dict[str, object] = {"module": str(where), "libggml_cuda": cuda_lib[0], "backends": backends,
                              "devices": devices, "cuda_devices": len(cuda_devices)}

    ours = _logits(0)
    ref_ok: bool | None = None
    env = {k: v for k, v in os.environ.items() if k != "RAPIDMOE_CUDA_SITE"}
    child = subprocess.run([sys.executable, __file__, "--reference-child"], capture_output=True, text=True, env=env,
                           timeout=600)
    if child.returncode == 0:
        ref = json.loads(child.stdout.strip().splitlines()[-1])
        if Path(ref["module"]).resolve().parent == where.parent:
            raise SystemExit("the reference run imported the CUDA build too")
        a, b = np.asarray(ours["logits"]), np.asarray(ref["logits"])
        ref_ok = ours["tokens"] == ref["tokens"] and a.shape == b.shape and bool(np.array_equal(a, b))
        out["reference"] = {"module": ref["module"], "max_abs_diff": float(np.max(np.abs(a - b))) if a.shape == b.shape
                            else None, "equal": ref_ok}
    else:
        out["reference"] = {"error": (child.stderr.strip().splitlines() or ["?"])[-1]}
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(args.json)
    if ref_ok is False:
        print(f"CPU logits of the CUDA build differ from the CPU-only install: {out['reference']}")
        return 1
    print(f"import OK from {where.parent}; backends {backends}; CUDA devices: {len(cuda_devices)}"
          + (f" ({', '.join(str(d['description']) for d in cuda_devices)})" if cuda_devices else "")
          + "; CPU logits " + ("equal to the CPU-only install" if ref_ok else "computed (no CPU-only install to compare)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
