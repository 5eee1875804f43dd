"""Decode cache of KVM (docs/design.md §4.3, §6).

Holds the routing state (fp32 row sums of the gated memory keys — what routing
keeps), the gated value sums, founder radii and row counts, and the raw tokens of the
block window. The prefill and decode steps that fill it are :mod:`ovqflex.ops.kvm_decode`.

Bound: the state rows (``max(C, C * max_state_chunks)`` when capped; an uncapped
budget grows as its schedule says) times ``(2D + Dv + 2)`` fp32, plus at most
``Nb`` chunks of raw tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import LayerCache


@dataclass
class KVMCache(LayerCache):
    """state ``[B, H, R, D]`` fp32 row sums of gated memory keys (the routing state),
    value_sums ``[B, H, R, Dv]`` fp32, radius ``[B, H, R]`` (founder ``||v||``), counts
    ``[B, H, R]``; ``rows`` live rows, ``state_chunk`` the query chunk whose state this is
    (-1: none yet). Window: win_k ``[B, H, w, D]`` (normalized, rotated), win_v, win_kbar
    fp32 memory keys, win_gate ``[B, H, w]`` fp32, of tokens ``position - w .. position - 1``."""

    state: Tensor
    value_sums: Tensor
    radius: Tensor
    counts: Tensor
    rows: int
    state_chunk: int
    win_k: Tensor
    win_v: Tensor
    win_kbar: Tensor
    win_gate: Tensor
