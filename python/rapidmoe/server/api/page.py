"""The chat page (server/web/, shipped in the wheel as package data) and the figures it shows (/rapidmoe/stats)."""
from __future__ import annotations

import importlib.resources
from typing import Any

from .. import metrics
from ..errors import not_found
from .serving import AppState, Reply, Request, json_reply

WEB_FILES = {"/": ("index.html", "text/html; charset=utf-8"), "/index.html": ("index.html", "text/html; charset=utf-8"),
             "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
             "/static/markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
             "/static/style.css": ("style.css", "text/css; charset=utf-8")}


def web_file(st: AppState, req: Request) -> Reply:
    """The chat page (server/web/, shipped in the wheel as package data; no build step)."""
    if not st.config.ui:
        raise not_found("File Not Found")  # --no-ui, as llama-server
    name, content_type = WEB_FILES[req.path.split("?", 1)[0]]
    data = (importlib.resources.files("rapidmoe.server") / "web" / name).read_bytes()
    return Reply(200, data, content_type, headers={"Cache-Control": "no-cache"})


def stats(st: AppState, req: Request) -> Reply:
    """GET /rapidmoe/stats, for the page: the model, generation counters and, for a RESplit model, the share of
    critical expert slots and the per-layer r histogram (both phases) since start."""
    e = st.engine
    assert e is not None
    llm = e.llm
    out: dict[str, Any] = {"model": st.config.model_id, "slots": e.n_parallel, "busy": e.n_busy,
                           "tokens_predicted": e.stats.predicted_tokens,
                           "predicted_tokens_seconds": (e.stats.predicted_tokens / e.stats.predicted_seconds
                                                        if e.stats.predicted_seconds else 0.0),
                           "split": getattr(llm, "residual", None) is not None}
    if out["split"]:
        hist, snap = e.call(lambda: (llm.r_histogram(), metrics.snapshot(llm)))
        counts = hist.counts.sum(axis=1)
        out.update({"k": hist.k, "expert_slots": snap.moe_slots, "critical_slots": snap.moe_critical_slots,
                    "critical_fraction": snap.moe_critical_slots / snap.moe_slots if snap.moe_slots else 0.0,
                    "layers": [{"layer": il, "counts": [int(x) for x in counts[m]], "mean_r": float(r)}
                               for m, (il, r) in enumerate(zip(hist.layers, hist.mean_r(), strict=True))]})
    return json_reply(out)
