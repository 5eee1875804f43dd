"""Learning-rate schedule: linear warmup, then cosine decay to ``min_lr``.

A pure function of the step, so resuming needs no scheduler state.
"""
from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``total``."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
