"""pytest plugin for llama.cpp's server tests run against the shim: no model downloads (load_all is a no-op)."""
from __future__ import annotations

import sys


def pytest_sessionstart(session) -> None:  # type: ignore[no-untyped-def]
    utils = sys.modules.get("utils")
    if utils is not None:
        utils.ServerPreset.load_all = staticmethod(lambda: None)
