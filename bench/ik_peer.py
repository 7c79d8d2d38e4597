"""ik_llama.cpp as a benchmark peer: locate (or build once) its llama-bench, run it with run-time repacking.

ik_llama.cpp (github.com/ikawrakow/ik_llama.cpp, a llama.cpp fork with its own CPU kernels) is the engine CPU users
who care about speed run. It is never part of this repository: clone it yourself, outside the tree, e.g.

    git clone https://github.com/ikawrakow/ik_llama.cpp ~/ik_llama.cpp && git -C ~/ik_llama.cpp checkout <IK_COMMIT>

and pass the checkout (built here once, into <checkout>/build-rapidmoe-bench, ~30-60 min on 2 cores) or an
existing build folder (one with bin/llama-bench) to `bench_frontier.py --ik`. From a bare git mirror (no work tree),
`python bench/ik_peer.py --export MIRROR.git DEST [--commit C]` writes the commit's files to DEST (leaving out blobs
the mirror lacks: web UI pages and vocab files, which the benchmark tools do not build) and the commit to
DEST/.ik-commit, where the builds' commit is read from. Its speed is measured by its own
llama-bench with `-rtr 1` (run-time repacking into its interleaved layouts) and the same threads, prompt and
decode lengths as ours; its KL is the file's under stock llama.cpp (`-rtr` reorders the same weights; only the
activations' rounding can differ).
"""
from __future__ import annotations

import argparse
import io
import json
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

# The commit the published ik numbers were measured at (ik_llama.cpp main of 2026-08-15, "Fix Qwen35+ MTP (#2322)")
IK_COMMIT = "8337e4cd3"


@dataclass(frozen=True)
class IkBuild:
    bench: Path  # its llama-bench
    commit: str  # the source's commit ("unknown" for a build folder given without its source)


def locate_or_build(path: Path, jobs: int = 2) -> IkBuild:
    """The llama-bench of an ik_llama.cpp build folder, or of a source checkout built here once (cached)."""
    path = path.expanduser().resolve()
    for cand in (path / "bin" / "llama-bench", path / "build-rapidmoe-bench" / "bin" / "llama-bench"):
        if cand.exists():
            return IkBuild(cand, _commit(_source_of(cand.parent.parent)))
    if not (path / "CMakeLists.txt").exists() or not (path / "ggml" / "src" / "iqk").is_dir():
        raise SystemExit(f"--ik {path}: neither an ik_llama.cpp build (bin/llama-bench) nor its source checkout "
                         f"(ggml/src/iqk/); see bench/ik_peer.py for how to get it")
    build = path / "build-rapidmoe-bench"
    subprocess.run(["cmake", "-S", str(path), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF", "-DGGML_CUDA=OFF"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "-j", str(jobs), "--target", "llama-bench", "llama-quantize",
                    "llama-perplexity"], check=True, stdout=subprocess.DEVNULL)
    return IkBuild(build / "bin" / "llama-bench", _commit(path))


def tool(ik: IkBuild, name: str) -> Path:
    """Another program of the same ik build (llama-quantize for its own types, llama-perplexity for their KL)."""
    exe = ik.bench.parent / name
    if not exe.exists():
        raise SystemExit(f"{exe} is missing: build it (cmake --build {ik.bench.parent.parent} --target {name})")
    return exe


def export_source(mirror: Path, dest: Path, commit: str = IK_COMMIT) -> None:
    """The files of `commit` in a bare git mirror written to dest (blobs the mirror lacks left out), and the commit
    to dest/.ik-commit."""
    git = ["git", f"--git-dir={mirror}"]
    tree = subprocess.run([*git, "ls-tree", "-r", commit], capture_output=True, text=True, check=True).stdout
    blobs = [line.split(None, 3) for line in tree.splitlines()]
    check = subprocess.run([*git, "cat-file", "--batch-check"], input="\n".join(b[2] for b in blobs),
                           capture_output=True, text=True, check=True).stdout
    missing = {line.split()[0] for line in check.splitlines() if line.endswith(" missing")}
    excluded = [f":(exclude){b[3]}" for b in blobs if b[2] in missing]
    archive = subprocess.run([*git, "archive", commit, "--", ".", *excluded], capture_output=True, check=True).stdout
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    full = subprocess.run([*git, "rev-parse", commit], capture_output=True, text=True, check=True).stdout.strip()
    (dest / ".ik-commit").write_text(full + "\n")
    print(f"{dest}: {commit} ({len(blobs) - len(missing)} files; left out, absent from the mirror: "
          f"{', '.join(b[3] for b in blobs if b[2] in missing) or 'none'})")


def _source_of(build: Path) -> Path:
    """The source folder a CMake build folder was configured from (CMakeCache.txt), else the folder above it."""
    cache = build / "CMakeCache.txt"
    if cache.exists():
        for line in cache.read_text(errors="replace").splitlines():
            if line.startswith("CMAKE_HOME_DIRECTORY:"):
                return Path(line.split("=", 1)[1])
    return build.parent


def _commit(src: Path) -> str:
    """The source's commit: the .ik-commit export_source wrote, or HEAD of a git checkout rooted at src (a source
    exported into another repository's tree, e.g. build/ik-src here, must not report that repository's HEAD)."""
    exported = src / ".ik-commit"
    if exported.exists():
        return exported.read_text().strip()[:9]
    top = subprocess.run(["git", "-C", str(src), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != src.resolve():
        return "unknown"
    out = subprocess.run(["git", "-C", str(src), "rev-parse", "--short=9", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def llama_bench(ik: IkBuild, model: Path, pp: int, tg: int, threads: int = 2, depth: int = 0,
                extra: list[str] | None = None) -> dict[str, float]:
    """ik's llama-bench with run-time repacking: prefill tokens/s (pp tokens) and decode tokens/s (tg tokens; after
    a context of `depth` tokens when given: its -gp DEPTH,TG test, which times the tg part alone); `extra`: more of
    its flags (e.g. ["-fmoe", "0"]: its fused MoE up/gate op off)."""
    if not depth:
        return run_llama_bench(ik.bench, model, pp, tg, threads, ["-rtr", "1", *(extra or [])])
    return run_llama_bench(ik.bench, model, pp, 0, threads, ["-rtr", "1", "-gp", f"{depth},{tg}", *(extra or [])])


def run_llama_bench(exe: Path, model: Path, pp: int, tg: int, threads: int = 2,
                    extra: list[str] | None = None) -> dict[str, float]:
    """One llama-bench run (one repetition of pp and of tg): {"pp_tps", "tg_tps"}."""
    cmd = [str(exe), "-m", str(model), "-t", str(threads), "-p", str(pp), "-n", str(tg), "-r", "1", *(extra or []),
           "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-2000:]}")
    return parse_bench_json(out.stdout)


def parse_bench_json(text: str) -> dict[str, float]:
    """llama-bench's JSON (a list of tests: n_prompt, n_gen, avg_ts) as {"pp_tps", "tg_tps"}."""
    tests = json.loads(text[text.index("["):])
    res: dict[str, float] = {}
    for t in tests:
        if t.get("n_prompt", 0) > 0 and t.get("n_gen", 0) == 0:
            res["pp_tps"] = float(t["avg_ts"])
        elif t.get("n_gen", 0) > 0:  # tgN, or ik's tgN@ppM (-gp: the tg part's rate after an M-token context)
            res["tg_tps"] = float(t["avg_ts"])
    if set(res) != {"pp_tps", "tg_tps"}:
        raise RuntimeError(f"llama-bench gave no pp and tg result: {text[:500]}")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description="Write ik_llama.cpp's source from a bare git mirror (see the module doc)")
    ap.add_argument("--export", nargs=2, type=Path, metavar=("MIRROR", "DEST"), required=True)
    ap.add_argument("--commit", default=IK_COMMIT)
    args = ap.parse_args()
    export_source(args.export[0], args.export[1], args.commit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
