"""VQ-attention's decode path (docs/design.md §4.4, §6), shared by ``VQAttention`` and ``LongVQBlock``:
the fields of a :class:`~ovqflex.cache.VQCache` after a prefill, and decode steps from it. When a
query chunk starts, the oldest window chunk moves into the per-code counts and value sums and is
dropped.
"""
from __future__ import annotations

import torch
from torch import Tensor

from masks.regions import BlockWindow, token_visibility

from ..attention import attend_rows
from ..cache.vq import VQCache
from .decode import chunk_segments, positions

WINDOW_CHUNKS = 2  # chunks c-1 and c are read as tokens (recurrences.vq.state.LAG)


def _absorb(counts: Tensor, value_sums: Tensor, codes: Tensor, v: Tensor) -> None:
    counts.scatter_add_(2, codes, torch.ones_like(codes, dtype=counts.dtype))
    value_sums.scatter_add_(2, codes[..., None].expand(*codes.shape, v.shape[-1]), v.float())


def vq_prefill(k_hat: Tensor, v: Tensor, codes: Tensor, n_codes: int, chunk_size: int) -> dict:
    """The VQ fields of the cache after a full forward over quantized keys ``k_hat``, v, codes
    ``[B, H, T, *]`` (a dict: the layer adds ``conv`` and what a :class:`VQCache` subclass holds)."""
    B, H, T, _ = k_hat.shape
    last = (T - 1) // chunk_size
    start = max(0, (last - WINDOW_CHUNKS + 1) * chunk_size)
    counts = torch.zeros(B, H, n_codes, device=v.device)
    value_sums = torch.zeros(B, H, n_codes, v.shape[-1], device=v.device)
    _absorb(counts, value_sums, codes[:, :, :start], v.detach()[:, :, :start])
    return dict(position=T, counts=counts, value_sums=value_sums, state_chunk=last,
                win_k=k_hat.detach()[:, :, start:], win_v=v.detach()[:, :, start:], win_codes=codes[:, :, start:])


def vq_decode(cache: VQCache, q_scaled: Tensor, k_hat: Tensor, v: Tensor, codes: Tensor, code_keys: Tensor,
              state_bias: Tensor | None, chunk_size: int) -> tuple[Tensor, dict]:
    """New tokens (``q_scaled = beta * q̂``, quantized keys, values, codes ``[B, H, T2, *]``) ->
    outputs ``[B, H, T2, Dv]`` and the new cache's VQ fields (the layer adds the others). ``code_keys`` ``[H, N, D]`` unit
    codebook; ``state_bias`` ``[H]`` added to the state rows' scores (LongVQ's local bias,
    folded as in :func:`ovqflex.vq_attention`), or None."""
    B, H, T2, _ = q_scaled.shape
    counts, value_sums, copied = cache.counts, cache.value_sums, False
    win = dict(k=cache.win_k, v=cache.win_v, codes=cache.win_codes)
    pos, state_chunk, outs = cache.position, cache.state_chunk, []
    for off, take in chunk_segments(pos, T2, chunk_size):
        c = pos // chunk_size
        if c > state_chunk and c >= WINDOW_CHUNKS:  # chunk c - 2 leaves the window for the state
            if not copied:  # the given cache stays valid (copy on write)
                counts, value_sums, copied = counts.clone(), value_sums.clone(), True
            _absorb(counts, value_sums, win["codes"][:, :, :chunk_size], win["v"][:, :, :chunk_size])
            win = {name: t[:, :, chunk_size:] for name, t in win.items()}
        state_chunk = c
        new = dict(k=k_hat, v=v, codes=codes)
        win = {name: torch.cat([win[name], new[name][:, :, off:off + take].detach()], dim=2) for name in win}
        w = win["k"].shape[2]
        bias = torch.where(counts > 0, counts.log(), float("-inf"))
        if state_bias is not None:
            bias = bias - state_bias.float().view(1, H, 1)
        keys = (code_keys.float().expand(B, -1, -1, -1), win["k"].float())  # parts: the codebook is not copied
        values = (value_sums / counts.clamp_min(1.0)[..., None], win["v"].float())
        bias = torch.cat([bias, bias.new_zeros(B, H, w)], dim=2)
        q_pos, kv_pos = positions(pos, take, v.device), positions(pos + take - w, w, v.device)
        visible = torch.cat([torch.ones(take, counts.shape[2], dtype=torch.bool, device=v.device),
                             token_visibility((BlockWindow(WINDOW_CHUNKS, chunk_size),), q_pos, kv_pos)], dim=1)
        outs.append(attend_rows(q_scaled[:, :, off:off + take], keys, values, visible, scale=1.0, bias=bias))
        pos += take
    fields = dict(position=pos, counts=counts, value_sums=value_sums, state_chunk=state_chunk, win_k=win["k"],
                  win_v=win["v"], win_codes=win["codes"])
    return torch.cat(outs, dim=2).to(v.dtype), fields
