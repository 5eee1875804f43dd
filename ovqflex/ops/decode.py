"""What the decode paths of the softmax ops share (docs/design.md §6): absolute positions and the
split of new tokens at chunk boundaries."""
from __future__ import annotations

import torch
from torch import Tensor


def positions(start: int | Tensor, n: int, device) -> Tensor:
    """Absolute positions ``[n]`` int64 of the tokens ``start .. start+n-1``; ``start`` an int or
    a 0-d int64 tensor (a static cache's position: no host sync)."""
    if isinstance(start, Tensor):
        return start + torch.arange(n, device=device)
    return torch.arange(start, start + n, device=device)


def chunk_segments(start: int, n: int, chunk_size: int) -> list[tuple[int, int]]:
    """Split tokens ``start .. start+n-1`` at chunk boundaries: ``[(offset, length), ...]``
    (offsets relative to ``start``)."""
    out, i = [], 0
    while i < n:
        take = min(n - i, chunk_size - (start + i) % chunk_size)
        out.append((i, take))
        i += take
    return out
