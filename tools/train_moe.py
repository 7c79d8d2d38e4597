#!/usr/bin/env python3
"""Train a small qwen3moe model from scratch on the CPU, export it as a GGUF stock llama.cpp loads, and check it.

RapidMoE's quality results use two trained models: tiny-moe-a (../shared/models/tiny-moe-a, 16 experts,
top-4, trained on Python documentation, fortunes, the KJV and the Jargon File) and the model this tool makes,
tiny-moe-b by default: another routing regime (32 experts, top-8) trained on other text (the Python standard
library's own source files). Reproducible: the corpus, its split, the weights' initialisation and the batches all
come from --seed; only the number of steps depends on the machine's speed (the schedule runs over --minutes of
wall time; --steps N fixes it instead).

Needs PyTorch, which is NOT a dependency of rapidmoe (only this tool uses it; the CPU wheel is enough):
    pip install torch --index-url https://download.pytorch.org/whl/cpu

Pipeline (all steps by default; --verify runs only the last two on an existing output folder):
  prep    the corpus: every .py file under --source-dir (sorted paths; folders named test/tests and pydoc_data/,
          which is the Python documentation's text, left out), read with their declared encoding, joined by blank
          lines, cut into ~3000-character chunks at blank lines; chunks drawn at random (--seed) until 5% of the
          characters are in eval.txt and another 5% in calib.txt, the rest is the training text. Tokenized with
          llama.cpp's tokenizer (rapidmoe.Llama, vocab_only) of tiny-moe-a's 4096-token byte-level BPE: no BOS,
          no escape processing, special tokens not parsed.
  train   qwen3moe in PyTorch, fp32, exactly llama.cpp's computation (src/models/qwen3moe.cpp, build_moe_ffn):
          pre-RMSNorm, per-head q/k RMSNorm before NEOX RoPE, GQA attention (scale 1/sqrt(head_dim)), softmax
          router over all experts, top-k, selected weights renormalised to sum 1, SwiGLU experts, final RMSNorm,
          untied output. Loss = cross-entropy + --aux-weight x switch load-balancing loss (n_expert x sum_i f_i
          P_i, mean over layers; 1.0 is perfectly balanced). AdamW (0.9, 0.95; weight decay on matrices only),
          linear warm-up over --warmup steps, cosine to --min-lr-frac of --lr over the wall-time budget, gradient
          clipping at 1.0, random windows of --n-ctx + 1 tokens.
  export  model-f16.gguf: F16 matrices, F32 norms and router (ffn_gate_inp), the keys, tensor names, order and
          layout convert_hf_to_gguf.py writes for Qwen3-MoE, tiny-moe-a's tokenizer metadata copied from its GGUF;
          written to a .tmp name and renamed when complete.
  verify  the GGUF through rapidmoe.Llama (logits_all) against the PyTorch model with the same F16-rounded
          weights in fp32: on --verify-chunks eval chunks the max |logit difference|, mean KL(torch || llama.cpp)
          and top-1 agreement; on all of eval.txt the perplexity by both (llama-perplexity's chunking: chunks of
          --n-ctx tokens, the second half of each scored). Fails (exit 1) when mean KL > --max-kl or the
          perplexities differ by more than --max-ppl-rel: then the export does not match llama.cpp's computation.
          Also the routing skew on eval.txt (PyTorch, every position).
  readme  README.md in the output folder: architecture, data, token counts, training settings and log, the
          results above, the exact commands.

Output folder (default bench/out/models/tiny-moe-b, git-ignored): model-f16.gguf, eval.txt, calib.txt, README.md,
and work/ (token arrays, the fp32 checkpoint, report.json: everything the README says, machine-readable).

Usage:
  python tools/train_moe.py --minutes 40 --threads 2              # the whole pipeline
  python tools/train_moe.py --verify                              # check an existing export again
  python tools/train_moe.py --out /tmp/smoke --minutes 1          # a quick end-to-end check
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import shlex
import sys
import time
import tokenize
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# libgomp's threads yield instead of spinning while they wait: on a loaded machine (other processes on the same
# cores) spinning threads make every parallel op wait for a descheduled one (2 threads measured 2x slower than 1
# thread with spinning, as fast as 1 or faster without). Set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    import torch  # type: ignore[import-not-found,unused-ignore]
    from torch import nn  # type: ignore[import-not-found,unused-ignore]
    from torch.nn import functional  # type: ignore[import-not-found,unused-ignore]
except ImportError as _e:
    raise SystemExit(
        "tools/train_moe.py needs PyTorch, which is not a dependency of rapidmoe (only this tool uses it).\n"
        "Install the CPU wheel: pip install torch --index-url https://download.pytorch.org/whl/cpu") from _e

from rapidmoe import Llama
from rapidmoe.synthetic.writer import read_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY_MOE_A = ROOT.parent / "shared" / "models" / "tiny-moe-a"
DEFAULT_OUT = ROOT / "bench" / "out" / "models" / "tiny-moe-b"
DEFAULT_SOURCE = Path("/usr/lib/python3.11")
EXCLUDED_DIRS = ("test", "tests", "pydoc_data")  # pydoc_data/topics.py: the documentation, tiny-moe-a's text
ARCH = "qwen3moe"
CHUNK_CHARS = 3000
VERIFY_BATCH = 16
HELD_OUT_FRACTION = 0.05  # of the characters, for eval.txt and again for calib.txt
# per layer, in the order (and with the names) convert_hf_to_gguf.py writes a Qwen3-MoE layer (as tiny-moe-a)
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
                 "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")

log = logging.getLogger("train_moe")


@dataclasses.dataclass(frozen=True)
class Config:
    """The model's hyperparameters (llama.cpp qwen3moe)."""

    n_vocab: int = 4096
    n_embd: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_expert: int = 32
    n_expert_used: int = 8
    n_ff_exp: int = 256
    n_ctx: int = 256
    rope_base: float = 10000.0
    rms_eps: float = 1e-6


def f32_tensor(name: str) -> bool:
    """Kept F32 in the export (norms and the router, as convert_hf_to_gguf.py writes them); the rest F16."""
    return name.endswith("norm") or name.endswith("ffn_gate_inp")


# -- the model ---------------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """ggml_rms_norm then the weight: x / sqrt(mean(x^2) + eps) * w over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """llama.cpp's NEOX RoPE over all head_dim dimensions: element i pairs with i + head_dim/2. x: (B, T, H, D)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class RouteStats:
    """Routing statistics accumulated over forward passes, per layer (numpy, float64)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        e = cfg.n_expert
        self.tokens = 0
        self.usage = np.zeros((cfg.n_layer, e))  # top-k selections per expert
        self.prob_sum = np.zeros((cfg.n_layer, e))  # sum of router probabilities
        self.top1 = np.zeros(cfg.n_layer)
        self.topk_mass = np.zeros(cfg.n_layer)
        self.renorm_top1 = np.zeros(cfg.n_layer)
        self.entropy = np.zeros(cfg.n_layer)  # nats

    def add(self, layer: int, probs: torch.Tensor, topw: torch.Tensor, topi: torch.Tensor) -> None:
        p = probs.detach().double()
        if layer == 0:
            self.tokens += p.shape[0]
        self.usage[layer] += np.bincount(topi.reshape(-1).numpy(), minlength=self.cfg.n_expert)
        self.prob_sum[layer] += p.sum(0).numpy()
        tw = topw.detach().double()
        self.top1[layer] += float(tw[:, 0].sum())
        self.topk_mass[layer] += float(tw.sum())
        self.renorm_top1[layer] += float((tw[:, 0] / tw.sum(-1)).sum())
        self.entropy[layer] += float(-(p * torch.log(p.clamp_min(1e-30))).sum())

    def table(self) -> list[dict[str, Any]]:
        n, e = self.tokens, self.cfg.n_expert
        rows = []
        for layer in range(self.cfg.n_layer):
            share = self.usage[layer] / self.usage[layer].sum()
            marginal = self.prob_sum[layer] / n
            rows.append({
                "layer": layer, "top1": self.top1[layer] / n, "topk_mass": self.topk_mass[layer] / n,
                "renorm_top1": self.renorm_top1[layer] / n, "token_entropy_bits": self.entropy[layer] / n / math.log(2),
                "marginal_entropy_bits": float(-(marginal * np.log2(np.maximum(marginal, 1e-300))).sum()),
                "usage_max_x": float(share.max() * e), "usage_min_x": float(share.min() * e),
                "experts_below_half": int((share * e < 0.5).sum()), "usage_share": [float(s) for s in share]})
        return rows


class Block(nn.Module):  # type: ignore[misc,unused-ignore]
    """One qwen3moe layer; each parameter is named as its GGUF tensor (blk.N.<name>.weight) and has its shape
    (numpy order: the reverse of ggml's ne)."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd, e, ff = cfg.n_embd, cfg.head_dim, cfg.n_expert, cfg.n_ff_exp
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.attn_q = nn.Parameter(torch.empty(cfg.n_head * hd, d))
        self.attn_k = nn.Parameter(torch.empty(cfg.n_head_kv * hd, d))
        self.attn_v = nn.Parameter(torch.empty(cfg.n_head_kv * hd, d))
        self.attn_output = nn.Parameter(torch.empty(d, cfg.n_head * hd))
        self.attn_q_norm = nn.Parameter(torch.ones(hd))
        self.attn_k_norm = nn.Parameter(torch.ones(hd))
        self.ffn_norm = nn.Parameter(torch.ones(d))
        self.ffn_gate_inp = nn.Parameter(torch.empty(e, d))
        self.ffn_gate_exps = nn.Parameter(torch.empty(e, ff, d))
        self.ffn_up_exps = nn.Parameter(torch.empty(e, ff, d))
        self.ffn_down_exps = nn.Parameter(torch.empty(e, d, ff))

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        h = rms_norm(x, self.attn_norm, cfg.rms_eps)
        q = (h @ self.attn_q.T).view(b, t, cfg.n_head, cfg.head_dim)
        k = (h @ self.attn_k.T).view(b, t, cfg.n_head_kv, cfg.head_dim)
        v = (h @ self.attn_v.T).view(b, t, cfg.n_head_kv, cfg.head_dim)
        q = rope_neox(rms_norm(q, self.attn_q_norm, cfg.rms_eps), cos, sin)
        k = rope_neox(rms_norm(k, self.attn_k_norm, cfg.rms_eps), cos, sin)
        rep = cfg.n_head // cfg.n_head_kv  # query head j reads KV head j // rep (ggml's broadcast)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(cfg.head_dim))
        return o.transpose(1, 2).reshape(b, t, cfg.n_head * cfg.head_dim) @ self.attn_output.T

    def moe(self, x: torch.Tensor, layer: int, stats: RouteStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        """build_moe_ffn with softmax gating, norm_w=true, SwiGLU; returns (output, load-balancing loss)."""
        cfg = self.cfg
        shape = x.shape
        h = rms_norm(x, self.ffn_norm, cfg.rms_eps).reshape(-1, cfg.n_embd)
        probs = torch.softmax(h @ self.ffn_gate_inp.T, dim=-1)
        topw, topi = probs.topk(cfg.n_expert_used, dim=-1)
        weights = topw / topw.sum(-1, keepdim=True)
        if stats is not None:
            stats.add(layer, probs, topw, topi)
        flat = topi.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // cfg.n_expert_used
        counts = torch.bincount(flat, minlength=cfg.n_expert)
        # split and unbind, not slicing and indexing: their backward assembles the gradient from the parts instead
        # of adding each part into a zero-filled copy of the whole
        sizes = counts.tolist()
        gates, ups, downs = (w.unbind(0) for w in (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps))
        tokens_e = token.split(sizes)
        weights_e = weights.reshape(-1)[order].unsqueeze(1).split(sizes)
        out = torch.zeros_like(h)
        for e, xe in enumerate(h.index_select(0, token).split(sizes)):
            if sizes[e]:
                a = functional.silu(xe @ gates[e].T) * (xe @ ups[e].T)
                out.index_add_(0, tokens_e[e], (a * weights_e[e]) @ downs[e].T)
        frac = counts.to(h.dtype) / flat.numel()  # f_i: share of the top-k selections
        aux = cfg.n_expert * (frac * probs.mean(0)).sum()
        return out.view(shape), aux

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                stats: RouteStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(x, cos, sin)
        m, aux = self.moe(x, layer, stats)
        return x + m, aux


class MoEModel(nn.Module):  # type: ignore[misc,unused-ignore]
    cos: torch.Tensor  # RoPE tables (n_ctx, head_dim / 2), buffers
    sin: torch.Tensor

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_embd = nn.Parameter(torch.empty(cfg.n_vocab, cfg.n_embd))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.output_norm = nn.Parameter(torch.ones(cfg.n_embd))
        self.output = nn.Parameter(torch.empty(cfg.n_vocab, cfg.n_embd))
        inv = cfg.rope_base ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        ang = torch.arange(cfg.n_ctx, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def init_weights(self, seed: int) -> None:
        """N(0, 0.02) for matrices, 0.02 / sqrt(2 n_layer) for the residual outputs (attn_output, ffn_down_exps),
        ones for the norms; drawn in the GGUF tensor order from a generator seeded with `seed`."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.gguf_params():
                if f32_tensor(name) and name.endswith("norm"):
                    p.fill_(1.0)
                else:
                    std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if ("attn_output" in name or "down" in name) else 0.02
                    p.normal_(0.0, std, generator=g)

    def gguf_params(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(GGUF tensor name without '.weight', parameter) in the order convert_hf_to_gguf.py writes them."""
        yield "token_embd", self.token_embd
        for i, blk in enumerate(self.blocks):
            for n in LAYER_TENSORS:
                yield f"blk.{i}.{n}", getattr(blk, n)
        yield "output_norm", self.output_norm
        yield "output", self.output

    def forward(self, idx: torch.Tensor, stats: RouteStats | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, n_vocab) and the load-balancing loss averaged over layers."""
        t = idx.shape[1]
        x = functional.embedding(idx, self.token_embd)
        cos, sin = self.cos[:t], self.sin[:t]
        aux = x.new_zeros(())
        for i, blk in enumerate(self.blocks):
            x, a = blk(x, cos, sin, i, stats)
            aux = aux + a
        x = rms_norm(x, self.output_norm, self.cfg.rms_eps)
        return x @ self.output.T, aux / self.cfg.n_layer


def n_params(cfg: Config) -> tuple[int, int]:
    """(total, active per token) parameters, embeddings included in total, the output matrix in both."""
    d, hd = cfg.n_embd, cfg.head_dim
    attn = d * cfg.n_head * hd * 2 + d * cfg.n_head_kv * hd * 2 + 2 * hd + 2 * d + d * cfg.n_expert
    expert = 3 * d * cfg.n_ff_exp
    total = 2 * cfg.n_vocab * d + d + cfg.n_layer * (attn + cfg.n_expert * expert)
    active = cfg.n_vocab * d + d + cfg.n_layer * (attn + cfg.n_expert_used * expert)
    return total, active


# -- prep --------------------------------------------------------------------------------------------------------

def source_files(source_dir: Path) -> list[Path]:
    files = []
    for p in source_dir.rglob("*.py"):
        rel = p.relative_to(source_dir)
        if any(part in EXCLUDED_DIRS or part.endswith("-packages") for part in rel.parts[:-1]):
            continue
        if p.is_file():
            files.append(rel)
    return sorted(files, key=str)


def read_corpus(source_dir: Path) -> tuple[str, int]:
    """The files' text (declared encoding, universal newlines), each without its trailing blank lines, joined by
    one blank line; and the number of files."""
    files = source_files(source_dir)
    if not files:
        raise SystemExit(f"no .py files under {source_dir}")
    texts = []
    for rel in files:
        with tokenize.open(source_dir / rel) as f:
            texts.append(f.read().rstrip("\n"))
    return "\n\n".join(t for t in texts if t.strip()), len(files)


def chunks_of(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """Contiguous chunks of at least `size` characters (the last may be shorter), cut at blank lines."""
    out: list[str] = []
    cur: list[str] = []
    n = 0
    for para in text.split("\n\n"):
        cur.append(para)
        n += len(para) + 2
        if n >= size:
            out.append("\n\n".join(cur))
            cur, n = [], 0
    if cur:
        out.append("\n\n".join(cur))
    return out


def split_corpus(text: str, seed: int) -> dict[str, str]:
    """Chunks drawn in a random order (seed) into eval until it holds 5% of the characters, then calib likewise;
    each split keeps its chunks in their original order, joined by blank lines."""
    chunks = chunks_of(text)
    total = sum(len(c) for c in chunks)
    order = np.random.default_rng(seed).permutation(len(chunks))
    held: dict[str, list[int]] = {"eval": [], "calib": []}
    got = {"eval": 0, "calib": 0}
    for i in order.tolist():
        name = "eval" if got["eval"] < HELD_OUT_FRACTION * total else "calib"
        if got[name] >= HELD_OUT_FRACTION * total:
            break
        held[name].append(i)
        got[name] += len(chunks[i])
    used = set(held["eval"]) | set(held["calib"])
    parts = {"train": [i for i in range(len(chunks)) if i not in used],
             "eval": sorted(held["eval"]), "calib": sorted(held["calib"])}
    return {k: "\n\n".join(chunks[i] for i in v) + "\n" for k, v in parts.items()}


def tokenize_text(vocab_gguf: Path, text: str) -> np.ndarray:
    """llama.cpp's tokens of `text` with the vocabulary of `vocab_gguf`: no BOS, special tokens not parsed, no
    escape processing (llama_tokenize itself does none)."""
    tok = Llama(str(vocab_gguf), vocab_only=True, verbose=False)
    try:
        ids = tok.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    finally:
        tok.close()
    return np.asarray(ids, dtype=np.uint16)


def prep(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    text, n_files = read_corpus(args.source_dir)
    texts = split_corpus(text, args.seed)
    info: dict[str, Any] = {
        "source_dir": str(args.source_dir), "files": n_files, "excluded_dirs": list(EXCLUDED_DIRS),
        "corpus_chars": len(text), "corpus_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "tokenizer_from": str(args.tokenizer_from), "seed": args.seed, "chars": {}, "tokens": {}}
    cached = work / "prep.json"
    if cached.is_file():
        old = json.loads(cached.read_text())
        if all(old.get(k) == info[k] for k in ("corpus_sha256", "tokenizer_from", "seed")) and all(
                (work / f"tokens-{s}.npy").is_file() for s in texts):
            log.info("prep: reusing %s (same corpus, tokenizer and seed)", cached)
            for s in ("eval", "calib"):
                write_atomic(out / f"{s}.txt", texts[s].encode())
            return dict(old)
    for name, t in texts.items():
        ids = tokenize_text(args.tokenizer_from, t)
        np.save(work / f"tokens-{name}.npy", ids)
        info["chars"][name] = len(t)
        info["tokens"][name] = int(ids.size)
        log.info("prep: %s %d chars, %d tokens (%.2f chars/token)", name, len(t), ids.size, len(t) / ids.size)
    for s in ("eval", "calib"):
        write_atomic(out / f"{s}.txt", texts[s].encode())
    info["seconds"] = time.perf_counter() - t0
    write_atomic(cached, json.dumps(info, indent=1).encode())
    return info


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# -- train -------------------------------------------------------------------------------------------------------

def lr_at(step: int, frac: float, args: argparse.Namespace) -> float:
    """Linear warm-up over the first --warmup steps times a cosine from --lr to --min-lr-frac x --lr over the
    budget (frac: the share of it used)."""
    warm = min(1.0, step / args.warmup)
    cos = args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return float(args.lr * warm * cos)


def windows(tokens: np.ndarray, starts: np.ndarray, n: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([tokens[s:s + n] for s in starts]).astype(np.int64))


@torch.no_grad()  # type: ignore[misc,unused-ignore]
def val_loss(model: MoEModel, val: torch.Tensor) -> float:
    model.eval()
    logits, _ = model(val[:, :-1])
    model.train()
    return float(functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), val[:, 1:].reshape(-1)))


def train(args: argparse.Namespace, out: Path, cfg: Config) -> dict[str, Any]:
    work = out / "work"
    train_tokens = np.load(work / "tokens-train.npy")
    eval_tokens = np.load(work / "tokens-eval.npy")
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    model = MoEModel(cfg)
    model.init_weights(args.seed)
    model.train()
    decay = [p for n, p in model.gguf_params() if p.ndim >= 2]
    no_decay = [p for n, p in model.gguf_params() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    n = cfg.n_ctx + 1
    val_starts = np.linspace(0, eval_tokens.size - n, args.batch).astype(np.int64)
    val = windows(eval_tokens, val_starts, n)
    budget = args.minutes * 60.0
    history: list[dict[str, Any]] = []
    vals: list[dict[str, Any]] = []
    recent: list[float] = []
    t0 = time.monotonic()
    step = 0
    log.info("train: %d train tokens, batch %d x %d, budget %s", train_tokens.size, args.batch, cfg.n_ctx,
             f"{args.steps} steps" if args.steps else f"{args.minutes} min")
    while True:
        elapsed = time.monotonic() - t0
        frac = step / args.steps if args.steps else elapsed / budget
        if frac >= 1.0:
            break
        step += 1
        lr = lr_at(step, frac, args)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = windows(train_tokens, rng.integers(0, train_tokens.size - n, size=args.batch), n)
        logits, aux = model(batch[:, :-1])
        ce = functional.cross_entropy(logits.reshape(-1, cfg.n_vocab), batch[:, 1:].reshape(-1))
        loss = ce + args.aux_weight * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip))
        opt.step()
        ce_v, aux_v = float(ce.detach()), float(aux.detach())
        recent = [*recent, ce_v][-20:]
        if step == 1 or step % args.log_every == 0:
            minutes = (time.monotonic() - t0) / 60
            rec = {"step": step, "minutes": minutes, "loss": ce_v, "aux": aux_v, "lr": lr,
                   "grad_norm": gnorm, "tok_s": step * args.batch * cfg.n_ctx / (minutes * 60)}
            history.append(rec)
            log.info("step %5d | %5.1f min | loss %.4f (mean of last %d %.4f) | aux %.3f | lr %.2e | |g| %.2f | "
                     "%.0f tok/s", step, minutes, rec["loss"], len(recent), sum(recent) / len(recent), rec["aux"], lr,
                     gnorm, rec["tok_s"])
        if step % args.val_every == 0:
            vl = val_loss(model, val)
            vals.append({"step": step, "minutes": (time.monotonic() - t0) / 60, "val_loss": vl})
            log.info("step %5d | val loss %.4f (ppl %.2f) on %d fixed eval windows", step, vl, math.exp(vl),
                     args.batch)
    wall = time.monotonic() - t0
    final_val = val_loss(model, val)
    summary = {"steps": step, "tokens": step * args.batch * cfg.n_ctx, "wall_s": wall,
               "tok_s": step * args.batch * cfg.n_ctx / wall, "final_loss_mean20": sum(recent) / len(recent),
               "final_val_loss": final_val, "history": history, "val": vals, "threads": torch.get_num_threads(),
               "torch": torch.__version__, "loadavg_end": list(os.getloadavg()), "cpus": os.cpu_count()}
    log.info("train: %d steps, %d tokens in %.1f min (%.0f tok/s); train loss (mean of last 20 steps) %.4f, "
             "val loss %.4f", step, summary["tokens"], wall / 60, summary["tok_s"], summary["final_loss_mean20"],
             final_val)
    ckpt = work / "checkpoint.pt"
    torch.save({"config": dataclasses.asdict(cfg), "state": model.state_dict()}, ckpt.with_name(ckpt.name + ".tmp"))
    os.replace(ckpt.with_name(ckpt.name + ".tmp"), ckpt)
    return summary


def load_model(out: Path) -> MoEModel:
    ck = torch.load(out / "work" / "checkpoint.pt", map_location="cpu", weights_only=True)
    model = MoEModel(Config(**ck["config"]))
    model.load_state_dict(ck["state"])
    model.eval()
    return model


# -- export ------------------------------------------------------------------------------------------------------

def export(model: MoEModel, path: Path, tokenizer_from: Path, name: str) -> None:
    """The GGUF convert_hf_to_gguf.py would write for this Qwen3-MoE (keys and tensor order as tiny-moe-a's)."""
    cfg = model.cfg
    tokenizer = read_tokenizer(tokenizer_from)
    vocab = next(kv.value for kv in tokenizer if kv.key == gguf.Keys.Tokenizer.LIST)
    if len(vocab) != cfg.n_vocab:
        raise SystemExit(f"{tokenizer_from} has {len(vocab)} tokens, the model {cfg.n_vocab}")
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(tmp, ARCH)
    try:
        w.add_name(name)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        w.add_context_length(cfg.n_ctx)
        w.add_embedding_length(cfg.n_embd)
        w.add_block_count(cfg.n_layer)
        w.add_feed_forward_length(cfg.n_ff_exp * cfg.n_expert_used)  # unused by llama.cpp for qwen3moe
        w.add_head_count(cfg.n_head)
        w.add_head_count_kv(cfg.n_head_kv)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_rope_freq_base(cfg.rope_base)
        w.add_layer_norm_rms_eps(cfg.rms_eps)
        w.add_expert_count(cfg.n_expert)
        w.add_expert_used_count(cfg.n_expert_used)
        w.add_expert_feed_forward_length(cfg.n_ff_exp)
        w.add_vocab_size(cfg.n_vocab)
        for kv in tokenizer:
            w.add_key_value(kv.key, kv.value, kv.vtype, kv.sub_type)
        for tname, p in model.gguf_params():
            data = p.detach().float().numpy()
            w.add_tensor(f"{tname}.weight", data.astype(np.float32 if f32_tensor(tname) else np.float16))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    log.info("export: wrote %s (%.1f MiB)", path, path.stat().st_size / 2**20)


# -- verify ------------------------------------------------------------------------------------------------------

def f16_rounded(model: MoEModel) -> MoEModel:
    """The model with every tensor the export writes in F16 rounded to F16 (computed in fp32 still)."""
    with torch.no_grad():
        for name, p in model.gguf_params():
            if not f32_tensor(name):
                p.copy_(p.half().float())
    return model


def chunk_nll(logp: np.ndarray, chunk: Sequence[int], first: int) -> tuple[float, int]:
    """llama-perplexity's score of one chunk: -log p(token j+1 | logits j) for j in [first, n_ctx - 1)."""
    idx = np.arange(first, len(chunk) - 1)
    return float(-logp[idx, np.asarray(chunk)[idx + 1]].sum()), int(idx.size)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def verify(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    gguf_path = out / "model-f16.gguf"
    model = f16_rounded(load_model(out))
    cfg = model.cfg
    eval_tokens = np.load(out / "work" / "tokens-eval.npy")
    again = tokenize_text(gguf_path, (out / "eval.txt").read_text(encoding="utf-8"))
    same_tokens = bool(np.array_equal(again, eval_tokens))
    if not same_tokens:
        log.error("verify: the exported GGUF tokenizes eval.txt differently from the cached tokens")
    n_chunks = eval_tokens.size // cfg.n_ctx
    chunks = [eval_tokens[i * cfg.n_ctx:(i + 1) * cfg.n_ctx].astype(np.int64) for i in range(n_chunks)]
    first = cfg.n_ctx // 2
    stats = RouteStats(cfg)
    llm = Llama(str(gguf_path), n_ctx=cfg.n_ctx, n_batch=cfg.n_ctx, n_ubatch=cfg.n_ctx, n_threads=args.threads,
                n_threads_batch=args.threads, logits_all=True, verbose=False)
    nll = {"torch": 0.0, "llama": 0.0}
    scored = 0
    kls: list[np.ndarray] = []
    max_abs = 0.0
    agree = 0
    compared = 0
    t_torch = t_llama = 0.0
    batch: list[np.ndarray] = []
    try:
        for i, ch in enumerate(chunks):
            if i % VERIFY_BATCH == 0:  # the PyTorch model runs VERIFY_BATCH chunks at once
                t = time.perf_counter()
                with torch.no_grad():
                    batch = list(model(torch.from_numpy(np.stack(chunks[i:i + VERIFY_BATCH])), stats)[0].numpy())
                t_torch += time.perf_counter() - t
            lt = batch[i % VERIFY_BATCH].astype(np.float64)
            t = time.perf_counter()
            llm.reset()
            llm._ctx.kv_cache_clear()
            llm.eval(ch.tolist())
            ll = np.array(llm.scores[:len(ch)], dtype=np.float64)
            t_llama += time.perf_counter() - t
            pt, pl = log_softmax(lt), log_softmax(ll)
            a, n = chunk_nll(pt, ch.tolist(), first)
            b, _ = chunk_nll(pl, ch.tolist(), first)
            nll["torch"] += a
            nll["llama"] += b
            scored += n
            if i < args.verify_chunks:
                max_abs = max(max_abs, float(np.abs(lt - ll).max()))
                kls.append((np.exp(pt) * (pt - pl)).sum(-1))
                agree += int((lt.argmax(-1) == ll.argmax(-1)).sum())
                compared += len(ch)
            if (i + 1) % 100 == 0:
                log.info("verify: %d/%d chunks", i + 1, n_chunks)
    finally:
        llm.close()
    kl = np.concatenate(kls)
    res: dict[str, Any] = {
        "eval_tokens": int(eval_tokens.size), "chunks": n_chunks, "scored": scored,
        "ppl_torch": math.exp(nll["torch"] / scored), "ppl_llama": math.exp(nll["llama"] / scored),
        "compare_chunks": len(kls), "compare_positions": compared, "max_abs_logit_diff": max_abs,
        "mean_kl": float(kl.mean()), "max_kl": float(kl.max()), "top1_agree": agree / compared,
        "tokenizer_roundtrip_same": same_tokens, "torch_s": t_torch, "llama_s": t_llama,
        "routing": stats.table(), "max_kl_allowed": args.max_kl, "max_ppl_rel_allowed": args.max_ppl_rel}
    res["ppl_rel_diff"] = res["ppl_llama"] / res["ppl_torch"] - 1
    res["ok"] = bool(res["mean_kl"] <= args.max_kl and abs(res["ppl_rel_diff"]) <= args.max_ppl_rel and same_tokens)
    log.info("verify: %d chunks compared (%d positions): max |logit diff| %.4g, mean KL(torch||llama.cpp) %.3g "
             "(max %.3g), top-1 agreement %.3f%%", len(kls), compared, max_abs, res["mean_kl"], res["max_kl"],
             100 * res["top1_agree"])
    log.info("verify: eval PPL (%d chunks of %d, second half scored, %d tokens scored): torch %.4f, llama.cpp %.4f "
             "(%+.4f%%)", n_chunks, cfg.n_ctx, scored, res["ppl_torch"], res["ppl_llama"], 100 * res["ppl_rel_diff"])
    if not res["ok"]:
        log.error("verify FAILED: the GGUF does not compute what the PyTorch model does (mean KL %.3g > %.3g, or "
                  "PPL differs by %.3f%% > %.3f%%, or the tokenizer round trip differs)", res["mean_kl"], args.max_kl,
                  100 * res["ppl_rel_diff"], 100 * args.max_ppl_rel)
    return res


# -- README ------------------------------------------------------------------------------------------------------

def readme(report: dict[str, Any], out: Path) -> str:
    cfg = Config(**report["config"])
    total, active = n_params(cfg)
    p, t, v = report["prep"], report.get("train"), report.get("verify")
    a = report["args"]
    size = (out / "model-f16.gguf").stat().st_size / 2**20
    lines = [
        f"# {report['name']}: tiny trained qwen3moe model (evaluation and calibration model)", "",
        "A small Mixture-of-Experts language model trained from scratch on a CPU with tools/train_moe.py, exported as "
        "a GGUF that stock llama.cpp loads as `qwen3moe`. The second trained model next to tiny-moe-a, "
        f"in another routing regime ({cfg.n_expert} experts, top-{cfg.n_expert_used}) and trained on other text (the "
        "Python standard library's source code). Its router was learned during training, so expert choice depends "
        "on the input (see the routing table).", "",
        "## Files", "", "| file | what |", "|---|---|",
        f"| model-f16.gguf | the model: F16 matrices; F32 norms and F32 router (`ffn_gate_inp`), as "
        f"convert_hf_to_gguf.py would write them ({size:.1f} MiB) |",
        f"| eval.txt | held-out evaluation text, 5% of the characters ({p['chars']['eval']:,} chars, "
        f"{p['tokens']['eval']:,} tokens) |",
        f"| calib.txt | a different held-out 5%, for calibration / imatrix ({p['chars']['calib']:,} chars, "
        f"{p['tokens']['calib']:,} tokens) |",
        "| README.md | this file (written by tools/train_moe.py) |",
        "| work/ | the tool's working files: token arrays, the fp32 PyTorch checkpoint, report.json (all numbers "
        "below) |", "",
        "Neither eval.txt nor calib.txt was used for training.", "",
        "## Architecture (llama.cpp `qwen3moe`)", "", "| hparam | value |", "|---|---|",
        f"| n_vocab | {cfg.n_vocab} |", f"| n_embd | {cfg.n_embd} |", f"| n_layer | {cfg.n_layer} |",
        f"| n_head / n_head_kv | {cfg.n_head} / {cfg.n_head_kv} (GQA) |", f"| head_dim | {cfg.head_dim} |",
        f"| n_expert / n_expert_used | {cfg.n_expert} / {cfg.n_expert_used} |",
        f"| expert_feed_forward_length | {cfg.n_ff_exp} |", f"| context_length (trained) | {cfg.n_ctx} |",
        f"| rope | NEOX, freq_base {cfg.rope_base:g}, all {cfg.head_dim} dims |", f"| rms_norm_eps | {cfg.rms_eps:g} |",
        "| output | untied (separate `output.weight`) |",
        f"| parameters | total {total / 1e6:.2f}M, active/token {active / 1e6:.2f}M |", "",
        "The computation is what llama.cpp does for qwen3moe (src/models/qwen3moe.cpp, build_moe_ffn): pre-RMSNorm, "
        "per-head RMSNorm on q and k before RoPE, GQA attention with scale 1/sqrt(head_dim), softmax router over "
        "all experts, top-k selection, selected weights renormalised to sum 1 (norm_w=true; expert_weights_scale "
        "not set), SwiGLU experts down(silu(gate x) * up x), final RMSNorm and output matrix. No BOS is added "
        "(`tokenizer.ggml.add_bos_token=false`).", "",
        "## Training data", "",
        f"The Python standard library's source: every `.py` file under `{p['source_dir']}` (Debian's "
        f"libpython3.11-minimal / libpython3.11-stdlib), {p['files']} files in sorted path order, folders named "
        f"{', '.join(f'`{d}/`' for d in p['excluded_dirs'])} left out (`pydoc_data/` holds the Python "
        "documentation's text, which tiny-moe-a was trained on). Each file read with its declared encoding, trailing "
        "blank lines removed, files joined by one blank line "
        f"({p['corpus_chars']:,} characters, sha256 {p['corpus_sha256'][:16]}...). Split into contiguous chunks of "
        f"about {CHUNK_CHARS} characters cut at blank lines; chunks were drawn at random (seed {p['seed']}) until 5% "
        "of the characters were in eval.txt and another 5% in calib.txt; the remaining chunks are the training "
        "text (each split keeps its chunks in corpus order, joined by a blank line).", "",
        "| split | chars | tokens | chars/token |", "|---|---|---|---|",
        *[f"| {s} | {p['chars'][s]:,} | {p['tokens'][s]:,} | {p['chars'][s] / p['tokens'][s]:.2f} |"
          for s in ("train", "eval", "calib")], "",
        "## Tokenizer", "",
        "tiny-moe-a's: byte-level BPE, vocabulary 4096 (trained on tiny-moe-a's training text, not on this corpus); "
        "its `tokenizer.*` GGUF metadata is copied unchanged into model-f16.gguf. Text is tokenized with llama.cpp's "
        "own tokenizer (rapidmoe.Llama, vocab_only): no BOS, special tokens not parsed, no escape processing (pass "
        "`--no-escape` to llama.cpp's tools with a `-f` file).", ""]
    if v:
        lines += [f"Tokenizing eval.txt with model-f16.gguf gives the training-time tokens: "
                  f"{v['tokenizer_roundtrip_same']}.", ""]
    if t:
        lines += [
            "## Training", "",
            f"AdamW (betas 0.9/0.95, eps 1e-8, weight decay {a['weight_decay']} on matrices), peak LR {a['lr']:g}, "
            f"{a['warmup']} warmup steps, cosine decay to {a['min_lr_frac']:.0%} over "
            + (f"{a['steps']} steps" if a["steps"] else f"elapsed wall time ({a['minutes']:g} minutes)")
            + f", grad clip {a['clip']}, batch {a['batch']} x {cfg.n_ctx} tokens (random windows), plain fp32, "
            f"torch.set_num_threads({a['threads']}), seed {a['seed']} (data split, initialisation N(0, 0.02), "
            f"residual outputs 0.02/sqrt(2 n_layer), batches). Loss = cross-entropy + {a['aux_weight']} x "
            "switch-transformer load-balancing loss (n_expert * sum_i f_i P_i, f_i the share of the top-k "
            "selections, averaged over layers; 1.0 = perfectly balanced). torch " + t["torch"] + ".", "",
            f"Result: {t['steps']} steps, {t['tokens']:,} tokens in {t['wall_s'] / 60:.1f} min ({t['tok_s']:.0f} "
            f"tok/s) ({t['tokens'] / p['tokens']['train']:.2f} epochs of the training text)"
            + (f"; the machine's load average (1/5/15 min) at the end of training: "
               f"{'/'.join(f'{x:.1f}' for x in t['loadavg_end'])} on {t['cpus']} CPUs (other processes share them: "
               "the steps a wall-time budget buys depend on it)" if "loadavg_end" in t else "") + ".", "",
            "| step | minutes | train loss | aux loss | lr | tok/s |", "|---|---|---|---|---|---|"]
        hist = t["history"]
        keep = hist if len(hist) <= 16 else [hist[round(i * (len(hist) - 1) / 15)] for i in range(16)]
        lines += [f"| {h['step']} | {h['minutes']:.1f} | {h['loss']:.3f} | {h['aux']:.3f} | {h['lr']:.2e} | "
                  f"{h['tok_s']:.0f} |" for h in keep]
        lines += [f"| {t['steps']} (end) | {t['wall_s'] / 60:.1f} | {t['final_loss_mean20']:.3f} (mean of the last 20 "
                  "steps) | | | |", ""]
        if t["val"]:
            lines += [f"Validation loss (fixed {a['batch']} x {cfg.n_ctx}-token windows of eval.txt) every "
                      f"{a['val_every']} steps: " + ", ".join(f"{x['step']}: {x['val_loss']:.4f}" for x in t["val"])
                      + f"; at the end: {t['final_val_loss']:.4f}.", ""]
    if v:
        lines += [
            f"## Perplexity on eval.txt (n_ctx {cfg.n_ctx}, chunks of {cfg.n_ctx} tokens, second half of each chunk "
            "scored, no BOS)", "",
            "| implementation | PPL |", "|---|---|",
            f"| PyTorch, fp32 computation with the F16-rounded weights | {v['ppl_torch']:.4f} |",
            f"| llama.cpp (rapidmoe.Llama, logits_all), model-f16.gguf | {v['ppl_llama']:.4f} |", "",
            f"llama.cpp vs PyTorch: {100 * v['ppl_rel_diff']:+.4f}% ({v['chunks']} chunks, {v['scored']:,} tokens "
            f"scored of {v['eval_tokens']:,}); llama-perplexity's chunking, so `llama-perplexity -m model-f16.gguf "
            f"-f eval.txt -c {cfg.n_ctx} --no-escape` should print the same.", "",
            f"Logits, all positions of the first {v['compare_chunks']} chunks ({v['compare_positions']:,} positions): "
            f"max |logit difference| {v['max_abs_logit_diff']:.4g}, mean KL(PyTorch || llama.cpp) "
            f"{v['mean_kl']:.3g} (max {v['max_kl']:.3g}), same top token {100 * v['top1_agree']:.3f}%. "
            f"Verification {'passed' if v['ok'] else 'FAILED'} (limits: mean KL <= {v['max_kl_allowed']:g}, "
            f"|PPL difference| <= {100 * v['max_ppl_rel_allowed']:g}%).", "",
            "## Routing skew on eval.txt (PyTorch, all positions of all chunks)", "",
            f"p = softmax router probabilities over all {cfg.n_expert} experts, sorted per token; top-1 = mean "
            f"largest probability, top-{cfg.n_expert_used} mass = mean sum of the {cfg.n_expert_used} largest; "
            f"renorm top-1 = mean weight of the best expert after renormalising the selected {cfg.n_expert_used} "
            f"(uniform would be {1 / cfg.n_expert_used:.3f}). Token entropy = mean per-token entropy of p in bits "
            f"(uniform = {math.log2(cfg.n_expert):.1f}); marginal entropy = entropy of the average p. Usage = share "
            f"of the top-{cfg.n_expert_used} selections per expert as a multiple of uniform (1/{cfg.n_expert}); "
            "below 0.5x = experts chosen less than half as often as uniform.", "",
            f"| layer | top-1 | top-{cfg.n_expert_used} mass | renorm top-1 | token entropy (bits) | marginal entropy "
            "(bits) | usage max x | usage min x | experts below 0.5x |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['layer']} | {r['top1']:.3f} | {r['topk_mass']:.3f} | {r['renorm_top1']:.3f} | "
                  f"{r['token_entropy_bits']:.2f} | {r['marginal_entropy_bits']:.2f} | {r['usage_max_x']:.2f} | "
                  f"{r['usage_min_x']:.2f} | {r['experts_below_half']} |" for r in v["routing"]]
        lines += ["", "Per-expert usage shares: work/report.json (verify.routing[].usage_share).", ""]
    lines += ["## Commands", "",
              f"tools/train_moe.py of the RapidMoE repository; torch {t['torch'] if t else torch.__version__} (CPU), "
              "gguf-py and llama.cpp through the rapidmoe package.", "", "```",
              *report["commands"], "```", ""]
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    ap.add_argument("--name", default=None, help="general.name in the GGUF (default: the output folder's name)")
    ap.add_argument("--verify", action="store_true", help="only verify an existing export and rewrite README.md")
    ap.add_argument("--minutes", type=float, default=40.0, help="training wall-time budget (default: 40)")
    ap.add_argument("--steps", type=int, default=0, help="train this many steps instead of a wall-time budget")
    ap.add_argument("--threads", type=int, default=2, help="torch and llama.cpp threads (default: 2)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--source-dir", type=Path, default=DEFAULT_SOURCE, help="the corpus (default: %(default)s)")
    ap.add_argument("--tokenizer-from", type=Path, default=TINY_MOE_A / "model-f16.gguf",
                    help="GGUF whose tokenizer is used and copied (default: tiny-moe-a's)")
    ap.add_argument("--n-layer", type=int, default=Config.n_layer)
    ap.add_argument("--n-expert", type=int, default=Config.n_expert)
    ap.add_argument("--n-expert-used", type=int, default=Config.n_expert_used)
    ap.add_argument("--n-ff-exp", type=int, default=Config.n_ff_exp)
    ap.add_argument("--batch", type=int, default=32, help="sequences per step (default: 32)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--aux-weight", type=float, default=0.01)
    ap.add_argument("--log-every", type=int, default=10, help="a progress line every N steps")
    ap.add_argument("--val-every", type=int, default=100)
    ap.add_argument("--verify-chunks", type=int, default=8, help="eval chunks whose logits are compared")
    ap.add_argument("--max-kl", type=float, default=1e-3)
    ap.add_argument("--max-ppl-rel", type=float, default=0.01)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    out = args.out.resolve()
    args.source_dir = args.source_dir.resolve()
    args.tokenizer_from = args.tokenizer_from.resolve()
    command = "python tools/train_moe.py" + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "")
    report_path = out / "work" / "report.json"
    if args.verify:
        if not report_path.is_file():
            raise SystemExit(f"{report_path} not found: train first (python tools/train_moe.py --out {args.out})")
        report = json.loads(report_path.read_text())
        report["verify"] = verify(args, out)
        if command not in report["commands"]:
            report["commands"].append(command)
    else:
        out.mkdir(parents=True, exist_ok=True)
        cfg = Config(n_layer=args.n_layer, n_expert=args.n_expert, n_expert_used=args.n_expert_used,
                     n_ff_exp=args.n_ff_exp)
        name = args.name or out.name
        info = prep(args, out)
        report = {"name": name, "config": dataclasses.asdict(cfg),
                  "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  "prep": info, "commands": [command]}
        report["train"] = train(args, out, cfg)
        export(load_model(out), out / "model-f16.gguf", args.tokenizer_from, name)
        report["verify"] = verify(args, out)
    write_atomic(report_path, json.dumps(report, indent=1).encode())
    write_atomic(out / "README.md", readme(report, out).encode())
    log.info("wrote %s", out / "README.md")
    return 0 if report["verify"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
