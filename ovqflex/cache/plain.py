"""Decode cache of the plain layers (full causal, token / block windows, sinks).

Keeps the rotated keys and values of the tokens a later query can still see, with
their absolute positions; the prefill and decode steps that fill it are
:mod:`ovqflex.ops.plain_decode`. Bound: full attention keeps every token (the baseline's
KV cache grows with the context); a token window ``w`` keeps at most ``w - 1``
tokens plus the sinks; a block window of ``Nb`` chunks at most ``Nb * C`` tokens.

:class:`StaticPlainCache` is its in-place form (docs/design.md §6, "Static decode"): the same
tokens in buffers of one fixed size — the sinks, then a ring of the window (``w`` tokens, or
``Nb * C``), or for full attention every position up to the capacity.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import LayerCache, StaticLayerCache


@dataclass
class PlainCache(LayerCache):
    """k ``[B, H, S, D]`` (RoPE'd, normalized as the layer scores them), v ``[B, H, S, Dv]``,
    pos ``[S]`` int64 absolute positions of the kept tokens."""

    k: Tensor
    v: Tensor
    pos: Tensor


@dataclass
class StaticPlainCache(StaticLayerCache):
    """k ``[B, H, S, D]``, v ``[B, H, S, Dv]``, pos ``[S]`` int64 (-1: an empty slot), written in
    place; ``S = n_sinks + ring``. Position ``p`` lives in slot ``p`` if ``p < n_sinks``, else
    ``n_sinks + (p - n_sinks) % ring`` (full attention: ``n_sinks = 0``, ``ring`` = the capacity).
    v holds the values with their non-finite entries zeroed and v_nonfinite ``[B, H, S]`` bool
    which rows held a NaN or inf (``ovqflex.attention.split_nonfinite``, done once per token when
    it is written, not by every step over the whole cache). position ``[]`` int64 and conv as
    :class:`~ovqflex.cache.base.StaticLayerCache`."""

    k: Tensor
    v: Tensor
    v_nonfinite: Tensor
    pos: Tensor
    n_sinks: int
    ring: int
