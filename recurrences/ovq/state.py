"""Differentiable OVQ snapshots (SPEC §4.2, §5 "Snapshots").

Given the routes, the dictionary chunk ``c`` reads is the mean of every key and
value routed before chunk ``c``: one scatter-add of the tokens into per-chunk
slot sums, an exclusive cumulative sum over chunks, a division by counts. No
Python loop on the gradient path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class OVQSnapshots:
    """Per-chunk snapshots, ``R`` rows each (``R`` = largest dictionary any chunk reads).

    keys ``[B, H, n_chunks, R, D]``, values ``[B, H, n_chunks, R, Dv]``,
    counts ``[B, H, n_chunks, R]`` fp32 (0 for empty rows), live ``[n_chunks]`` int64.
    """

    keys: Tensor
    values: Tensor
    counts: Tensor
    live: Tensor


def segment_snapshot_sums(x: Tensor, routes: Tensor, chunk: int, n_chunks: int, rows: int) -> tuple[Tensor, Tensor]:
    """Exclusive per-chunk prefix sums of ``x`` by slot.

    x ``[B, H, T, D]``, routes ``[B, H, T]`` (-1 or >= rows: ignored) ->
    sums ``[B, H, n_chunks, rows, D]`` over tokens of chunks ``< c``, and counts ``[B, H, n_chunks, rows]``.
    """
    B, H, T, D = x.shape
    slot = torch.where((routes >= 0) & (routes < rows), routes, rows)  # spare slot `rows` drops a token
    tok_chunk = torch.arange(T, device=x.device) // chunk
    # token t of chunk ct contributes to snapshots c > ct: add it at chunk ct + 1, then cumsum
    n_cells = (n_chunks + 1) * (rows + 1)
    bh = torch.arange(B * H, device=x.device).view(B, H, 1) * n_cells
    cell = (bh + (tok_chunk + 1).view(1, 1, T) * (rows + 1) + slot).reshape(-1)  # [B*H*T] global cell
    sums = x.new_zeros(B * H * n_cells, D).index_add(0, cell, x.reshape(B * H * T, D)).view(B, H, n_cells, D)
    counts = torch.zeros(B * H * n_cells, device=x.device).index_add(
        0, cell, torch.ones(B * H * T, device=x.device)).view(B, H, n_cells)
    sums = sums.view(B, H, n_chunks + 1, rows + 1, D)[:, :, :n_chunks, :rows].cumsum(2)
    counts = counts.view(B, H, n_chunks + 1, rows + 1)[:, :, :n_chunks, :rows].cumsum(2)
    return sums, counts


def build_ovq_snapshots(k: Tensor, v: Tensor, routes: Tensor, *, chunk: int, sizes: list[int],
                        normalize_centroids: bool = False) -> OVQSnapshots:
    """Snapshot of chunk ``c``: running means of the (unit) keys/values routed before it.

    k ``[B, H, T, D]`` unit keys, v ``[B, H, T, Dv]``, routes ``[B, H, T]``; ``sizes[c]``
    live rows for chunk c. ``normalize_centroids`` L2-normalizes the key rows at readout.
    """
    T = k.shape[2]
    n_chunks = -(-T // chunk)
    rows = max(sizes[:n_chunks])
    ks, counts = segment_snapshot_sums(k, routes, chunk, n_chunks, rows)
    vs, _ = segment_snapshot_sums(v, routes, chunk, n_chunks, rows)
    denom = counts.clamp_min(1.0)[..., None]
    keys, values = ks / denom.to(ks.dtype), vs / denom.to(vs.dtype)
    if normalize_centroids:
        keys = F.normalize(keys, dim=-1)
    live = torch.tensor(sizes[:n_chunks], dtype=torch.long, device=k.device)
    return OVQSnapshots(keys, values, counts, live)
