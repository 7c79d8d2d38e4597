"""Importance-matrix collection with our own build: the model runs over calibration text through rapidmoe.Llama
with an eval callback in rapidmoe._core that accumulates llama-imatrix's statistics (sum of squared inputs per
weight column, per expert). The result is a resplit.imatrix.Imatrix; write_imatrix saves it in llama.cpp's GGUF
imatrix layout, so `llama-quantize --imatrix` reads it too.
"""
from __future__ import annotations

import logging
import os

from tqdm import tqdm

from ..errors import ModelFileError
from ..resplit.imatrix import Imatrix

log = logging.getLogger(__name__)


def collect_imatrix(model_path: str | os.PathLike[str], text: str, *, n_ctx: int = 512, max_chunks: int | None = None,
                    n_threads: int | None = None, progress: bool = True, dataset: str = "text") -> Imatrix:
    """Run the model over `text` in chunks of n_ctx tokens and collect llama-imatrix statistics."""
    from .._runtime import _core  # noqa: PLC0415  (compiled part, loaded on first use)
    from ..llama import Llama  # noqa: PLC0415  (rapidmoe.llama loads the compiled part on import)

    collector = _core.ImatrixCollector()
    llm = Llama(model_path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=n_threads,
                n_threads_batch=n_threads, logits_all=True, verbose=False, eval_callback=collector)
    try:
        tokens = llm.tokenize(text.encode(), add_bos=False, special=False)
        n_chunks = len(tokens) // n_ctx
        if max_chunks is not None:
            n_chunks = min(n_chunks, max_chunks)
        if n_chunks == 0:
            raise ModelFileError(f"calibration text has {len(tokens)} tokens; need at least n_ctx={n_ctx}")
        for i in tqdm(range(n_chunks), desc="imatrix", unit="chunk", disable=not progress):
            llm.reset()
            llm._ctx.kv_cache_clear()
            llm.eval(tokens[i * n_ctx: (i + 1) * n_ctx])
    finally:
        llm.close()
    im = Imatrix(datasets=[dataset], chunk_count=n_chunks, chunk_size=n_ctx)
    for name in collector.names():
        s, c = collector.get(name)
        im.in_sum2[name], im.counts[name] = s, c
    log.info("imatrix: %d matrices from %d chunks of %d tokens", len(im.in_sum2), n_chunks, n_ctx)
    return im
