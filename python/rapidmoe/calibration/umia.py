"""Offline calibration: the accuracy-latency frontier of candidate policies on calibration text, and a choice.

1. Chunks of the text (random offsets from a seed) are scored by a reference: the F16 model when given, else the
   same RESplit pair with every slot critical (r = k). The same pass records every token's top-k routing weights
   per MoE layer.
2. Candidates: fixed r (r_min = r_max = r), the drop baseline at small r (non-critical experts skipped), and UMIA
   policies at equal cost to fixed r: for each alpha on a grid and each target mean r per layer, theta is found
   by bisection on the recorded weights (the numpy arbitration predicts the r every token would get), then put
   on the 0.01 grid; below a mean r of 1, policies whose deeper layers get no critical expert (depth cutoffs).
3. Each candidate runs over the chunks with decode thresholds (phase forced to decode, since decode latency is
   what the budget is about): KL(P_ref || P) per position against the reference, and the r histogram it
   realised, priced by the latency model R.
4. The Pareto frontier over (predicted ms/token, mean KL) of fixed-r and UMIA candidates; the choice is the
   lowest KL within the budget, or the frontier's knee without one.
5. beta: the chosen policy at each beta of a grid, run with prefill thresholds over the same chunks (each chunk
   is a prompt: its KL is the prompt-phase KL), priced by the latency model's prefill terms; the lowest KL within
   the prefill budget, or the knee. A latency model with a device part prices every candidate per layer (the max
   of the overlapped device and CPU stages needs each layer's own r).
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ..atomic import write_text
from ..errors import RapidMoEError
from ..residual import load_residual_info
from ..umia.arbitration import n_critical
from ..umia.frontier import choose, pareto
from ..umia.latency import LatencyModel
from ..umia.policy import Policy

log = logging.getLogger(__name__)


@dataclass
class Evaluation:
    label: str
    kind: str  # "fixed", "umia", "drop" or "beta" (prefill: the chosen policy at another beta)
    policy: Policy
    kl_mean: float = float("nan")
    kl_p99: float = float("nan")
    top1_same: float = float("nan")
    critical_per_token: float = float("nan")  # realised: critical slots per token summed over MoE layers
    mean_r: list[float] = field(default_factory=list)  # realised mean r per MoE layer
    predicted_ms: float = float("nan")  # ms/token by the latency model (decode; prefill for kind "beta")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["policy"] = self.policy.to_dict()
        return d


@dataclass
class CalibrationResult:
    evaluations: list[Evaluation]
    frontier: list[int]  # indices into evaluations (fixed + UMIA), by latency
    chosen: int
    budget_ms: float | None
    settings: dict[str, Any]

    @property
    def policy(self) -> Policy:
        return self.evaluations[self.chosen].policy

    def table(self) -> str:
        rows = ["| candidate | kind | policy | critical slots/token | mean r per layer | predicted ms/token | "
                "KL mean | KL p99 | top-1 same | frontier |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        front = set(self.frontier)
        for i, e in enumerate(self.evaluations):
            mark = ("**chosen**" if i == self.chosen else "yes") if i in front else ""
            mr = " ".join(f"{x:.2f}" for x in e.mean_r)
            rows.append(f"| {e.label} | {e.kind} | {e.policy.describe()} | {e.critical_per_token:.2f} | {mr} | "
                        f"{e.predicted_ms:.2f} | {e.kl_mean:.5f} | {e.kl_p99:.4f} | {e.top1_same:.3f} | {mark} |")
        return "\n".join(rows)

    def save(self, out_dir: str | os.PathLike[str], *, plot: bool = True) -> dict[str, Path]:
        """policy.json (the choice), frontier.json, frontier.md and frontier.png, each written atomically."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"policy": out / "policy.json", "json": out / "frontier.json", "md": out / "frontier.md"}
        self.policy.save(paths["policy"])
        write_text(paths["json"], json.dumps({"settings": self.settings, "budget_ms": self.budget_ms,
                                          "chosen": self.chosen, "frontier": self.frontier,
                                          "evaluations": [e.to_dict() for e in self.evaluations]}, indent=2))
        e = self.evaluations[self.chosen]
        head = (f"# UMIA calibration\n\n{self.settings.get('command', '')}\n\n"
                f"Chosen: **{e.label}** ({e.policy.describe()}), KL {e.kl_mean:.5f}, predicted "
                f"{e.predicted_ms:.2f} ms/token" + (f" (budget {self.budget_ms:.2f})" if self.budget_ms else
                                                     " (knee of the frontier, no budget)") + "\n\n")
        write_text(paths["md"], head + self.table() + "\n")
        if plot:
            png = out / "frontier.png"
            if plot_frontier(self, png):
                paths["png"] = png
        return paths


def plot_frontier(res: CalibrationResult, path: Path) -> bool:
    try:
        import matplotlib  # noqa: PLC0415  (optional dependency: the bench extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415  (optional dependency: the bench extra)
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'rapidmoe[bench]'): no frontier plot")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {"fixed": ("s", "tab:blue", "fixed r"), "umia": ("o", "tab:orange", "UMIA"),
              "drop": ("x", "tab:red", "drop non-critical")}
    for kind, (marker, color, name) in styles.items():
        pts = [e for e in res.evaluations if e.kind == kind]
        if pts:
            ax.scatter([e.predicted_ms for e in pts], [e.kl_mean for e in pts], marker=marker, color=color,
                       label=name, alpha=0.8)
    for e in res.evaluations:
        if e.kind in ("fixed", "drop"):
            ax.annotate(e.label, (e.predicted_ms, e.kl_mean), fontsize=7, xytext=(3, 3), textcoords="offset points")
    f = res.frontier
    ax.plot([res.evaluations[i].predicted_ms for i in f], [res.evaluations[i].kl_mean for i in f], "k--", lw=0.8,
            label="frontier")
    c = res.evaluations[res.chosen]
    ax.scatter([c.predicted_ms], [c.kl_mean], s=160, facecolors="none", edgecolors="k", label="chosen")
    if res.budget_ms:
        ax.axvline(res.budget_ms, color="grey", lw=0.8, ls=":", label="budget")
    ax.set_yscale("log")
    ax.set_xlabel("predicted decode latency (ms/token)")
    ax.set_ylabel("KL divergence to reference (mean)")
    ax.set_title(res.settings.get("title", "UMIA calibration"))
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    logp: np.ndarray = (x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).astype(np.float32)
    return logp


def _kl(ref_logp: np.ndarray, logits: np.ndarray) -> np.ndarray:
    lq = log_softmax(logits).astype(np.float64)
    lp = ref_logp.astype(np.float64)
    kl: np.ndarray = (np.exp(lp) * (lp - lq)).sum(axis=-1)  # one per row; numpy types a sum over an axis Any
    return kl


def pick_chunks(tokens: list[int], n_tokens: int, chunk: int, seed: int) -> list[list[int]]:
    """n_tokens // chunk non-overlapping chunks at seeded random offsets (deterministic)."""
    n = max(1, n_tokens // chunk)
    slots = len(tokens) // chunk
    if slots < n:
        raise RapidMoEError(f"the text has {len(tokens)} tokens: not enough for {n} chunks of {chunk}")
    rng = np.random.default_rng(seed)
    picks = sorted(rng.choice(slots, size=n, replace=False).tolist())
    return [tokens[p * chunk:(p + 1) * chunk] for p in picks]


def theta_for_level(weights: list[np.ndarray], alpha: float, level: float, r_min: int, r_max: int,
                    iters: int = 40, depth_cutoff: float = 1.0) -> float:
    """theta (decode) whose predicted mean r per MoE layer over the recorded weights is closest to `level`
    (over the layers the depth cutoff keeps).

    weights: per MoE layer, float32 [n_tokens, k]. Bisection: the mean r grows with theta."""
    n_moe = len(weights)
    depth = np.arange(n_moe) / max(n_moe - 1, 1)
    kept = [m for m in range(n_moe) if depth[m] <= depth_cutoff + 1e-9]

    def mean_r(theta: float) -> float:
        tau = Policy(theta=theta, alpha=alpha, r_min=r_min, r_max=r_max).thresholds(n_moe)[:, 0]
        return float(np.mean([n_critical(weights[m], tau[m], r_min, r_max).mean() for m in kept]))

    lo, hi = 0.0, 1.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if mean_r(mid) < level:
            lo = mid
        else:
            hi = mid
    cand = sorted({round(lo, 2), round(hi, 2), min(1.0, round(hi + 0.01, 2)), max(0.0, round(lo - 0.01, 2))})
    return min(cand, key=lambda t: (abs(mean_r(t) - level), t))


class Scorer:
    """One Llama over the chunks: logits per chunk, with optional capture of the routing weights."""

    def __init__(self, path: str | os.PathLike[str], chunk: int, threads: int | None, **kw: Any) -> None:
        from ..llama import Llama  # noqa: PLC0415  (rapidmoe.llama loads the compiled part on import)

        self.llm = Llama(path, n_ctx=chunk, n_batch=chunk, n_ubatch=chunk, logits_all=True, n_threads=threads,
                         n_threads_batch=threads, verbose=False, **kw)

    def logits(self, toks: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(toks)
        return np.array(self.llm.scores[: len(toks)], dtype=np.float32)

    def close(self) -> None:
        self.llm.close()


def calibrate(wq_path: str | os.PathLike[str], wr_path: str | os.PathLike[str], text_path: str | os.PathLike[str],
              latency: LatencyModel, *, reference: str | os.PathLike[str] | None = None,
              budget_ms: float | None = None, n_tokens: int = 1024, chunk: int = 256, seed: int = 0,
              alphas: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0), levels: tuple[float, ...] | None = None,
              fixed_r: tuple[int, ...] | None = None, drop_r: tuple[int, ...] | None = None,
              cutoffs: tuple[float, ...] = (0.25, 0.5, 0.75), beta: float = 0.25,
              betas: tuple[float, ...] | None = (0.0, 0.25, 0.5, 1.0, 2.0), prefill_budget_ms: float | None = None,
              r_min: int = 0, threads: int | None = None, refine: bool = True, progress: bool = True,
              command: str = "") -> CalibrationResult:
    from .._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use)

    info = load_residual_info(wq_path, wr_path, verify=False)
    k, moe_layers = info.n_expert_used, sorted(info.wq_bytes_per_expert)
    if latency.k != k or latency.n_moe_layers != len(moe_layers):
        raise RapidMoEError(f"the latency model was measured for top-{latency.k} with {latency.n_moe_layers} MoE "
                            f"layers; this model has top-{k} with {len(moe_layers)}: measure it again")
    if chunk < 8 or n_tokens < chunk:
        raise RapidMoEError(f"need chunk >= 8 and tokens >= chunk (got chunk {chunk}, tokens {n_tokens})")
    try:
        text = Path(text_path).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise RapidMoEError(f"cannot read calibration text {text_path}: {e}") from None
    # below a mean r of 1 the rule has nothing to offer (any theta > 0 makes the top expert critical): fixed r = 0
    # and r = 1 cover it
    levels = levels if levels is not None else tuple(x for x in (1.25, 1.5, 2.0, 2.5, 3.0) if x < k)
    fixed_r = fixed_r if fixed_r is not None else tuple(range(k + 1)) if k <= 8 else (0, 1, 2, 3, 4, 6, k)
    drop_r = drop_r if drop_r is not None else tuple(r for r in (1, 2, 3) if r < k)

    # 1. reference log-probs and the routing weights (r = k pass)
    full = Scorer(wq_path, chunk, threads, residual_path=wr_path, verify_residual=False,
                   eval_callback=(cap := _core.TensorCapture([f"ffn_moe_weights-{il}" for il in moe_layers])))
    chunks = pick_chunks(full.llm.tokenize(text.encode()), n_tokens, chunk, seed)
    full.llm.set_n_critical(k)
    bar = tqdm(total=len(chunks) * (1 + len(fixed_r) + len(drop_r) + len(alphas) * len(levels) + 2 * len(cutoffs)
                                    + (reference is not None)),
               desc="calibrate", unit="chunk", disable=not progress)
    ref_logp = []
    for c in chunks:
        lg = full.logits(c)
        if reference is None:
            ref_logp.append(log_softmax(lg))
        bar.update(1)
    weights = [np.concatenate([x.reshape(-1, k) for x in cap.get(f"ffn_moe_weights-{il}")]) for il in moe_layers]
    full.close()
    del cap
    if reference is not None:
        ref = Scorer(reference, chunk, threads)
        for c in chunks:
            ref_logp.append(log_softmax(ref.logits(c)))
            bar.update(1)
        ref.close()

    # 2. candidates
    cands: list[tuple[str, str, Policy]] = [(f"r={r}", "fixed", replace(Policy.fixed(r), phase="decode"))
                                            for r in fixed_r]
    seen: set[tuple[float, float]] = set()
    for alpha in alphas:
        for level in levels:
            theta = theta_for_level(weights, alpha, level, r_min, k)
            if (theta, alpha) in seen:
                continue
            seen.add((theta, alpha))
            cands.append((f"umia a={alpha:g} ~r{level:g}", "umia",
                          Policy(theta=theta, alpha=alpha, beta=beta, r_min=r_min, phase="decode")))
    # below a mean r of 1: critical experts only in the shallower layers (the deeper ones skip the residual path
    # and its per-layer set-up cost entirely), with one or ~1.5 critical experts there
    for cut in cutoffs:
        for level in (1.0, 1.5):
            if level >= k:
                continue
            theta = theta_for_level(weights, 0.0, level, r_min, k, depth_cutoff=cut)
            cands.append((f"umia cutoff={cut:g} ~r{level:g}", "umia",
                          Policy(theta=theta, beta=beta, depth_cutoff=cut, r_min=r_min, phase="decode")))

    # 3. evaluate, then refine alpha around the best UMIA candidate at its own cost level (pattern search)
    evals: list[Evaluation] = []
    scorer = Scorer(wq_path, chunk, threads, residual_path=wr_path, verify_residual=False)
    for label, kind, pol in cands:
        evals.append(evaluate(scorer, label, kind, pol, chunks, ref_logp, latency, bar))
    if refine and any(e.kind == "umia" for e in evals):
        evals += _refine(scorer, evals, weights, chunks, ref_logp, latency, budget_ms, beta, r_min, k, bar)
    scorer.close()
    if drop_r:
        dropper = Scorer(wq_path, chunk, threads, residual_path=wr_path, verify_residual=False,
                          skip_noncritical=True)
        for r in drop_r:
            evals.append(evaluate(dropper, f"drop r={r}", "drop", replace(Policy.fixed(r), phase="decode"),
                                   chunks, ref_logp, latency, bar))
        dropper.close()

    # 4. frontier and choice (fixed r and UMIA; drop is shown, never chosen)
    idx = [i for i, e in enumerate(evals) if e.kind in ("fixed", "umia")]
    lat, kl = [e.predicted_ms for e in evals], [e.kl_mean for e in evals]
    front = [idx[j] for j in pareto([lat[i] for i in idx], [kl[i] for i in idx])]
    chosen = choose(lat, kl, budget_ms, idx)
    pick = evals[chosen]

    # 5. beta (prefill): the chosen policy at each beta, with prefill thresholds, scored on the chunks as prompts
    beta_note = "fixed r: beta does not change it" if pick.policy.is_fixed else ""
    if betas and not pick.policy.is_fixed:
        bar.total += len(betas) * len(chunks)
        pre = Scorer(wq_path, chunk, threads, residual_path=wr_path, verify_residual=False)
        b_evals = [evaluate(pre, f"beta={b:g} (prefill)", "beta", replace(pick.policy, beta=b, phase="prefill"),
                            chunks, ref_logp, latency, bar, phase="prefill") for b in betas]
        pre.close()
        b_pick, beta_note = choose_beta(b_evals, prefill_budget_ms)
        beta = b_pick.policy.beta
        evals += b_evals
    bar.close()
    pick.policy = replace(pick.policy, beta=beta, phase="auto", meta={
        "calibrated_on": str(text_path), "tokens": len(chunks) * chunk, "chunk": chunk, "seed": seed,
        "reference": str(reference) if reference else "r=k", "kl_mean": pick.kl_mean,
        "predicted_decode_ms": pick.predicted_ms, "budget_ms": budget_ms, "model": str(wq_path),
        "beta_choice": beta_note, "prefill_budget_ms": prefill_budget_ms,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")})
    settings = {"wq": str(wq_path), "wr": str(wr_path), "text": str(text_path), "reference": str(reference or "r=k"),
                "tokens": len(chunks) * chunk, "chunk": chunk, "seed": seed, "alphas": list(alphas),
                "levels": list(levels), "beta": beta, "betas": list(betas or ()), "beta_choice": beta_note,
                "r_min": r_min, "latency_model": latency.to_dict()["decode"],
                "command": command, "title": f"UMIA calibration: {Path(wq_path).name}, {Path(text_path).name}"}
    return CalibrationResult(evals, front, chosen, budget_ms, settings)


def choose_beta(evals: list[Evaluation], budget_ms: float | None) -> tuple[Evaluation, str]:
    """The prefill choice among the chosen policy's beta variants: the lowest prompt-phase KL within the prefill
    budget, else the knee of their (cost, KL) frontier. Cost: the latency model's prefill ms/token, or the critical
    slots per token where it has no prefill terms (said in the note)."""
    priced = all(np.isfinite(e.predicted_ms) for e in evals)
    cost = [e.predicted_ms if priced else e.critical_per_token for e in evals]
    kl = [e.kl_mean for e in evals]
    i = choose(cost, kl, budget_ms if priced else None, list(range(len(evals))))
    how = ("lowest prompt KL within the prefill budget" if budget_ms is not None and priced else
           "knee of prompt KL vs predicted prefill ms/token" if priced else
           "knee of prompt KL vs critical slots per token (no prefill terms in the latency model)")
    return evals[i], f"beta {evals[i].policy.beta:g}: {how}"


def _refine(scorer: Scorer, evals: list[Evaluation], weights: list[np.ndarray], chunks: list[list[int]],
            ref_logp: list[np.ndarray], latency: LatencyModel, budget_ms: float | None, beta: float, r_min: int,
            k: int, bar: tqdm) -> list[Evaluation]:
    """Around the best UMIA candidate (lowest KL within the budget, or its level's best without one), try alpha
    +- 0.1 then +- 0.05 at the same target mean r (theta re-found by bisection); keep whatever lowers the KL."""
    umia = [e for e in evals if e.kind == "umia" and (budget_ms is None or e.predicted_ms <= budget_ms)]
    if not umia:
        return []
    best = min(umia, key=lambda e: e.kl_mean) if budget_ms is not None else evals[
        choose([e.predicted_ms for e in evals], [e.kl_mean for e in evals], None,
               [i for i, e in enumerate(evals) if e.kind == "umia"])]
    n = len(best.mean_r)
    kept = [r for m, r in enumerate(best.mean_r) if m / max(n - 1, 1) <= best.policy.depth_cutoff + 1e-9]
    level = float(np.mean(kept))
    tried = {(e.policy.theta, e.policy.alpha) for e in evals if e.kind == "umia"}
    out: list[Evaluation] = []
    bar.total += 4 * len(chunks)
    for step in (0.1, 0.05):
        for sign in (-1, 1):
            alpha = round(best.policy.alpha + sign * step, 2)
            if not 0.0 <= alpha <= 2.0:
                continue
            theta = theta_for_level(weights, alpha, level, r_min, k, depth_cutoff=best.policy.depth_cutoff)
            if (theta, alpha) in tried:
                continue
            tried.add((theta, alpha))
            e = evaluate(scorer, f"refine a={alpha:g} ~r{level:.2f}", "umia",
                         Policy(theta=theta, alpha=alpha, beta=beta, r_min=r_min, phase="decode",
                                depth_cutoff=best.policy.depth_cutoff), chunks, ref_logp, latency, bar)
            out.append(e)
            if e.kl_mean < best.kl_mean and (budget_ms is None or e.predicted_ms <= budget_ms):
                best = e
    return out


def price(latency: LatencyModel, h: Any, phase: str = "decode") -> float:
    """The latency model's ms/token for a realised r histogram: per layer when it has a device part (the max of
    overlapped stages needs each layer's own r), else from the summed critical slots and active layers; nan when
    the model has no terms for the phase."""
    try:
        if latency.device is not None:
            return latency.predict_layers_ms(h.mean_r(), h.active_share(), phase)
        return latency.predict_ms(h.critical_slots_per_token(), h.active_layers_per_token(), phase)
    except RapidMoEError:
        return float("nan")


def evaluate(scorer: Scorer, label: str, kind: str, pol: Policy, chunks: list[list[int]],
              ref_logp: list[np.ndarray], latency: LatencyModel, bar: tqdm, phase: str = "decode") -> Evaluation:
    scorer.llm.set_policy(pol)
    scorer.llm.r_histogram(reset=True)
    kls = []
    agree = []
    for c, lp in zip(chunks, ref_logp, strict=True):
        lg = scorer.logits(c)
        kls.append(_kl(lp, lg))
        agree.append(lp.argmax(-1) == lg.argmax(-1))
        bar.update(1)
    h = scorer.llm.r_histogram()
    kl = np.concatenate(kls)
    crit, active = h.critical_slots_per_token(), h.active_layers_per_token()
    ms = price(latency, h, phase) if kind != "drop" else latency.predict_drop_ms(crit, active)
    return Evaluation(label, kind, pol, float(kl.mean()), float(np.quantile(kl, 0.99)),
                      float(np.concatenate(agree).mean()), crit, [round(float(x), 3) for x in h.mean_r()], ms)
