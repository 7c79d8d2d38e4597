"""make-model at real size: the Qwen3-30B-A3B and DeepSeek-V3 shapes are those models' layer shapes; BF16 and Q8_0
files hold the generator's weights in ggml's encodings (checked against gguf-py's own quantizers); the file does
not depend on the thread count; and the memory that writing (and converting) takes does not grow with the model."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import quantize as np_quantize
from typer.testing import CliRunner

from rapidmoe.cli.app import app
from rapidmoe.ggufio import GGUFFile
from rapidmoe.synthetic import describe, generate_pieces, spec_for, spec_for_shape, tensor_plan, write_model

runner = CliRunner()


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_qwen3_30b_a3b_shape() -> None:
    spec = spec_for_shape("qwen3-30b-a3b")
    plan = {t.name: t.shape for t in tensor_plan(spec, 151936)}
    assert (spec.n_layer, spec.n_expert, spec.n_expert_used, spec.n_embd, spec.n_ff_exp) == (48, 128, 8, 2048, 768)
    assert (spec.n_head, spec.n_head_kv, spec.head_dim, spec.vocab) == (32, 4, 128, "qwen2")
    assert plan["blk.47.ffn_gate_exps.weight"] == (128, 768, 2048)
    assert plan["blk.0.attn_q.weight"] == (4096, 2048) and plan["blk.0.attn_k.weight"] == (512, 2048)
    assert plan["output.weight"] == (151936, 2048)
    d = describe(spec)
    # "30B-A3B": 30.5 B weights, 3.3 B active with the token embedding table (which describe() counts as one row)
    assert 30.4e9 < d["total_params"] < 30.6e9 and 3.2e9 < d["active_params_per_token"] + 151936 * 2048 < 3.5e9
    assert 32.3e9 < describe(spec.replace(dtype="q8_0"))["tensor_bytes"] < 32.6e9  # 32 GB in Q8_0


def test_deepseek_v3_slice_shape() -> None:
    spec = spec_for_shape("deepseek-v3")
    plan = {t.name: t.shape for t in tensor_plan(spec, 102400)}
    assert (spec.n_embd, spec.n_expert, spec.n_ff_exp, spec.n_ff, spec.n_layer_dense_lead) == (7168, 256, 2048,
                                                                                              18432, 3)
    assert spec.moe_layers == [3, 4]
    assert plan["blk.0.ffn_gate.weight"] == (18432, 7168) and "blk.0.ffn_gate_exps.weight" not in plan
    assert plan["blk.3.ffn_down_exps.weight"] == (256, 7168, 2048)
    assert plan["blk.3.attn_q_a.weight"] == (1536, 7168) and plan["blk.3.attn_q_b.weight"] == (128 * 192, 1536)
    assert plan["blk.3.attn_kv_a_mqa.weight"] == (512 + 64, 7168)
    assert plan["blk.3.attn_k_b.weight"] == (128, 512, 128) and plan["blk.3.attn_v_b.weight"] == (128, 128, 512)
    assert (spec.n_group, spec.n_group_used, spec.n_expert_used, spec.n_expert_shared) == (8, 4, 8, 1)
    # one MoE layer of DeepSeek-V3: 11.3 G routed weights (671 B in all over 58 of them, with the rest)
    moe = sum(int(np.prod(s)) for n, s in plan.items() if n.startswith("blk.3."))
    assert 11.4e9 < moe < 11.6e9
    res = runner.invoke(app, ["make-model", "--shape", "deepseek-v3", "--n-layer", "3", "-o", "x.gguf"])
    assert res.exit_code == 1 and "n_layer_dense_lead" in res.output


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])
def test_bf16_and_q8_0_files_hold_the_weights_in_ggmls_encodings(arch: str, vocab_dir: Path, tmp_path: Path) -> None:
    """Every matrix of a BF16 / Q8_0 file is gguf-py's BF16 / Q8_0 of the generator's float32 weights (the same
    bytes ggml's quantize_row_*_ref writes); norms and router stay F32; the file type says which; written on 1 or 3
    threads the file is the same."""
    f32 = spec_for(arch, "tiny", dtype="f32")
    for dtype, qt in (("bf16", gguf.GGMLQuantizationType.BF16), ("q8_0", gguf.GGMLQuantizationType.Q8_0)):
        spec = f32.replace(dtype=dtype)
        a = write_model(spec, tmp_path / f"{dtype}-1.gguf", vocab_dir, threads=1)
        b = write_model(spec, tmp_path / f"{dtype}-3.gguf", vocab_dir, threads=3)
        assert _sha(a) == _sha(b)
        r = GGUFFile(a)
        assert r.get("general.file_type") == {"bf16": 32, "q8_0": 7}[dtype]
        tensors = {t.name: t for t in r.tensors}
        for t in tensor_plan(f32, len(r.get("tokenizer.ggml.tokens"))):
            got = tensors[t.name]
            w = np.concatenate([p.reshape(-1) for p in generate_pieces(f32, t)]).reshape(t.shape)
            if t.f32:
                assert got.tensor_type == gguf.GGMLQuantizationType.F32
                np.testing.assert_array_equal(np.asarray(got.data).reshape(-1), w.reshape(-1))
            else:
                assert got.tensor_type == qt, t.name
                want = np_quantize(w.reshape(-1, t.shape[-1]), qt)
                assert np.asarray(got.data).tobytes() == want.tobytes(), t.name


@pytest.mark.native
@pytest.mark.parametrize("dtype", ["bf16", "q8_0"])
def test_bf16_and_q8_0_models_load_and_convert(dtype: str, vocab_dir: Path, tmp_path: Path) -> None:
    """llama.cpp runs them, and convert takes them as sources (the users' types)."""
    from rapidmoe import Llama  # noqa: PLC0415 - the compiled parts
    from rapidmoe.resplit import check_pair, convert, get_preset  # noqa: PLC0415

    path = write_model(spec_for("qwen3moe", "tiny", dtype=dtype), tmp_path / f"m-{dtype}.gguf", vocab_dir)
    llm = Llama(str(path), n_ctx=64, verbose=False)
    out = llm.create_completion("Once upon a time", max_tokens=4, temperature=0)
    llm.close()
    assert isinstance(out, dict) and out["usage"]["completion_tokens"] >= 1
    res = convert(path, tmp_path / "out", get_preset("refine-hq"), progress=False)
    check_pair(res.wq_path, res.wr_path)


PEAK = """
import json, resource, sys
from pathlib import Path
from rapidmoe.paths import vocab_dir
from rapidmoe.synthetic import spec_for, write_model
spec = spec_for("qwen3moe", "tiny", n_embd=256, n_ff_exp=1024, n_layer=2, n_expert=int(sys.argv[2]), n_expert_used=4,
                vocab="gpt-2", dtype="f16")
write_model(spec, Path(sys.argv[1]), vocab_dir(), threads=1)
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
"""

CONVERT_PEAK = """
import json, resource, sys
from rapidmoe.resplit import convert, get_preset
convert(sys.argv[1], sys.argv[2], get_preset("refine-hq"), progress=False, threads=1)
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
"""


def _peak_kib(code: str, *args: str) -> int:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return int(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
@pytest.mark.native
def test_writing_and_converting_take_the_same_memory_at_two_sizes(tmp_path: Path) -> None:
    """Peak resident memory of make-model and of convert (one thread each) on models of 8 and 96 experts per layer
    (routed tensors of 4 and 48 MiB, files of 79 and 356 MB): within a few MiB of each other (measured: 161 and 161
    MiB writing), where holding a whole tensor, as make-model did before it streamed (150 and 196 MiB), or mapping
    the source, as the reference converter does, grows with the model."""
    small, large = tmp_path / "small.gguf", tmp_path / "large.gguf"
    write = [_peak_kib(PEAK, str(p), n) for p, n in ((small, "8"), (large, "96"))]
    assert large.stat().st_size > 2.5 * small.stat().st_size
    assert abs(write[1] - write[0]) < 12 * 1024, write
    conv = [_peak_kib(CONVERT_PEAK, str(p), str(tmp_path / f"out-{p.stem}")) for p in (small, large)]
    assert abs(conv[1] - conv[0]) < 12 * 1024, conv
