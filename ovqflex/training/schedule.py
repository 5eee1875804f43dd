"""Schedules of a training run, pure functions of the step (so resuming needs no scheduler state):

- :func:`lr_at` -- the learning rate: linear warmup, then cosine decay to ``min_lr``;
- :func:`length_at` -- the context length: shorter lengths first (a length warm-up), then the
  run's ``seq_len``, at the same tokens per step.
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


def length_at(step: int, *, seq_len: int, lengths: tuple[int, ...], warmup_steps: int) -> int:
    """Context length of optimizer step ``step`` (0-based): during the first ``warmup_steps`` steps,
    split into ``n = len(lengths)`` equal shares (to within a step), ``lengths[step * n // warmup_steps]``
    (shorter than ``seq_len``, increasing); ``seq_len`` after them.
    A step at length ``L`` draws ``seq_len // L`` times the run's sequences (``TrainConfig`` wants ``L``
    to divide ``seq_len``): the same tokens per step at every length."""
    if step >= warmup_steps or not lengths:
        return seq_len
    return lengths[step * len(lengths) // warmup_steps]


def length_warmup_text(lengths: tuple[int, ...], warmup_steps: int) -> str:
    """How a run's length warm-up reads in a log or report: ``""`` without one, else e.g. ``" (first
    256, 512, 1,024 tokens over 1,500 steps)"``, to follow the training length."""
    if not lengths:
        return ""
    return f" (first {', '.join(f'{n:,}' for n in lengths)} tokens over {warmup_steps:,} steps)"
