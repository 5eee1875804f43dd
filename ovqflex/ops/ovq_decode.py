"""OVQ-attention's decode path (docs/design.md §4.2, §6): the :class:`~ovqflex.cache.OVQCache` after a
prefill, and decode steps from it.

The prefill rebuilds the routing dictionary by replaying the op's routes through the same write
routing uses (:func:`recurrences.ovq.ovq_absorb`). A decode query of chunk ``c`` reads the ``N_c``
dictionary rows (means, ``log(count)`` bias) and its chunk's tokens causally; when a chunk completes
it is routed (:func:`recurrences.ovq.ovq_route_chunk`) and absorbed, and its raw tokens are dropped.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from masks.regions import OwnChunk, token_visibility
from recurrences.ovq import ovq_absorb, ovq_route_chunk, seeding_draw

from ..attention import attend_rows
from ..cache.ovq import OVQCache
from .decode import chunk_segments, positions
from .ovq import OVQOptions


def _grown(tensors: tuple[Tensor, ...], need: int, cap: int) -> tuple[Tensor, ...]:
    """The dictionary tensors (``[B, H, S+1, ...]``, spare last) with room for ``need`` rows:
    ``max(need, 2 S)`` rows, at most ``cap``; the spare row starts empty again."""
    rows = tensors[0].shape[2] - 1
    new_rows = min(cap, max(need, 2 * rows))
    out = []
    for t in tensors:
        g = t.new_zeros(*t.shape[:2], new_rows + 1, *t.shape[3:])
        g[:, :, :rows] = t[:, :, :rows]
        out.append(g)
    return tuple(out)


def _generator(opts: OVQOptions, state: Tensor | None) -> torch.Generator | None:
    if opts.seeding != "random":
        return None
    gen = torch.Generator()
    if state is None:
        gen.manual_seed(opts.seed)
    else:
        gen.set_state(state)
    return gen


def ovq_prefill(kn: Tensor, v: Tensor, routes: Tensor, opts: OVQOptions, conv: Tensor | None) -> OVQCache:
    """The cache after a full forward: kn ``[B, H, T, D]`` unit keys, v, routes ``[B, H, T]``
    (the op's, -1 for the incomplete last chunk) replayed chunk by chunk."""
    B, H, T, D = kn.shape
    C = opts.chunk_size
    kf, vf = kn.detach().float(), v.detach().float()
    n_full = T // C
    rows = opts.size(n_full)  # the routes of the complete chunks stay below it
    sums, vsums = kf.new_zeros(B, H, rows + 1, D), kf.new_zeros(B, H, rows + 1, v.shape[-1])
    counts = kf.new_zeros(B, H, rows + 1)
    gen = _generator(opts, None)
    for c in range(n_full):
        seeding_draw(gen, B, H, C, kn.device)  # keep the generator where routing left it
        sl = slice(c * C, (c + 1) * C)
        ovq_absorb(sums, counts, kf[:, :, sl], routes[:, :, sl], vsums, vf[:, :, sl])
    return OVQCache(position=T, conv=conv, key_sums=sums, value_sums=vsums, counts=counts,
                    buf_k=kn.detach()[:, :, n_full * C:], buf_v=v.detach()[:, :, n_full * C:],
                    rng=None if gen is None else gen.get_state(), max_centroids=opts.max_centroids)


def ovq_decode(cache: OVQCache, q_scaled: Tensor, kn: Tensor, v: Tensor, opts: OVQOptions,
               conv: Tensor | None) -> tuple[Tensor, OVQCache]:
    """New tokens (``q_scaled = beta * q̂``, unit keys kn, v ``[B, H, T2, *]``) -> outputs
    ``[B, H, T2, Dv]`` and the cache after them. Segments split at chunk boundaries."""
    if opts.max_centroids != cache.max_centroids:
        raise ValueError(f"max_centroids={opts.max_centroids} differs from the cache's {cache.max_centroids}; "
                         "start a new cache (prefill) to change it")
    B, H, T2, D = kn.shape
    C = opts.chunk_size
    sums, vsums, counts = cache.key_sums, cache.value_sums, cache.counts  # copied before the first write
    copied = False
    buf_k, buf_v = cache.buf_k, cache.buf_v
    gen = _generator(opts, cache.rng)
    outs, pos = [], cache.position
    for off, take in chunk_segments(pos, T2, C):
        c = pos // C
        n = opts.size(c)
        buf_k = torch.cat([buf_k, kn[:, :, off:off + take].detach()], dim=2)
        buf_v = torch.cat([buf_v, v[:, :, off:off + take].detach()], dim=2)
        cnt = counts[:, :, :n]
        keys = sums[:, :, :n] / cnt.clamp_min(1.0)[..., None]
        if opts.normalize_centroids:
            keys = F.normalize(keys, dim=-1)
        values = vsums[:, :, :n] / cnt.clamp_min(1.0)[..., None]
        bias = torch.cat([torch.where(cnt > 0, cnt.log(), float("-inf")),
                          cnt.new_zeros(B, H, buf_k.shape[2])], dim=2)
        q_pos, kv_pos = positions(pos, take, kn.device), positions(c * C, buf_k.shape[2], kn.device)
        visible = torch.cat([torch.ones(take, n, dtype=torch.bool, device=kn.device),
                             token_visibility((OwnChunk(C),), q_pos, kv_pos)], dim=1)
        outs.append(attend_rows(q_scaled[:, :, off:off + take], torch.cat([keys, buf_k.float()], dim=2),
                                torch.cat([values, buf_v.float()], dim=2), visible, scale=1.0, bias=bias))
        pos += take
        if pos % C == 0:  # the chunk is complete: route it, absorb it, drop its raw tokens
            u = seeding_draw(gen, B, H, C, kn.device)
            kc = buf_k.float()
            need = opts.size(c + 1)
            if need > sums.shape[2] - 1:  # a new tensor: also the copy of copy on write
                sums, vsums, counts = _grown((sums, vsums, counts), need, opts.max_centroids)
                copied = True
            if not copied:  # the given cache stays valid (copy on write, once per call)
                sums, vsums, counts, copied = sums.clone(), vsums.clone(), counts.clone(), True
            route = ovq_route_chunk(kc, sums, counts, n, need - n, u, opts.normalize_centroids)
            ovq_absorb(sums, counts, kc, route, vsums, buf_v.float())
            buf_k, buf_v = buf_k[:, :, :0], buf_v[:, :, :0]
    new = OVQCache(position=pos, conv=conv, key_sums=sums, value_sums=vsums, counts=counts, buf_k=buf_k,
                   buf_v=buf_v, rng=None if gen is None else gen.get_state(), max_centroids=opts.max_centroids)
    return torch.cat(outs, dim=2).to(v.dtype), new
