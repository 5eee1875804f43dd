"""VQ-attention's decode path (docs/design.md §4.4, §6), shared by ``VQAttention`` and ``LongVQBlock``:
the fields of a :class:`~ovqflex.cache.VQCache` after a prefill, and decode steps from it. When a
query chunk starts, the oldest window chunk moves into the per-code counts and value sums and is
dropped.

The static form (:class:`~ovqflex.cache.vq.StaticVQCache`, docs/design.md §6 "Static decode"): a step
(:func:`vq_decode_static`) writes the token into the window ring and reads every code row and ring
slot, the unused codes and the slots out of the window masked; when a query chunk ``c >= 2`` is next,
:func:`vq_static_boundary` (called by the host) absorbs chunk ``c - 2`` from the ring in place, with
the same :func:`_absorb`, and derives the code rows' read form anew.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from masks.regions import BlockWindow, token_visibility

from ..attention import attend_rows, split_nonfinite
from ..cache.vq import StaticVQCache, VQCache
from .decode import chunk_segments, positions, slot_positions, slot_visibility, slotted

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
    outputs ``[B, H, T2, Dv]`` and the new cache's VQ fields (the layer adds the others). ``code_keys``
    ``[H, N, D]`` unit codebook; ``state_bias`` ``[H]`` added to the state rows' scores (LongVQ's local bias,
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


def vq_static(cache: VQCache, static_type: type[StaticVQCache], chunk_size: int) -> StaticVQCache:
    """The ``static_type`` cache (:class:`StaticVQCache` or a subclass) continuing ``cache`` (not
    changed): the VQ state in its static layout, the conv tail and a subclass's own fields (LongVQ's
    ema) copied; if the next token starts a query chunk ``>= 2``, its absorb is done here."""
    B, H, N, Dv = cache.value_sums.shape
    own = {f.name for f in dataclasses.fields(static_type)} - {f.name for f in dataclasses.fields(StaticVQCache)}
    W, w, device = WINDOW_CHUNKS * chunk_size, cache.win_k.shape[2], cache.win_k.device
    pos = positions(cache.position - w, w, device)
    slots = pos % W
    clean, nonfinite = split_nonfinite(cache.win_v.float())
    static = static_type(position=torch.tensor(cache.position, device=device), counts=cache.counts.clone(),
                         value_sums=cache.value_sums.clone(), win_k=slotted(cache.win_k, W, slots),
                         win_v=slotted(cache.win_v, W, slots), win_codes=slotted(cache.win_codes, W, slots),
                         win_pos=slot_positions(pos, W, slots),
                         values=torch.cat([cache.value_sums.new_zeros(B, H, N, Dv), slotted(clean, W, slots)], dim=2),
                         nonfinite=torch.cat([nonfinite.new_zeros(B, H, N), slotted(nonfinite, W, slots)], dim=2),
                         bias=cache.counts.new_empty(B, H, N), conv=None if cache.conv is None else cache.conv.clone(),
                         **{name: getattr(cache, name).clone() for name in own})
    _derive_static_codes(static)
    vq_static_boundary(static, chunk_size, cache.position)
    return static


def _derive_static_codes(cache: StaticVQCache) -> None:
    """The code rows' read form from the statistics, in place: mean values (split for the
    non-finite rule) and ``log(count)`` bias, as :func:`vq_decode` derives them."""
    N = cache.counts.shape[2]
    clean, nonfinite = split_nonfinite(cache.value_sums / cache.counts.clamp_min(1.0)[..., None])
    cache.values[:, :, :N].copy_(clean)
    cache.nonfinite[:, :, :N].copy_(nonfinite)
    cache.bias.copy_(torch.where(cache.counts > 0, cache.counts.log(), float("-inf")))


def vq_decode_static(cache: StaticVQCache, q_scaled: Tensor, k_hat: Tensor, v: Tensor, codes: Tensor,
                     code_keys: Tensor, state_bias: Tensor | None, chunk_size: int) -> Tensor:
    """One new token (``q_scaled``, quantized key, value ``[B, H, 1, *]``, code ``[B, H, 1]``, at
    ``cache.position``) written into the ring, then reading every code row and the block window ->
    ``[B, H, 1, Dv]``; ``code_keys``, ``state_bias`` as :func:`vq_decode`. Fixed shapes, no host sync;
    the caller advances ``cache.position`` and calls :func:`vq_static_boundary`."""
    (B, H, N), W = cache.counts.shape, cache.win_pos.shape[0]
    p = cache.position.view(1)
    slot = p % W
    for name, t in (("win_k", k_hat), ("win_v", v), ("win_codes", codes)):
        getattr(cache, name).index_copy_(2, slot, t.detach())
    cache.win_pos.index_copy_(0, slot, p)
    clean, nonfinite = split_nonfinite(v.detach().float())
    cache.values.index_copy_(2, N + slot, clean)
    cache.nonfinite.index_copy_(2, N + slot, nonfinite)
    bias = cache.bias if state_bias is None else cache.bias - state_bias.float().view(1, H, 1)
    bias = torch.cat([bias, bias.new_zeros(B, H, W)], dim=2)
    window = slot_visibility((BlockWindow(WINDOW_CHUNKS, chunk_size),), p, cache.win_pos)
    visible = torch.cat([window.new_ones(N), window])
    keys = (code_keys.float().expand(B, -1, -1, -1), cache.win_k.float())
    values = cache.values.split([N, W], dim=2)
    out = attend_rows(q_scaled, keys, values, visible, scale=1.0, bias=bias, v_nonfinite=cache.nonfinite)
    return out.to(v.dtype)


def vq_static_boundary(cache: StaticVQCache, chunk_size: int, position: int) -> None:
    """After a static step left ``position`` tokens (counted on the host): if the next token starts a
    query chunk ``c >= 2``, absorb window chunk ``c - 2`` (still whole in the ring) into the code
    statistics in place and derive the code rows' read form anew."""
    c = position // chunk_size
    if position % chunk_size or c < WINDOW_CHUNKS:
        return
    start = (c - WINDOW_CHUNKS) * chunk_size % cache.win_pos.shape[0]
    chunk = slice(start, start + chunk_size)
    _absorb(cache.counts, cache.value_sums, cache.win_codes[:, :, chunk], cache.win_v[:, :, chunk])
    _derive_static_codes(cache)
