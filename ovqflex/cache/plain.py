"""Decode cache of the plain layers (full causal, token / block windows, sinks).

Keeps the rotated keys and values of the tokens a later query can still see, with
their absolute positions; the prefill and decode steps that fill it are
:mod:`ovqflex.ops.plain_decode`. Bound: full attention keeps every token (the baseline's
KV cache grows with the context); a token window ``w`` keeps at most ``w - 1``
tokens plus the sinks; a block window of ``Nb`` chunks at most ``Nb * C`` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import LayerCache


@dataclass
class PlainCache(LayerCache):
    """k ``[B, H, S, D]`` (RoPE'd, normalized as the layer scores them), v ``[B, H, S, Dv]``,
    pos ``[S]`` int64 absolute positions of the kept tokens."""

    k: Tensor
    v: Tensor
    pos: Tensor
