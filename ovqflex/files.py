"""Small file helpers shared by training, evaluation and experiments."""
from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``.<name>.tmp-<pid>`` beside ``path``, flush it to the disk and rename it
    into place, so a reader (or a crash, of the process or the machine) never sees a half-written
    file; a write that fails (a full disk, text the encoding cannot write) leaves ``path`` as it was
    and no temporary file behind."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
