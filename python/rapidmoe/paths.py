"""Where RapidMoE finds its shipped data and keeps its cache.

Only locations; nothing here builds or loads anything.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

_PKG_DIR = Path(__file__).resolve().parent
_REPO_ROOT = _PKG_DIR.parent.parent  # python/rapidmoe -> repo root (source checkouts only)


def cache_dir() -> Path:
    """RAPIDMOE_CACHE, else $XDG_CACHE_HOME/rapidmoe, else ~/.cache/rapidmoe (created on demand)."""
    base = os.environ.get("RAPIDMOE_CACHE")
    if base:
        path = Path(base)
    else:
        path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rapidmoe"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _installed_dir() -> Path | None:
    """The folder holding the compiled parts (differs from this file's folder in editable installs)."""
    spec = importlib.util.find_spec("rapidmoe._core")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).resolve().parent


def vocab_dir() -> Path:
    """Folder with llama.cpp's vocab-only GGUFs (shipped in the wheel; the vendor tree in a checkout)."""
    candidates: list[Path] = []
    if os.environ.get("RAPIDMOE_VOCAB_DIR"):
        candidates.append(Path(os.environ["RAPIDMOE_VOCAB_DIR"]))
    candidates.append(_PKG_DIR / "data" / "vocab")
    installed = _installed_dir()
    if installed is not None:
        candidates.append(installed / "data" / "vocab")
    candidates.append(_REPO_ROOT / "vendor" / "llama.cpp" / "models")
    for c in candidates:
        if (c / "ggml-vocab-qwen2.gguf").exists():
            return c
    raise FileNotFoundError(
        "no vocab-only GGUFs found (looked in: " + ", ".join(str(c) for c in candidates)
        + "); reinstall rapidmoe or set RAPIDMOE_VOCAB_DIR")
