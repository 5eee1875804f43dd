"""Decode cache of VQ-attention (docs/design.md §4.4, §6), shared by ``VQAttention`` and ``LongVQBlock``.

Query chunk ``c`` reads the codebook as state rows — ``log(count)`` of the codes used by
the tokens of chunks ``< c−1`` and the running mean of their values — and the quantized
keys of chunks ``c−1, c`` causally. The cache holds those per-code counts and value
sums (fp32) and the window tokens (quantized unit keys, values, codes). The prefill and
decode steps that fill it are :mod:`ovqflex.ops.vq_decode`.

Bound: ``B*H*N*(Dv+1)`` fp32 for the code statistics plus at most 2 chunks of tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import LayerCache


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
