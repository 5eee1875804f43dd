"""Task registry: ``TASKS`` and ``make_task``."""
from __future__ import annotations

import dataclasses
from typing import Any

from .assoc import MQAR, Copy
from .base import Task
from .icl import ICL
from .recall import ICR, NIAH, PICR
from .text import Text

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (ICR, PICR, ICL, MQAR, Copy, NIAH, Text)}


def make_task(name: str, **options: Any) -> Task:
    """Build task ``name`` (a key of ``TASKS``) with ``options`` overriding its defaults.

    ``ValueError`` for an unknown name or option; option values are checked by the
    task (``TypeError`` / ``ValueError`` naming the option).
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {sorted(TASKS)}")
    cls = TASKS[name]
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for task {name!r}; its options are {known}")
    return cls(**options)
