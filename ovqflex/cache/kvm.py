"""Decode cache of KVM (docs/design.md §4.3, §6).

Holds the routing state (fp32 row sums of the gated memory keys — what routing
keeps), the gated value sums, founder radii and row counts, and the raw tokens of the
block window. The prefill and decode steps that fill it are :mod:`ovqflex.ops.kvm_decode`.
While decoding, it also keeps the read form of the live state rows (``LN_s`` keys times
``tau_state``, values: a :class:`~ovqflex.cache.base.StateView`), derived once per chunk instead
of once per token.

Bound: the state rows (``max(C, C * max_state_chunks)`` when capped; an uncapped
budget grows as its schedule says) times ``(2D + Dv + 2)`` fp32, plus at most
``Nb`` chunks of raw tokens, and while decoding the read form of the live rows
(``(D + Dv)`` fp32 each).

:class:`StaticKVMCache` is its in-place form (docs/design.md §6, "Static decode"): the state
allocated once at the most rows the capacity reaches, the window a ring of ``Nb`` chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import LayerCache, StateView, StaticLayerCache


@dataclass
class KVMCache(LayerCache):
    """state ``[B, H, R, D]`` fp32 row sums of gated memory keys (the routing state),
    value_sums ``[B, H, R, Dv]`` fp32, radius ``[B, H, R]`` (founder ``||v||``), counts
    ``[B, H, R]``; ``rows`` live rows, ``state_chunk`` the query chunk whose state this is
    (-1: none yet). Window: win_k ``[B, H, w, D]`` (normalized, rotated), win_v, win_kbar
    fp32 memory keys, win_gate ``[B, H, w]`` fp32, of tokens ``position - w .. position - 1``;
    view: the read form of the ``rows`` live rows (None until a decode step derives it, or when it
    read parameters with gradients; dropped when a chunk is absorbed)."""

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
    view: StateView | None = None


@dataclass
class StaticKVMCache(StaticLayerCache):
    """state ``[B, H, R, D]``, value_sums ``[B, H, R, Dv]``, radius, counts ``[B, H, R]`` fp32 as
    :class:`KVMCache` (``R``: the most rows any chunk up to the capacity reads, plus the spare row
    of the static routing step, never live); rows ``[n_chunks]``
    int64: the state rows query chunk ``c`` reads (0 for ``c < Nb``). Window ring of ``W = Nb * C``
    slots, position ``p`` in slot ``p % W``: win_k ``[B, H, W, D]`` (normalized, rotated), win_v
    ``[B, H, W, Dv]``, win_kbar ``[B, H, W, D]`` fp32, win_gate ``[B, H, W]`` fp32, win_pos ``[W]``
    int64 (-1: empty). position ``[]`` int64 and conv as :class:`~ovqflex.cache.base.StaticLayerCache`."""

    state: Tensor
    value_sums: Tensor
    radius: Tensor
    counts: Tensor
    rows: Tensor
    win_k: Tensor
    win_v: Tensor
    win_kbar: Tensor
    win_gate: Tensor
    win_pos: Tensor
