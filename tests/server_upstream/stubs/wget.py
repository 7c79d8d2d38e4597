"""Stand-in for the `wget` package the suite's utils.py imports, used only where it is not installed.

The suite calls wget.download only to fetch models, and run.py switches model downloads off (nothing can be
downloaded here), so a call is an error that says so.
"""
from __future__ import annotations


def download(url: str, out: str | None = None) -> str:
    raise RuntimeError(f"wget stub: downloads are off in this run ({url} -> {out})")
