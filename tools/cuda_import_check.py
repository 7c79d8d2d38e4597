"""Import check of a build of RapidMoE installed in a folder of its own (tools/cuda_build_check.sh step 5).

Imports rapidmoe from SITE (--site, or $RAPIDMOE_CUDA_SITE: the CUDA build installed next to the Python sources)
ahead of whatever install this interpreter has -- a normal one in site-packages, an editable one (its import hook is
set aside), or none -- and checks: the backend's library (libggml-cuda.so) is loaded from SITE, ggml registers the
backend (with no device on a machine without a GPU, the GPUs where there are some), and a greedy run on the default
model with every layer on the CPU gives the same logits as this interpreter's own install (CPU-only) in a separate
process. That process gets SITE nowhere: no PYTHONPATH, and a sys.path computed here (this one's, less SITE). When the
interpreter has no install of its own the comparison is skipped, and the summary line says so; any other failure of
the reference run fails the check. `--expect-backend CPU` runs every step on a CPU-only build in SITE instead (the
stand-in tests/ci/test_gpu_check.py uses: the same sys.path logic without a CUDA build). `use_site` is also what
bench/gpu_check.py --site calls. Prints one summary line last; --json writes the details.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

PROMPT = "Once upon a time"


def under(path: str | os.PathLike[str], site: Path) -> bool:
    """Whether path is site or inside it (both resolved: symlinks and relative entries compare as what they are)."""
    p = Path(path or ".").resolve()
    return p == site or site in p.parents


def use_site(site: Path) -> None:
    """Make `import rapidmoe` find the package in site first: an editable install's import hook (which answers
    before sys.path is searched) is removed, site goes first on sys.path; nothing else is dropped, so the
    interpreter's own packages (numpy, ... in the same site-packages as a normal install of rapidmoe) stay."""
    site = site.resolve()
    if not (site / "rapidmoe" / "__init__.py").is_file():
        raise SystemExit(f"{site} holds no rapidmoe package (expected {site}/rapidmoe/__init__.py)")
    if "rapidmoe" in sys.modules:
        raise SystemExit(f"rapidmoe was imported before use_site({site}), from {sys.modules['rapidmoe'].__file__}")
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not ("editable" in type(f).__module__ and "rapidmoe" in type(f).__module__)]
    sys.path[:] = [str(site)] + [p for p in sys.path if not under(p, site)]
    importlib.invalidate_caches()


def reference_command(site: Path, sys_path: list[str]) -> tuple[list[str], dict[str, str]]:
    """The reference child's command line and environment: this interpreter, sys_path less site, no PYTHONPATH,
    site out of LD_LIBRARY_PATH too."""
    path = [p for p in sys_path if p and not under(p, site)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAPIDMOE_CUDA_SITE")}
    if "LD_LIBRARY_PATH" in env:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in env["LD_LIBRARY_PATH"].split(os.pathsep)
                                                 if p and not under(p, site))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--reference-child", "--site", str(site),
           "--sys-path", json.dumps(path)]
    return cmd, env


def _logits(n_gpu_layers: int) -> dict[str, object]:
    import numpy as np  # noqa: PLC0415 - imported after use_site() / the reference child's sys.path is set

    import rapidmoe  # noqa: PLC0415 - imported after use_site() / the reference child's sys.path is set
    from rapidmoe.default_model import ensure_default_model  # noqa: PLC0415 - imported after use_site() / the reference child's sys.path is set

    llm = rapidmoe.Llama(str(ensure_default_model(progress=False)), n_ctx=128, n_gpu_layers=n_gpu_layers,
                         logits_all=True, verbose=False)
    toks = llm.tokenize(PROMPT.encode())
    llm.eval(toks)
    scores = np.asarray(llm.scores[: len(toks)], dtype=np.float32)
    llm.close()
    return {"module": rapidmoe.__file__, "tokens": toks, "logits": scores.tolist()}


def reference_child(site: Path, sys_path: list[str]) -> int:
    """In the child: the CPU-only install's logits, or {"missing": why} when this interpreter has none."""
    sys.path[:] = sys_path
    importlib.invalidate_caches()
    spec = importlib.util.find_spec("rapidmoe")
    if spec is None or spec.origin in (None, "namespace"):  # none, or a bare folder (an uninstall's leftovers)
        print(json.dumps({"missing": f"{sys.executable} has no install of rapidmoe outside {site}"}))
        return 0
    if under(spec.origin, site):
        print(json.dumps({"error": f"the reference run found the build under test ({spec.origin})"}))
        return 1
    print(json.dumps(_logits(0)))
    return 0


def check_backend(name: str) -> dict[str, Any]:
    """The backend `name` is loaded from this rapidmoe's library folder and registered, its devices listed."""
    from rapidmoe._runtime import LIB_DIR, _core  # noqa: PLC0415 - imported after use_site() / the reference child's sys.path is set

    lib = f"libggml-{name.lower()}.so"
    maps = Path("/proc/self/maps").read_text()
    # the mapped file is the soname's target (libggml-cuda.so.0.25.3, say), not the link named libggml-cuda.so
    mapped = sorted({line.split()[-1] for line in maps.splitlines() if Path(line.split()[-1]).name.startswith(lib)})
    if not mapped or not all(Path(p).resolve().parent == LIB_DIR.resolve() for p in mapped):
        raise SystemExit(f"{lib} from {LIB_DIR} is not loaded (mapped: {mapped})")
    devices = [{"name": n, "description": d, "type": t, "backend": r} for n, d, t, r, _ in _core.devices()]
    ours = [d for d in devices if d["backend"] == name]
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
    if name not in backends:
        raise SystemExit(f"ggml has no {name} backend registered (backends: {backends})")
    if backends[name] != len(ours):
        raise SystemExit(f"{name} registry has {backends[name]} devices, the device list {len(ours)}")
    return {"library": mapped[0], "backends": backends, "devices": devices, "backend_devices": ours}


def compare_with_reference(site: Path, sys_path: list[str], ours: dict[str, Any]) -> dict[str, Any]:
    """Run the reference child; {"skipped": why} without a CPU-only install, else the comparison (SystemExit when
    the child fails or imported the build under test)."""
    import numpy as np  # noqa: PLC0415 - imported after use_site() / the reference child's sys.path is set

    cmd, env = reference_command(site, sys_path)
    child = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    last = (child.stdout.strip().splitlines() or [""])[-1]
    if child.returncode != 0:
        why = last if last.startswith("{") else (child.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"the reference run (this interpreter's own rapidmoe) failed: {why}")
    ref = json.loads(last)
    if "missing" in ref:
        return {"skipped": ref["missing"]}
    if under(ref["module"], site):
        raise SystemExit(f"the reference run imported the build under test too ({ref['module']})")
    a, b = np.asarray(ours["logits"]), np.asarray(ref["logits"])
    same_shape = ours["tokens"] == ref["tokens"] and a.shape == b.shape
    return {"module": ref["module"], "max_abs_diff": float(np.max(np.abs(a - b))) if same_shape else None,
            "equal": same_shape and bool(np.array_equal(a, b))}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--site", type=Path, default=os.environ.get("RAPIDMOE_CUDA_SITE"),
                    help="the install prefix of the build to check (default: $RAPIDMOE_CUDA_SITE)")
    ap.add_argument("--expect-backend", default="CUDA",
                    help="the ggml backend the build must load and register (CPU: a CPU-only build as stand-in)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reference-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sys-path", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.site is None:
        ap.error("--site (or $RAPIDMOE_CUDA_SITE) is required")
    site = Path(args.site).resolve()
    if args.reference_child:
        return reference_child(site, json.loads(args.sys_path))

    own_sys_path = list(sys.path)  # before use_site: what the reference child starts from
    use_site(site)
    import rapidmoe  # noqa: PLC0415 - imported after use_site() / the reference child's sys.path is set

    where = Path(rapidmoe.__file__ or "?").resolve()
    if not under(where, site):
        raise SystemExit(f"imported rapidmoe from {where}, not from the build in {site}")
    backend = check_backend(args.expect_backend)
    out: dict[str, Any] = {"module": str(where), "expect_backend": args.expect_backend, **backend}
    ours = _logits(0)
    ref = compare_with_reference(site, own_sys_path, ours)
    out["reference"] = ref
    if args.json:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(args.json)
    if ref.get("equal") is False:
        print(f"CPU logits of the build in {site} differ from the CPU-only install: {ref}")
        return 1
    devs = backend["backend_devices"]
    print(f"import OK from {where.parent}; backends {backend['backends']}; {args.expect_backend} devices: {len(devs)}"
          + (f" ({', '.join(str(d['description']) for d in devs)})" if devs else "") + "; CPU logits "
          + (f"equal to the CPU-only install ({ref['module']})" if "equal" in ref
             else f"computed, comparison skipped: {ref['skipped']}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
