"""The plain layers' decode path (docs/design.md §6): the :class:`~ovqflex.cache.PlainCache` after a
prefill, and decode steps from it. New queries attend over the kept tokens and themselves with the
layer's regions; the cache keeps what a later query can still see (``token_visibility``). The static
form (:class:`~ovqflex.cache.plain.StaticPlainCache`, :func:`plain_decode_static`) keeps the same
tokens in fixed buffers written in place (docs/design.md §6, "Static decode")."""
from __future__ import annotations

import torch
from torch import Tensor

from masks.regions import BlockWindow, Causal, Sinks, TokenWindow, token_visibility

from ..attention import attend_rows, split_nonfinite
from ..cache.plain import PlainCache, StaticPlainCache
from .decode import positions, slot_positions, slot_visibility, slotted


def _kept(regions, k: Tensor, v: Tensor, pos: Tensor, end: int, conv: Tensor | None) -> PlainCache:
    keep = token_visibility(regions, torch.tensor([end], device=pos.device), pos)[0]
    return PlainCache(position=end, conv=conv, k=k[:, :, keep], v=v[:, :, keep], pos=pos[keep])


def plain_prefill(regions, k: Tensor, v: Tensor, conv: Tensor | None) -> PlainCache:
    """The cache after a full forward over k, v ``[B, H, T, D]`` (positions ``0..T-1``)."""
    T = k.shape[2]
    return _kept(regions, k.detach(), v.detach(), positions(0, T, k.device), T, conv)


def plain_decode(cache: PlainCache, regions, q: Tensor, k: Tensor, v: Tensor, *, scale: float,
                 conv: Tensor | None) -> tuple[Tensor, PlainCache]:
    """New tokens' q, k, v ``[B, H, T2, D]`` (at positions ``cache.position ..``) attend over the
    kept tokens and themselves -> ``([B, H, T2, Dv], new cache)``."""
    new_pos = positions(cache.position, q.shape[2], q.device)
    kk, vv = torch.cat([cache.k, k.detach()], dim=2), torch.cat([cache.v, v.detach()], dim=2)
    pos = torch.cat([cache.pos, new_pos])
    out = attend_rows(q, kk, vv, token_visibility(regions, new_pos, pos), scale=scale)
    return out, _kept(regions, kk, vv, pos, cache.position + q.shape[2], conv)


def static_slots(regions, capacity: int) -> tuple[int, int]:
    """``(n_sinks, ring)`` of a :class:`~ovqflex.cache.plain.StaticPlainCache` for ``regions`` and
    sequences of at most ``capacity`` tokens: the sinks keep their own slots, the rest is a ring as
    long as the most non-sink tokens one query sees (a token window ``w``: ``w``; a block window
    ``Nb`` chunks of ``C``: ``Nb * C``), or ``capacity`` slots for full causal attention."""
    n_sinks, ring = 0, None
    for region in regions:
        if isinstance(region, Sinks):
            n_sinks = region.n
        elif isinstance(region, TokenWindow):
            ring = region.window
        elif isinstance(region, BlockWindow):
            ring = region.width * region.chunk_size
        elif not isinstance(region, Causal):
            raise ValueError(f"regions: no static cache layout for {type(region).__name__}")
    return (0, capacity) if ring is None else (n_sinks, ring)


def _slot(p: Tensor, n_sinks: int, ring: int) -> Tensor:
    """Slots of positions ``p`` (int64) in a static cache (see :class:`StaticPlainCache`)."""
    return torch.where(p < n_sinks, p, n_sinks + (p - n_sinks) % ring)


def plain_static(cache: PlainCache, regions, capacity: int) -> StaticPlainCache:
    """The static cache holding ``cache``'s tokens (``cache`` is not changed)."""
    n_sinks, ring = static_slots(regions, capacity)
    S = n_sinks + ring
    slots = _slot(cache.pos, n_sinks, ring)
    clean, nonfinite = split_nonfinite(cache.v)
    return StaticPlainCache(position=torch.tensor(cache.position, device=cache.pos.device),
                            conv=None if cache.conv is None else cache.conv.clone(), k=slotted(cache.k, S, slots),
                            v=slotted(clean, S, slots), v_nonfinite=slotted(nonfinite, S, slots),
                            pos=slot_positions(cache.pos, S, slots), n_sinks=n_sinks, ring=ring)


def plain_decode_static(cache: StaticPlainCache, regions, q: Tensor, k: Tensor, v: Tensor, *, scale: float,
                        conv: Tensor | None) -> Tensor:
    """One new token's q, k, v ``[B, H, 1, D]`` (at ``cache.position``) written into its slot, then
    attending over the cache -> ``[B, H, 1, Dv]``. Fixed shapes, no host sync; the caller advances
    ``cache.position``."""
    p = cache.position.view(1)
    slot = _slot(p, cache.n_sinks, cache.ring)
    clean, nonfinite = split_nonfinite(v.detach())
    cache.k.index_copy_(2, slot, k.detach())
    cache.v.index_copy_(2, slot, clean)
    cache.v_nonfinite.index_copy_(2, slot, nonfinite)
    cache.pos.index_copy_(0, slot, p)
    cache.write_conv(conv)
    visible = slot_visibility(regions, p, cache.pos)
    return attend_rows(q, cache.k, cache.v, visible, scale=scale, v_nonfinite=cache.v_nonfinite)
