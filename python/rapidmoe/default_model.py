"""The embedded default model: a tiny synthetic qwen3moe GGUF, made on first use and cached.

`rapidmoe-cli run` without a model argument runs on it, so a fresh install can generate text offline.
"""
from __future__ import annotations

import logging
from pathlib import Path

from .paths import cache_dir, vocab_dir
from .synthetic import GENERATOR_VERSION, spec_for, write_model

log = logging.getLogger(__name__)

DEFAULT_ARCH = "qwen3moe"
DEFAULT_SIZE = "tiny"
DEFAULT_SEED = 0
FILE_VERSION = 2  # 2: carries a chat template (a cached file of an earlier version is not reused)


def default_model_path() -> Path:
    name = f"synthetic-{DEFAULT_ARCH}-{DEFAULT_SIZE}-s{DEFAULT_SEED}-g{GENERATOR_VERSION}-v{FILE_VERSION}.gguf"
    return cache_dir() / name


def ensure_default_model(progress: bool = True) -> Path:
    """Path of the default model, writing it first if it is not cached yet (a few seconds)."""
    path = default_model_path()
    if not path.exists():
        log.warning("making the default model %s (once)", path)
        write_model(spec_for(DEFAULT_ARCH, DEFAULT_SIZE, seed=DEFAULT_SEED), path, vocab_dir(), progress=progress)
    return path
