"""Seeds and mutators for the inputs that are not model files: UMIA policy and frequency JSON (by structure: a value
replaced by another type, a boundary number, a huge or deeply nested value, a key dropped or added; and by text),
routing traces (header fields, metadata JSON, step records, truncation) and importance matrices (the GGUF form
through mutate_gguf, the legacy .dat form by its length fields).

A mutant here is its bytes, made from (seed, index) alone, so it reproduces from the case's recipe.
"""
from __future__ import annotations

import json
import random
import struct
from pathlib import Path
from typing import Any

import numpy as np

JSON = Any
WEIRD: list[JSON] = [None, True, False, 0, -1, 1, 2**31, 2**63, 10**400, -(10**400), 1e308, -1e308, 0.5, -0.0,
                     float("nan"), float("inf"), "", "x", "auto", "\udcff", [], {}, [1], {"a": 1}]


def _paths(obj: JSON, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _get(obj: JSON, path: tuple[Any, ...]) -> JSON:
    for p in path:
        obj = obj[p]
    return obj


def _nested(depth: int) -> JSON:
    """A placeholder that mutate_json's output replaces by `depth` nested arrays (json.dumps would recurse)."""
    return f"__nested_{depth}__"


def _expand_nested(text: str) -> str:
    while "\"__nested_" in text:
        start = text.index("\"__nested_")
        end = text.index("__\"", start + 10) + 3
        depth = int(text[start + 10: end - 3])
        text = text[:start] + "[" * depth + "1" + "]" * depth + text[end:]
    return text


def mutate_json(rng: random.Random, seed: JSON) -> bytes:
    """A structural change of `seed` (a copy), serialised; a quarter of the time a text-level change instead."""
    obj = json.loads(json.dumps(seed))
    if rng.random() < 0.25:
        text = json.dumps(obj).encode()
        return mutate_text(rng, text)
    path = rng.choice(_paths(obj))
    op = rng.randrange(6)
    if op == 0 or not path:
        new: JSON = rng.choice([*WEIRD, _nested(rng.choice([50, 2000, 100000])), "a" * rng.choice([1000, 10**6]),
                                [0] * rng.choice([100, 10**5])])
        if not path:
            obj = new
        else:
            _get(obj, path[:-1])[path[-1]] = new
    elif op == 1 and isinstance(_get(obj, path[:-1]), dict):
        del _get(obj, path[:-1])[path[-1]]
    elif op == 2:
        parent = _get(obj, path[:-1])
        if isinstance(parent, dict):
            parent[rng.choice(["unknown", "meta", "x" * 100, ""])] = rng.choice(WEIRD)
        elif isinstance(parent, list):
            parent.append(rng.choice(WEIRD))
    elif op == 3:
        v = _get(obj, path)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            _get(obj, path[:-1])[path[-1]] = rng.choice([v + 1, v - 1, -v, v * 1e6, 0, float("nan"), 10**30])
    elif op == 4:
        parent = _get(obj, path[:-1])
        if isinstance(parent, list) and parent:
            del parent[rng.randrange(len(parent))]
    else:
        v = _get(obj, path)
        _get(obj, path[:-1])[path[-1]] = [v] if rng.random() < 0.5 else {"v": v}
    return _expand_nested(json.dumps(obj)).encode()


def mutate_text(rng: random.Random, text: bytes) -> bytes:
    b = bytearray(text)
    op = rng.randrange(6)
    if op == 0 and b:
        del b[rng.randrange(len(b)):]
    elif op == 1 and b:
        b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 2:
        b[rng.randrange(len(b) + 1):0] = rng.choice([b"\xff\xfe", b"\xef\xbb\xbf", b"\0", b"[" * 100000, b"{\"a\":"])
    elif op == 3 and b:
        key = b'"theta"' if b'"theta"' in b else b[:1]
        b = b.replace(b"{", b"{" + key + b": 1, ", 1)
    elif op == 4:
        b = bytearray(rng.choice([b"", b"null", b"[]", b"1", b"\"policy\"", b"NaN", b"1e999"]))
    else:
        b += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
    return bytes(b)


# ---- seeds --------------------------------------------------------------------------------------------------
def policy_seed() -> JSON:
    from rapidmoe.umia.policy import Policy  # noqa: PLC0415

    d = Policy(theta=0.8, alpha=0.5, beta=0.3, depth_cutoff=0.9, r_min=1, r_max=3, layer_scale=(1.0, 0.8)).to_dict()
    d["meta"] = {"model": "tiny", "kl": 0.01}
    return d


def frequency_seed(rng: random.Random) -> JSON:
    rows = [[rng.randrange(100) for _ in range(8)] for _ in range(2)]
    return rng.choice([rows, {"layers": rows}, {"0": rows[0], "1": rows[1]}])


def trace_seed(path: Path, predicted: bool) -> bytes:
    """A valid trace of the default model's shape: 2 MoE layers, 8 experts, top-4, three steps."""
    from rapidmoe.trace import TraceHeader, TraceWriter  # noqa: PLC0415

    rng = np.random.default_rng(0)
    h = TraceHeader(8, 4, (0, 1), {"model": "tiny", "arch": "qwen3moe", "predicted": predicted})
    with TraceWriter(path, h) as w:
        for n in (5, 1, 1):
            ids = [np.stack([rng.permutation(8)[:4] for _ in range(n)]).astype(np.int32) for _ in range(2)]
            ws = [rng.random((n, 4)).astype(np.float16) for _ in range(2)]
            w.write_step(n, ids, ws, [ids[1]] if predicted else None)
    return path.read_bytes()


HEAD = struct.Struct("<8sIIIIII")  # rapidmoe.trace's header


def mutate_trace(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    _, version, n_moe, n_expert, k, id_bytes, meta_len = HEAD.unpack_from(data)
    op = rng.randrange(6)
    if op == 0:  # a header field
        i = rng.randrange(1, 7)
        fields = [version, n_moe, n_expert, k, id_bytes, meta_len]
        v = rng.choice([0, 1, 2, 3, 4, 255, 256, 257, 65536, 2**31, 2**32 - 1, fields[i - 1] + 1, fields[i - 1] - 1])
        struct.pack_into("<I", b, 8 + 4 * (i - 1), v % 2**32)
    elif op == 1:  # the metadata JSON
        meta = json.loads(data[HEAD.size: HEAD.size + meta_len])
        new = mutate_json(rng, meta)
        b[HEAD.size: HEAD.size + meta_len] = new
        struct.pack_into("<I", b, 28, len(new) if rng.random() < 0.8 else rng.choice([0, len(new) + 1, 2**31]))
    elif op == 2:  # a step's n_tokens or rows
        at = HEAD.size + meta_len + 4 * rng.randrange(1 + n_moe)
        if at + 4 <= len(b):
            struct.pack_into("<I", b, at, rng.choice([0, 1, 2, 4, 6, 100, 2**20, 2**31, 2**32 - 1]))
    elif op == 3:
        del b[rng.randrange(len(b)):]
    elif op == 4:  # expert ids out of range
        at = rng.randrange(HEAD.size + meta_len, len(b))
        b[at] = rng.choice([8, 9, 200, 255])
    else:
        b += bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 12, 100])))
    return bytes(b)


def imatrix_seed(path: Path) -> bytes:
    """An imatrix of the default model's routed experts and one dense weight (llama.cpp's GGUF layout)."""
    from rapidmoe.resplit.imatrix import Imatrix, write_imatrix  # noqa: PLC0415

    rng = np.random.default_rng(0)
    im = Imatrix(datasets=["fuzz.txt"], chunk_count=2, chunk_size=64)
    for il in range(2):
        for role in ("gate", "up", "down"):
            name = f"blk.{il}.ffn_{role}_exps.weight"
            im.in_sum2[name] = rng.random((8, 256)).astype(np.float32)
            im.counts[name] = rng.integers(0, 50, 8).astype(np.float32)
    im.in_sum2["blk.0.attn_q.weight"] = rng.random((1, 256)).astype(np.float32)
    im.counts["blk.0.attn_q.weight"] = np.array([64], np.float32)
    write_imatrix(im, path)
    return path.read_bytes()


def legacy_imatrix_seed() -> bytes:
    out = [struct.pack("<i", 2)]
    for name in (b"blk.0.ffn_up_exps.weight", b"blk.0.attn_q.weight"):
        vals = np.linspace(0.1, 1.0, 256, dtype=np.float32)
        out += [struct.pack("<i", len(name)), name, struct.pack("<ii", 4, 256), vals.tobytes()]
    out.append(struct.pack("<i", 1) + b"x")  # the dataset name that newer llama-imatrix appends
    return b"".join(out)


def mutate_legacy_imatrix(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    fields = [0, 4, 4 + 4 + 24, 4 + 4 + 24 + 4]  # n, the first name's length, its ncall, its nval
    if rng.random() < 0.6:
        struct.pack_into("<i", b, rng.choice(fields), rng.choice([0, -1, 1, 3, 255, 257, 2**31 - 1, -(2**31)]))
    else:
        b = bytearray(mutate_text(rng, bytes(b)))
    return bytes(b)
