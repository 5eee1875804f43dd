"""Decode cache of OVQ-attention (docs/design.md §4.2, §6).

Holds the routing dictionary as fp32 running sums and counts — exactly what routing
keeps — plus the unit keys and values of the current, incomplete chunk. The prefill and
decode steps that fill it are :mod:`ovqflex.ops.ovq_decode`. While decoding, it also keeps the
read form of the ``N_c`` rows the current chunk reads (mean keys, mean values, ``log(count)``
bias: a :class:`~ovqflex.cache.base.StateView`), derived once per chunk instead of once per token.

Bound: ``B*H*(N+1)*(D+Dv+1)`` fp32 for the dictionary (``N`` = ``max_centroids``), as much
again for its read form while decoding, plus fewer than ``chunk_size`` raw tokens, whatever
the context. The dictionary is allocated for the rows
the next chunk can fill (``N_{c+1}``, never more than the tokens seen) and grows by doubling,
capped at ``N``: a huge ``max_centroids`` costs only what is used.

:class:`StaticOVQCache` is its in-place form (docs/design.md §6, "Static decode"): the dictionary
allocated once at the most rows the cache's capacity can reach, the current chunk in a fixed
``[B, H, chunk_size, *]`` buffer, and the sizes ``(N_c, N_{c+1})`` of every chunk as a device table.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import LayerCache, StateView, StaticLayerCache


@dataclass
class OVQCache(LayerCache):
    """key_sums ``[B, H, S+1, D]``, value_sums ``[B, H, S+1, Dv]``, counts ``[B, H, S+1]`` fp32
    (``S <= max_centroids`` rows allocated so far; row ``S`` a spare that collects nothing);
    buf_k ``[B, H, b, D]`` unit keys and buf_v ``[B, H, b, Dv]`` of the ``b < chunk_size`` tokens
    of the current chunk; rng: the random seeding generator's state (``seeding="random"``), else
    None; max_centroids: the dictionary cap ``N`` the cache was made for; view: the read form of
    the rows the current chunk reads (None until a decode step derives it; dropped when a chunk
    is absorbed)."""

    key_sums: Tensor
    value_sums: Tensor
    counts: Tensor
    buf_k: Tensor
    buf_v: Tensor
    rng: Tensor | None
    max_centroids: int
    view: StateView | None = None

    @property
    def rows(self) -> int:
        """Dictionary rows allocated (the spare excluded)."""
        return self.key_sums.shape[2] - 1


@dataclass
class StaticOVQCache(StaticLayerCache):
    """key_sums ``[B, H, S+1, D]``, value_sums ``[B, H, S+1, Dv]``, counts ``[B, H, S+1]`` fp32
    (``S``: the most rows any chunk up to the capacity reads; row ``S`` the spare); buf_v
    ``[B, H, L, Dv]`` fp32 values of the current chunk as given (what its absorb sums), slot ``j``
    holding token ``(position // L) * L + j`` (the first ``position % L`` slots are live);
    bounds ``[n_chunks, 2]`` int64 ``(N_c, N_{c+1})`` for ``c = 0 .. n_chunks - 1``;
    max_centroids: the dictionary cap ``N``. position ``[]`` int64 and conv as
    :class:`~ovqflex.cache.base.StaticLayerCache`.

    What a step reads, ``S + 1 + L`` rows (the dictionary's read form, then the chunk's slots):
    keys ``[B, H, S+1+L, D]`` (mean keys, then the chunk's fp32 unit keys — :attr:`chunk_keys`,
    what routing reads), values ``[B, H, S+1+L, Dv]`` with non-finite entries zeroed and
    nonfinite ``[B, H, S+1+L]`` their rows' flags (``ovqflex.attention.split_nonfinite``), bias
    ``[B, H, S+1+L]`` (``log(count)``, 0 for the chunk). The dictionary rows are derived once per
    chunk, when it is absorbed (the functional cache's view), not by every step."""

    key_sums: Tensor
    value_sums: Tensor
    counts: Tensor
    buf_v: Tensor
    bounds: Tensor
    keys: Tensor
    values: Tensor
    nonfinite: Tensor
    bias: Tensor
    max_centroids: int

    @property
    def chunk_keys(self) -> Tensor:
        """``[B, H, L, D]``: the current chunk's unit keys (a view of :attr:`keys`' last rows)."""
        return self.keys[:, :, self.key_sums.shape[2]:]
