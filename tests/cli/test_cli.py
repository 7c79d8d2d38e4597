"""rapidmoe-cli: help on every command, `run` and `make-model` on good and bad inputs (one-line errors)."""
from __future__ import annotations

import importlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rapidmoe.cli import budget
from rapidmoe.cli.app import app
from rapidmoe.resplit import presets, read_sidecar_meta
from rapidmoe.resplit.presets import CPU_DEFAULT, CPU_FALLBACK, GPU_DEFAULT, default_preset

runner = CliRunner()


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["make-model", "--help"]])
def test_help(args: list[str]) -> None:
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "Usage" in res.output


@pytest.mark.native
def test_run_streams_and_reports_speed(tiny_qwen: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "rapidmoe.cli", "run", str(tiny_qwen), "-p", "Hello", "-n", "12",
                          "--temp", "0", "-t", "2"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Hello") and len(res.stdout) > len("Hello\n")
    assert "prefill:" in res.stderr and "tokens/s" in res.stderr
    assert "decode:  11 tokens" in res.stderr or "decode:  12 tokens" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.native
def test_run_without_model_uses_cached_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAPIDMOE_CACHE", str(tmp_path))
    res = runner.invoke(app, ["run", "-p", "Hi", "-n", "4", "--temp", "0"])
    assert res.exit_code == 0, res.output
    made = list(tmp_path.glob("synthetic-qwen3moe-tiny-*.gguf"))
    assert len(made) == 1
    before = made[0].stat().st_mtime_ns
    assert runner.invoke(app, ["run", "-p", "Hi", "-n", "2"]).exit_code == 0
    assert made[0].stat().st_mtime_ns == before  # cached, not rewritten


def _one_line_error(args: list[str]) -> str:
    res = subprocess.run([sys.executable, "-m", "rapidmoe.cli", *args], capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@pytest.mark.native
def test_run_bad_model_files(tmp_path: Path, tiny_qwen: Path, vocab_dir: Path) -> None:
    assert "model file not found" in _one_line_error(["run", str(tmp_path / "nope.gguf")])
    txt = tmp_path / "notes.txt"
    txt.write_text("hello")
    assert "not a GGUF file" in _one_line_error(["run", str(txt)])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_qwen.read_bytes()[:200_000])
    assert "truncated" in _one_line_error(["run", str(cut)])
    # a GGUF that is not an MoE model: llama.cpp's own vocab-only qwen2 file
    assert "dense qwen2 model" in _one_line_error(["run", str(vocab_dir / "ggml-vocab-qwen2.gguf")])


@pytest.mark.native
def test_run_bad_flags(tiny_qwen: Path) -> None:
    assert "does not fit in --ctx-size" in _one_line_error(["run", str(tiny_qwen), "-n", "100", "-c", "64"])
    assert "exceed --ctx-size" in _one_line_error(["run", str(tiny_qwen), "-n", "40", "-c", "64",
                                                   "-p", "word " * 40])
    assert "unknown buffer type" in _one_line_error(["run", str(tiny_qwen), "-ot", "exps=GPU9"])
    res = runner.invoke(app, ["run", str(tiny_qwen), "-n", "-3"])
    assert res.exit_code == 2 and "Invalid value for '--n-predict'" in res.output


@pytest.mark.parametrize("args, message", [
    (["--arch", "llama"], "arch"),
    (["--n-expert", "0"], "expert"),
    (["--n-expert", "4", "--n-expert-used", "6"], "n_expert_used"),
    (["--n-embd", "-256"], "n_embd"),
    (["--size", "huge"], "size"),
])
def test_make_model_bad_inputs(tmp_path: Path, args: list[str], message: str) -> None:
    line = _one_line_error(["make-model", "-o", str(tmp_path / "m.gguf"), *args])
    assert line.startswith("rapidmoe-cli: error: invalid model spec") and message in line
    assert not (tmp_path / "m.gguf").exists()


def test_make_model_writes_and_refuses_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    res = runner.invoke(app, ["make-model", "-o", str(out), "--arch", "deepseek2", "--size", "tiny"])
    assert res.exit_code == 0, res.output
    assert out.stat().st_size > 0 and not list(tmp_path.glob("*.tmp"))
    assert "exists; pass --force" in _one_line_error(["make-model", "-o", str(out)])
    assert runner.invoke(app, ["make-model", "-o", str(out), "--force"]).exit_code == 0


@pytest.mark.native
def test_convert_picks_the_machines_preset(tiny_qwen: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --preset, convert takes the CPU frontier's winner where llama.cpp sees no GPU and the paper's preset
    where it sees one (both named in its output and recorded in the sidecar's metadata)."""
    assert default_preset(False) == CPU_DEFAULT != default_preset(True) == GPU_DEFAULT
    monkeypatch.setattr(budget, "gpu_devices", lambda: [])
    res = runner.invoke(app, ["convert", str(tiny_qwen), "-o", str(tmp_path / "cpu"), "--name", "m"])
    assert res.exit_code == 0, res.output
    assert f"preset auto: {CPU_DEFAULT} (no GPU found)" in res.output
    assert read_sidecar_meta(tmp_path / "cpu" / "m.wr.gguf")["preset.name"] == CPU_DEFAULT
    monkeypatch.setattr(budget, "gpu_devices", lambda: ["CUDA0"])
    res = runner.invoke(app, ["convert", str(tiny_qwen), "-o", str(tmp_path / "gpu"), "--name", "m"])
    # the paper's IQ1_M needs an importance matrix: refused in one line, naming the preset auto chose
    assert f"preset auto: {GPU_DEFAULT} (GPU: CUDA0)" in res.output
    assert res.exit_code != 0 and "importance matrix" in res.output


@pytest.mark.native
def test_convert_auto_falls_back_where_the_refine_codec_cannot_go(tiny_qwen: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU default is a refine preset and the model is one the codec refuses (resplit.convert
    .codec_obstacle: merged gate_up experts, per-expert scales, rows not whole Q3_K super-blocks; its cases are
    tested in test_refine_codec.py), auto takes CPU_FALLBACK and says why, instead of failing the conversion."""
    monkeypatch.setattr(budget, "gpu_devices", lambda: [])
    monkeypatch.setattr(presets, "CPU_DEFAULT", "refine-hq")
    converter = importlib.import_module("rapidmoe.resplit.convert")  # (the package's `convert` is the function)
    monkeypatch.setattr(converter, "codec_obstacle", lambda model, preset: f"{preset} cannot: test reason")
    res = runner.invoke(app, ["convert", str(tiny_qwen), "-o", str(tmp_path / "o"), "--name", "m"])
    assert res.exit_code == 0, res.output
    assert "preset auto: refine-hq (no GPU found)" in res.output
    assert f"preset auto: {CPU_FALLBACK} instead, as the refine codec cannot take this model (refine-hq cannot: test " \
           "reason)" in res.output
    assert read_sidecar_meta(tmp_path / "o" / "m.wr.gguf")["preset.name"] == CPU_FALLBACK


def _only_error_line(res: subprocess.CompletedProcess[str]) -> str:
    """The one line a failed command printed on stderr (asserted: exit 1, nothing else there, no traceback)."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith(("\r", "resplit:"))]
    assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith("rapidmoe-cli: error: "), res.stderr
    return lines[0]


@pytest.mark.native
def test_convert_unusable_inputs_are_one_line(tiny_qwen: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With the default preset (auto, here without a GPU: a refine preset, which inspects the model before it
    picks) and with a named one, every input the conversion cannot use ends as one error line and writes nothing."""
    monkeypatch.setattr(budget, "gpu_devices", lambda: [])
    (tmp_path / "x.gguf").write_text("hello\n")
    (tmp_path / "cut.gguf").write_bytes(tiny_qwen.read_bytes()[:5000])  # inside the tokenizer's strings
    (tmp_path / "file").write_text("")
    out = tmp_path / "out"
    cases = [
        ([str(tmp_path / "x.gguf")], "x.gguf is not a GGUF file"),
        ([str(tmp_path / "cut.gguf")], "cut.gguf is a corrupt or truncated GGUF"),
        ([str(tmp_path / "nope.gguf")], "model file not found"),
        ([str(tmp_path)], "not a file"),
        ([str(tiny_qwen), "--imatrix", str(tmp_path)], "imatrix file not found"),
        ([str(tiny_qwen), "--calib-text", str(tmp_path / "nope.txt")], "calibration text not found"),
    ]
    for args, message in cases:
        for preset in ([], ["--preset", "cpu-fast"]):
            res = runner.invoke(app, ["convert", *args, "-o", str(out), *preset])
            assert res.exit_code == 1 and isinstance(res.exception, SystemExit), (args, preset, res.output)
            assert "rapidmoe-cli: error: " in res.output and message in res.output, (args, preset, res.output)
            assert not out.exists(), (args, preset)
    res = runner.invoke(app, ["convert", str(tiny_qwen), "-o", str(tmp_path / "file" / "o")])
    assert res.exit_code == 1 and "cannot make the output folder" in res.output and "Not a directory" in res.output


def _limited_file_size(limit: int) -> None:
    import resource  # noqa: PLC0415 - POSIX only

    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.native
@pytest.mark.parametrize("preset", [[], ["--preset", "cpu-fast"]])
def test_convert_write_failure_is_one_line_and_leaves_nothing(tiny_qwen: Path, tmp_path: Path,
                                                              preset: list[str]) -> None:
    """A write that fails (here a 4 MB file size limit, `ulimit -f`; a full disk alike) is one error line naming the
    outputs, and none of them is left."""
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "rapidmoe.cli", "convert", str(tiny_qwen), "-o", str(out), *preset],
                         capture_output=True, text=True, timeout=300, preexec_fn=lambda: _limited_file_size(4 << 20))
    line = _only_error_line(res)
    assert "cannot write" in line and "tiny-qwen3moe-f16.wq.gguf" in line and "nothing was kept" in line, line
    assert list(out.iterdir()) == []


@pytest.mark.native
def test_convert_ended_by_a_signal_resumes(tiny_qwen: Path, tmp_path: Path) -> None:
    """SIGTERM in the middle of a conversion (kill, a job scheduler's limit) ends it by that signal and leaves no
    output, only the partial files and journal; `--resume` finishes them to the bytes of an uninterrupted run
    (tests/conversion/test_parallel_convert.py: validation of what was kept)."""
    out, ref = tmp_path / "out", tmp_path / "ref"
    p = subprocess.Popen([sys.executable, "-m", "rapidmoe.cli", "convert", str(tiny_qwen), "-o", str(out), "-t", "1"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    journal = out / "tiny-qwen3moe-f16.resplit.journal"
    deadline = time.monotonic() + 120
    while (not journal.exists() or len(journal.read_text().splitlines()) < 3) and p.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, "the conversion ended before it was signalled"
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGTERM, err
    kept = sorted(x.name for x in out.iterdir())
    assert kept == ["tiny-qwen3moe-f16.resplit.journal", "tiny-qwen3moe-f16.wq.gguf.partial",
                    "tiny-qwen3moe-f16.wr.gguf.partial"], kept
    res = runner.invoke(app, ["convert", str(tiny_qwen), "-o", str(out)])
    assert res.exit_code == 1 and "--resume" in res.output, res.output
    res = runner.invoke(app, ["convert", str(tiny_qwen), "-o", str(out), "--resume"])
    assert res.exit_code == 0, res.output
    assert runner.invoke(app, ["convert", str(tiny_qwen), "-o", str(ref)]).exit_code == 0
    for suffix in (".wq.gguf", ".wr.gguf"):
        name = "tiny-qwen3moe-f16" + suffix
        assert (out / name).read_bytes() == (ref / name).read_bytes(), suffix


@pytest.mark.native
def test_convert_other_type_sets_the_head_too(tiny_qwen: Path, tmp_path: Path) -> None:
    """--other-type sets every non-expert matrix: refine's Q4_K output head and Q8_0 token embedding give way to it
    (issue 48: the head stayed Q4_K); the routers it leaves F32 are named, with why (tests/conversion/
    test_type_flags.py: every preset and flag)."""
    from rapidmoe.ggufio import GGUFFile  # noqa: PLC0415

    res = runner.invoke(app, ["convert", str(tiny_qwen), "-o", str(tmp_path), "--name", "m", "--preset", "refine",
                              "--other-type", "F16"])
    assert res.exit_code == 0, res.output
    types = {t.name: t.tensor_type.name for t in GGUFFile(tmp_path / "m.wq.gguf").tensors}
    matrices = [n for n, t in ((t.name, t) for t in GGUFFile(tmp_path / "m.wq.gguf").tensors)
                if "_exps." not in n and len(t.shape) >= 2]
    assert types["output.weight"] == types["token_embd.weight"] == "F16"
    routers = sorted(n for n in matrices if "ffn_gate_inp" in n)
    assert {n for n in matrices if types[n] != "F16"} == set(routers) and routers
    assert (f"--other-type F16 leaves {len(routers)} of {len(matrices)} non-expert matrices at F32 (routers "
            f"(ffn_gate_inp), norms and biases stay F32, as in llama-quantize): {routers[0]}") in res.output


@pytest.mark.native
def test_run_and_serve_pass_flash_attention_like_llama_cpp(tiny_qwen: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """-fa / --flash-attn reaches the engine: `run` defaults to "auto" (llama-cli's and llama-server's default; the
    Python API keeps llama_cpp.Llama's False), "off" and "on" pass through, anything else is a usage error; `serve`'s
    config carries the same default."""
    import rapidmoe.llama as engine  # noqa: PLC0415

    seen: list[object] = []
    real_init = engine.Llama.__init__

    def spy(self: engine.Llama, *args: object, **kwargs: object) -> None:
        seen.append(kwargs.get("flash_attn"))
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.Llama, "__init__", spy)
    for extra, want in (([], "auto"), (["-fa", "off"], "off"), (["--flash-attn", "on"], "on")):
        res = runner.invoke(app, ["run", str(tiny_qwen), "-p", "Hi", "-n", "2", "--temp", "0", *extra])
        assert res.exit_code == 0, res.output
        assert seen[-1] == want
    res = runner.invoke(app, ["run", str(tiny_qwen), "-fa", "maybe"])
    assert res.exit_code == 2 and "--flash-attn" in res.output
    from rapidmoe.server.config import ServerConfig  # noqa: PLC0415

    assert ServerConfig(model=tiny_qwen).flash_attn == "auto"
