"""The Python readers as fuzz targets: each reads a file the way its command uses it, and a problem with the file
must be a RapidMoEError (printed as the CLI prints it: one `rapidmoe-cli: error:` line, exit 1); any other exception
is a finding (its traceback ends the process, as it would end the CLI's).

Kinds: imatrix (convert --imatrix), frequency (--freq: .json/.npy tables or a GGUF imatrix), policy (--policy), trace
(rapidmoe.trace.read_trace), gguf (rapidmoe.modelfile's header checks, which every command runs first), llama-load
(llama.cpp's loader alone: the `upstream` target).
"""
from __future__ import annotations

import sys
from collections.abc import Callable

from rapidmoe.errors import RapidMoEError

# the shapes of the default model (tiny qwen3moe): 2 MoE layers of 8 experts, top-4, rows of 256
N_LAYER, N_EXPERT, K, N_IN = 2, 8, 4, 256


def read_imatrix(path: str) -> None:
    from rapidmoe.resplit.imatrix import read_imatrix as read  # noqa: PLC0415

    im = read(path)
    for name in list(im.in_sum2)[:64]:
        im.weights_for(name, N_EXPERT, N_IN)


def read_frequency(path: str) -> None:
    from rapidmoe.placement.frequency import load_frequency  # noqa: PLC0415

    f = load_frequency(path, list(range(N_LAYER)), N_LAYER, N_EXPERT)
    f.for_model(list(range(N_LAYER)), N_EXPERT)


def read_policy(path: str) -> None:
    from rapidmoe.umia.policy import load_policy  # noqa: PLC0415

    p = load_policy(path)
    p.thresholds(N_LAYER)
    p.to_array(N_LAYER, list(range(N_LAYER)), K)
    p.describe()


def read_trace(path: str) -> None:
    from rapidmoe.trace import read_trace as read  # noqa: PLC0415

    t = read(path)
    t.token_matrix()
    t.counts()
    for m in range(t.header.n_moe):
        t.layer_ids(m)
        t.layer_weights(m)


def read_gguf(path: str) -> None:
    from rapidmoe.modelfile import generation_problem, read_model_info  # noqa: PLC0415

    read_model_info(path)
    generation_problem(path)


def llama_load(path: str) -> None:
    """llama.cpp's own loader on the file, none of rapidmoe's checks first (the `upstream` target: which of its
    asserts a file's contents reach), with fd 2 silenced as llama-cpp-python's Llama silences it."""
    from rapidmoe._llama_cpp._utils import suppress_stdout_stderr  # noqa: PLC0415

    from rapidmoe._runtime import llama_cpp  # noqa: PLC0415
    from rapidmoe.errors import ModelFileError  # noqa: PLC0415

    params = llama_cpp.llama_model_default_params()
    with suppress_stdout_stderr(disable=False):
        model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise ModelFileError(f"llama.cpp could not load {path}")
    llama_cpp.llama_model_free(model)


def exec_file(path: str) -> None:
    """The file's Python run in the case's process: the harness's own tests give it programs of known outcome."""
    exec(compile(open(path).read(), path, "exec"), {"__name__": "__fuzz_exec__"})


READERS: dict[str, Callable[[str], None]] = {"imatrix": read_imatrix, "frequency": read_frequency,
                                             "policy": read_policy, "trace": read_trace, "gguf": read_gguf,
                                             "llama-load": llama_load, "exec": exec_file}


def run_reader(kind: str, path: str) -> int:
    """Exit status of reading `path` with reader `kind`: 0, or 1 with the CLI's one error line; anything else
    raises (a traceback)."""
    try:
        READERS[kind](path)
    except RapidMoEError as e:
        print(f"rapidmoe-cli: error: {e}", file=sys.stderr)
        return 1
    return 0
