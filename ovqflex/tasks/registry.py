"""Task registry: ``TASKS`` and ``make_task``."""
from __future__ import annotations

import dataclasses
from typing import Any

from recurrences.checks import check_keys

from .assoc import MQAR, Copy
from .base import Task
from .icl import ICL
from .recall import ICR, NIAH, PICR
from .text import Text

TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (ICR, PICR, ICL, MQAR, Copy, NIAH, Text)}


def make_task(name: str, **options: Any) -> Task:
    """Build task ``name`` (a key of ``TASKS``) with ``options`` overriding its defaults.

    ``ValueError`` for an unknown name or option (with the nearest option suggested); option
    values are checked by the task (``TypeError`` / ``ValueError`` naming the option).
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; expected one of {sorted(TASKS)}")
    cls = TASKS[name]
    check_keys(f"task {name!r} options", options, [f.name for f in dataclasses.fields(cls)])
    return cls(**options)
