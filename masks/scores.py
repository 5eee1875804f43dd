"""Score parts (``score_mod``s) of an attention program (docs/design.md §3.3).

The only additive score part a program carries is a per-kv-row bias: fp32, no
gradient, ``log(count)`` for count-weighted state rows, ``-inf`` for empty rows
and 0 for token rows. It is captured as a ``[B, H, KV]`` tensor indexed by
``kv_idx`` — never a ``[Q, KV]`` table. Scales and temperatures are folded into
q or k rows by the methods themselves, which keeps them exact and differentiable
on every backend.
"""
from __future__ import annotations

from torch import Tensor


def row_bias(bias: Tensor):
    """``score_mod`` adding ``bias[b, h, kv_idx]`` (``bias``: ``[B, H, KV]`` fp32)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b, h, kv_idx].to(score.dtype)

    return score_mod
