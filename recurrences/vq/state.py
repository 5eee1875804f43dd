"""Differentiable VQ-attention state (docs/design.md §4.4, §5 "Snapshots").

Query chunk ``c`` reads, for every code ``n``, the tokens of chunks ``< c−1`` assigned to
it: key row = mean of their quantized keys (forward value: the code itself), value row =
running mean of their values, count (bias ``log(count)``, ``-inf`` when 0). A token of
chunk ``ct`` therefore enters the snapshots of chunks ``c >= ct + 2`` — the shared segment
sums of :mod:`recurrences.segments` with ``lag=2``. Since every token of a code has the
same quantized key, ``count · exp(<q, code>)`` reproduces the sum of their ``exp`` scores:
the linear form equals the quadratic form exactly.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..compiling import size_max
from ..segments import Snapshots, segment_snapshot_sums
from ..versioned import Versioned, VersionPlan, versioned_means

LAG = 2  # a token of chunk ct is in the state of chunks >= ct + 2 (chunks c-1, c are the window)


def build_vq_snapshots(k_hat: Tensor, v: Tensor, codes: Tensor, *, chunk_size: int, n_codes: int) -> Snapshots:
    """k_hat ``[B, H, T, D]`` quantized keys, v ``[B, H, T, Dv]``, codes ``[B, H, T]`` (-1: none) -> per-code
    means, ``N = n_codes`` rows per chunk (live: ``N`` from chunk ``LAG`` on, else 0)."""
    T = k_hat.shape[2]
    n_chunks = size_max(1, -(-T // chunk_size))
    (ks, vs), counts = segment_snapshot_sums((k_hat, v), codes, chunk_size, n_chunks, n_codes, lag=LAG)
    denom = counts.clamp_min(1.0)[..., None]
    return Snapshots((ks / denom.to(ks.dtype)).to(k_hat.dtype), (vs / denom.to(vs.dtype)).to(v.dtype), counts,
                     vq_state_sizes(n_chunks, n_codes, k_hat.device))  # (fp16: divided in the fp32 sums)


def vq_state_sizes(n_chunks: int, n_codes: int, device=None) -> Tensor:
    """Rows chunk ``c`` reads, ``[n_chunks]`` int64: the whole codebook from chunk ``LAG`` on, none before
    (a tensor, so a symbolic ``n_chunks`` under dynamic shapes stays symbolic)."""
    return torch.where(torch.arange(n_chunks, device=device) >= LAG, n_codes, 0)


def build_vq_versioned(k_hat: Tensor, v: Tensor, codes: Tensor, plan: VersionPlan) -> Versioned:
    """The versioned layout (docs/design.md §5; ``plan.lag = LAG``) of the same per-code means and counts as
    :func:`build_vq_snapshots`: checkpoints plus one version row per token."""
    return versioned_means(k_hat, v, codes, plan)
