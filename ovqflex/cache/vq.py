"""Decode cache of VQ-attention (docs/design.md §4.4, §6), shared by ``VQAttention`` and ``LongVQBlock``.

Query chunk ``c`` reads the codebook as state rows — ``log(count)`` of the codes used by
the tokens of chunks ``< c−1`` and the running mean of their values — and the quantized
keys of chunks ``c−1, c`` causally. The cache holds those per-code counts and value
sums (fp32) and the window tokens (quantized unit keys, values, codes). The prefill and
decode steps that fill it are :mod:`ovqflex.ops.vq_decode`.

Bound: ``B*H*N*(Dv+1)`` fp32 for the code statistics plus at most 2 chunks of tokens.

:class:`StaticVQCache` (and :class:`StaticLongVQCache`) is its in-place form (docs/design.md §6,
"Static decode"): the same statistics, the window a ring of 2 chunks, and the read form of the code
rows, derived once per absorbed chunk.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import LayerCache, StaticLayerCache


@dataclass
class VQCache(LayerCache):
    """counts ``[B, H, N]`` and value_sums ``[B, H, N, Dv]`` fp32 of the tokens in the state;
    ``state_chunk``: the query chunk whose state this is; window: win_k ``[B, H, w, D]``
    quantized unit keys, win_v, win_codes ``[B, H, w]`` of tokens ``position - w ..``."""

    counts: Tensor
    value_sums: Tensor
    state_chunk: int
    win_k: Tensor
    win_v: Tensor
    win_codes: Tensor


@dataclass
class LongVQCache(VQCache):
    """A :class:`VQCache` plus the LongVQ block's damped-EMA state ``ema [B, hidden, ema_dim]`` fp32."""

    ema: Tensor


@dataclass
class StaticVQCache(StaticLayerCache):
    """counts ``[B, H, N]`` and value_sums ``[B, H, N, Dv]`` fp32 as :class:`VQCache`; the window a
    ring of ``W = 2 * chunk_size`` slots, position ``p`` in slot ``p % W``: win_k ``[B, H, W, D]``
    quantized unit keys, win_v ``[B, H, W, Dv]`` values as given (what an absorb sums), win_codes
    ``[B, H, W]`` int64, win_pos ``[W]`` int64 (-1: empty). What a step reads besides the codebook
    and win_k: values ``[B, H, N+W, Dv]`` fp32 (the code rows' mean values, then the ring's values,
    non-finite entries zeroed) with nonfinite ``[B, H, N+W]`` their rows' flags
    (``ovqflex.attention.split_nonfinite``), and bias ``[B, H, N]`` (``log(count)``, ``-inf`` for an
    unused code); the code rows' part is derived when a chunk is absorbed, the ring's when a token is
    written. position ``[]`` int64 and conv as :class:`~ovqflex.cache.base.StaticLayerCache`."""

    counts: Tensor
    value_sums: Tensor
    win_k: Tensor
    win_v: Tensor
    win_codes: Tensor
    win_pos: Tensor
    values: Tensor
    nonfinite: Tensor
    bias: Tensor


@dataclass
class StaticLongVQCache(StaticVQCache):
    """A :class:`StaticVQCache` plus the damped-EMA state ``ema [B, hidden, ema_dim]`` fp32."""

    ema: Tensor
