"""Coverage-guided fuzzing of the Python readers with atheris (libFuzzer for Python; `pip install atheris`):

    python tools/fuzz/atheris_readers.py KIND [CORPUS_DIR] [libFuzzer flags, e.g. -atheris_runs=50000]

KIND: imatrix, frequency, policy, trace or gguf (readers.py). The corpus starts from the structure-aware seeds
(targets.prepare_bases) and grows with the inputs that reach new lines of rapidmoe's reader modules, which are
instrumented. A RapidMoEError is the reader refusing the input (fine); any other exception stops the run and
libFuzzer writes the input to crash-<sha1>, which `--reader KIND FILE` through fuzz_run.py's harness reproduces.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TOOLS))

import atheris  # noqa: E402

import rapidmoe.ggufio  # noqa: E402
import rapidmoe.modelfile  # noqa: E402
import rapidmoe.placement.frequency  # noqa: E402
import rapidmoe.resplit.imatrix  # noqa: E402
import rapidmoe.trace  # noqa: E402
import rapidmoe.umia.policy  # noqa: E402, F401
from fuzz import readers  # noqa: E402
from rapidmoe.errors import RapidMoEError  # noqa: E402

# the editable install's import hook comes before atheris's, so instrument_imports() would see nothing: the loaded
# functions' bytecode is instrumented instead (every module loaded so far; the readers' among them)
atheris.instrument_all()


def seeds(kind: str, corpus: Path) -> None:
    """The structure-aware generator's valid inputs as the starting corpus."""
    from fuzz import mutate_misc  # noqa: PLC0415

    corpus.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="atheris-seed-"))
    import json  # noqa: PLC0415
    import random  # noqa: PLC0415

    if kind in ("imatrix", "frequency", "gguf"):
        (corpus / "seed-imatrix.gguf").write_bytes(mutate_misc.imatrix_seed(work / "i.gguf"))
        (corpus / "seed-legacy.dat").write_bytes(mutate_misc.legacy_imatrix_seed())
    if kind == "frequency":
        (corpus / "seed.json").write_text(json.dumps(mutate_misc.frequency_seed(random.Random(0))))
    if kind == "policy":
        (corpus / "seed.json").write_text(json.dumps(mutate_misc.policy_seed()))
    if kind == "trace":
        for p in (False, True):
            (corpus / f"seed-{p}.bin").write_bytes(mutate_misc.trace_seed(work / "t.bin", p))


def main() -> None:
    kind = sys.argv[1]
    read = readers.READERS[kind]
    named = len(sys.argv) > 2 and not sys.argv[2].startswith("-")
    corpus = Path(sys.argv[2]) if named else Path(f"build/fuzz/atheris-{kind}")
    seeds(kind, corpus)
    fd, name = tempfile.mkstemp(suffix=".json" if kind in ("policy", "frequency") else ".bin")
    os.close(fd)

    def one_input(data: bytes) -> None:
        with open(name, "wb") as f:
            f.write(data)
        try:
            read(name)
        except RapidMoEError:
            pass

    flags = [a for a in sys.argv[2:] if a.startswith("-")]
    atheris.Setup([sys.argv[0], *flags, str(corpus)], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
