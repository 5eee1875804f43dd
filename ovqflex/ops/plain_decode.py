"""The plain layers' decode path (docs/design.md §6): the :class:`~ovqflex.cache.PlainCache` after a
prefill, and decode steps from it. New queries attend over the kept tokens and themselves with the
layer's regions; the cache keeps what a later query can still see (``token_visibility``)."""
from __future__ import annotations

import torch
from torch import Tensor

from masks.regions import token_visibility

from ..attention import attend_rows
from ..cache.plain import PlainCache
from .decode import positions


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
