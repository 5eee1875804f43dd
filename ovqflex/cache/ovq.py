"""Decode cache of OVQ-attention (docs/design.md §4.2, §6).

Holds the routing dictionary as fp32 running sums and counts — exactly what routing
keeps — plus the unit keys and values of the current, incomplete chunk. The prefill and
decode steps that fill it are :mod:`ovqflex.ops.ovq_decode`.

Bound: ``B*H*(N+1)*(D+Dv+1)`` fp32 for the dictionary (``N`` = ``max_centroids``) plus fewer
than ``chunk_size`` raw tokens, whatever the context. The dictionary is allocated for the rows
the next chunk can fill (``N_{c+1}``, never more than the tokens seen) and grows by doubling,
capped at ``N``: a huge ``max_centroids`` costs only what is used.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import LayerCache


@dataclass
class OVQCache(LayerCache):
    """key_sums ``[B, H, S+1, D]``, value_sums ``[B, H, S+1, Dv]``, counts ``[B, H, S+1]`` fp32
    (``S <= max_centroids`` rows allocated so far; row ``S`` a spare that collects nothing);
    buf_k ``[B, H, b, D]`` unit keys and buf_v ``[B, H, b, Dv]`` of the ``b < chunk_size`` tokens
    of the current chunk; rng: the random seeding generator's state (``seeding="random"``), else
    None; max_centroids: the dictionary cap ``N`` the cache was made for."""

    key_sums: Tensor
    value_sums: Tensor
    counts: Tensor
    buf_k: Tensor
    buf_v: Tensor
    rng: Tensor | None
    max_centroids: int

    @property
    def rows(self) -> int:
        """Dictionary rows allocated (the spare excluded)."""
        return self.key_sums.shape[2] - 1
