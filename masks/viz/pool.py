"""Pool a label grid into fewer tiles for display, without hiding visible cells.

A tile shows the label of highest priority among its cells (``prio[label]``, lower
wins), so one visible cell in a tile of masked ones still shows — what a reader of a
64k-token view needs, and what a plain image resampling would lose.
"""
from __future__ import annotations

import torch
from torch import Tensor


def pool_labels(labels: Tensor, max_rows: int, max_cols: int, prio: Tensor) -> Tensor:
    """``labels [R, C]`` (small ints) -> ``[ceil(R / tr), ceil(C / tc)]`` with tiles of
    ``tr x tc`` cells, the smallest tiles giving at most ``max_rows x max_cols``.
    ``prio``: ``[n_labels]``, a permutation of ``0..n_labels-1``."""
    R, C = labels.shape
    if R <= max_rows and C <= max_cols:
        return labels
    tr, tc = -(-R // max_rows), -(-C // max_cols)
    rank = prio[labels.long()]
    padded = torch.full((-(-R // tr) * tr, -(-C // tc) * tc), int(prio.max()), dtype=rank.dtype)
    padded[:R, :C] = rank
    pooled = padded.view(padded.shape[0] // tr, tr, padded.shape[1] // tc, tc).amin(dim=(1, 3))
    return torch.argsort(prio)[pooled].to(labels.dtype)


def token_priority(n_labels: int) -> Tensor:
    """Label ``k >= 1`` ranks ``k - 1``; ``masked`` (0) ranks last."""
    return torch.tensor([n_labels - 1, *range(n_labels - 1)])


BLOCK_PRIORITY = torch.tensor([2, 1, 0])  # full wins, then partial, then empty
