"""Writing an output file so that it is either complete or absent: a temporary name, then a rename."""
from __future__ import annotations

import os
from pathlib import Path


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
