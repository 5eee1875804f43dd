"""Differentiable OVQ state: snapshots and the versioned layout (docs/design.md §4.2, §5).

Given the routes, the dictionary chunk ``c`` reads is the mean of every key and
value routed before chunk ``c``: the shared segment sums of
:mod:`recurrences.segments` divided by counts. No Python loop on the gradient path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..segments import Snapshots, segment_snapshot_sums
from ..versioned import Versioned, VersionPlan, versioned_means
from .routing import DictionarySchedule


def build_ovq_snapshots(k: Tensor, v: Tensor, routes: Tensor, *, schedule: DictionarySchedule,
                        normalize_centroids: bool = False) -> Snapshots:
    """Snapshot of chunk ``c``: running means of the (unit) keys/values routed before it.

    k ``[B, H, T, D]`` unit keys, v ``[B, H, T, Dv]``, routes ``[B, H, T]``; ``schedule``: the chunk
    size and ``schedule.size(c)``, the live rows of chunk c. ``normalize_centroids`` L2-normalizes the
    key rows at readout. Rows ``R`` = the largest dictionary any chunk reads; counts are the tokens per row.
    """
    T = k.shape[2]
    chunk_size = schedule.chunk_size
    n_chunks = -(-T // chunk_size)
    (ks, vs), counts = segment_snapshot_sums((k, v), routes, chunk_size, n_chunks, schedule.rows(n_chunks))
    denom = counts.clamp_min(1.0)[..., None]
    keys, values = (ks / denom.to(ks.dtype)).to(k.dtype), (vs / denom.to(vs.dtype)).to(v.dtype)  # (fp16: fp32 sums)
    if normalize_centroids:
        keys = F.normalize(keys, dim=-1)
    return Snapshots(keys, values, counts, schedule.live(n_chunks, k.device))


def build_ovq_versioned(k: Tensor, v: Tensor, routes: Tensor, plan: VersionPlan,
                        normalize_centroids: bool = False) -> Versioned:
    """Versioned rows of the OVQ dictionaries (``plan.lag = 1``): the same running means as
    :func:`build_ovq_snapshots`, per checkpoint and per version row (:mod:`recurrences.versioned`)."""
    ver = versioned_means(k, v, routes, plan)
    if normalize_centroids:
        ver.keys = F.normalize(ver.keys, dim=-1)
    return ver
