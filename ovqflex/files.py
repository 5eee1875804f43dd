"""Small file helpers shared by training, evaluation and experiments."""
from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``.<name>.tmp-<pid>`` beside ``path`` and rename it into place, so a
    reader (or a crash) never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
