"""What the decode paths of the softmax ops share (docs/design.md §6): absolute positions, the
split of new tokens at chunk boundaries, and the slots of the static caches' token buffers (rings)."""
from __future__ import annotations

import torch
from torch import Tensor

from masks.regions import token_visibility


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


def slotted(t: Tensor, size: int, slots: Tensor) -> Tensor:
    """Token rows t ``[B, H, n, *]`` placed at ``slots`` ``[n]`` of a zero ``[B, H, size, *]`` buffer
    (a static cache's ring, made from a functional cache's tokens)."""
    return t.new_zeros(*t.shape[:2], size, *t.shape[3:]).index_copy_(2, slots, t)


def slot_positions(pos: Tensor, size: int, slots: Tensor) -> Tensor:
    """``[size]`` int64: the absolute positions ``pos`` ``[n]`` at their ``slots``, -1 (empty) elsewhere."""
    return torch.full((size,), -1, dtype=torch.long, device=pos.device).index_copy_(0, slots, pos)


def slot_visibility(regions, p: Tensor, pos: Tensor) -> Tensor:
    """``[S]`` bool: the filled slots (positions ``pos`` ``[S]``, -1 empty) that the query at position
    ``p`` ``[1]`` sees through ``regions``."""
    return token_visibility(regions, p, pos)[0] & (pos >= 0)
