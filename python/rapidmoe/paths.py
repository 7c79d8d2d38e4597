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


def _shipped_dir(env: str, sub: str, upstream: str, probe: str) -> Path:
    """The first of: $ENV, the package's data/SUB (wheel; editable installs keep it beside the compiled parts),
    the vendor tree's UPSTREAM folder (source checkouts) that holds PROBE."""
    candidates: list[Path] = []
    if os.environ.get(env):
        candidates.append(Path(os.environ[env]))
    candidates.append(_PKG_DIR / "data" / sub)
    installed = _installed_dir()
    if installed is not None:
        candidates.append(installed / "data" / sub)
    candidates.append(_REPO_ROOT / "vendor" / "llama.cpp" / upstream)
    for c in candidates:
        if (c / probe).exists():
            return c
    raise FileNotFoundError(
        f"no {probe} found (looked in: " + ", ".join(str(c) for c in candidates)
        + f"); reinstall rapidmoe or set {env}")


def vocab_dir() -> Path:
    """Folder with llama.cpp's vocab-only GGUFs (shipped in the wheel; the vendor tree in a checkout)."""
    return _shipped_dir("RAPIDMOE_VOCAB_DIR", "vocab", "models", "ggml-vocab-qwen2.gguf")


def templates_dir() -> Path:
    """Folder with the chat templates the synthetic models carry (llama.cpp's models/templates, shipped in the
    wheel; the vendor tree in a checkout)."""
    return _shipped_dir("RAPIDMOE_TEMPLATES_DIR", "templates", "models/templates", "Qwen-Qwen3-0.6B.jinja")
