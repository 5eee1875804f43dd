"""OVQ-attention's decode path (docs/design.md §4.2, §6): the :class:`~ovqflex.cache.OVQCache` after a
prefill, and decode steps from it.

The prefill rebuilds the routing dictionary by replaying the op's routes through the same write
routing uses (:func:`recurrences.ovq.ovq_absorb`). A decode query of chunk ``c`` reads the ``N_c``
dictionary rows (means, ``log(count)`` bias) and its chunk's tokens causally; when a chunk completes
it is routed (:func:`recurrences.ovq.ovq_route_chunk`) and absorbed, and its raw tokens are dropped.

The static form (:class:`~ovqflex.cache.ovq.StaticOVQCache`, docs/design.md §6 "Static decode"): a
step (:func:`ovq_decode_static`) writes the token into the chunk buffer and reads every dictionary
row, the dead ones masked; the chunk end (:func:`ovq_static_boundary`, called by the host, which
counts positions) routes and absorbs the chunk in place with the static routing step
(:func:`recurrences.ovq.routing_static.ovq_static_step`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from masks.regions import OwnChunk, token_visibility
from recurrences.compiling import chunk_bounds
from recurrences.ovq import ovq_absorb, ovq_route_chunk, seeding_draw
from recurrences.ovq.routing_static import compiled_static_step, ovq_static_step
from recurrences.precision import no_autocast

from ..attention import attend_rows, split_nonfinite
from ..cache.base import current_view
from ..cache.ovq import OVQCache, StaticOVQCache
from .decode import chunk_segments, positions
from .ovq import OVQOptions


def _padded(t: Tensor, size: int, keep: int) -> Tensor:
    """Zeros of ``t``'s shape with ``size`` entries along dim 2, the first ``keep`` copied from ``t``."""
    out = t.new_zeros(*t.shape[:2], size, *t.shape[3:])
    out[:, :, :keep] = t[:, :, :keep]
    return out


def _grown(tensors: tuple[Tensor, ...], need: int, cap: int) -> tuple[Tensor, ...]:
    """The dictionary tensors (``[B, H, S+1, ...]``, spare last) with room for ``need`` rows:
    ``max(need, 2 S)`` rows, at most ``cap``; the spare row starts empty again."""
    rows = tensors[0].shape[2] - 1
    new_rows = min(cap, max(need, 2 * rows))
    return tuple(_padded(t, new_rows + 1, rows) for t in tensors)


def _dictionary(sums: Tensor, value_sums: Tensor, counts: Tensor, normalize: bool) -> tuple[Tensor, Tensor, Tensor]:
    """What queries read from dictionary rows (fp32 sums ``[B, H, n, D]``, ``[B, H, n, Dv]``,
    counts ``[B, H, n]``): mean keys (unit with ``normalize``), mean values, and the bias
    ``log(count)`` ``[B, H, n]`` (``-inf`` for an empty row)."""
    per = counts.clamp_min(1.0)[..., None]
    keys = sums / per
    if normalize:
        keys = F.normalize(keys, dim=-1)
    return keys, value_sums / per, torch.where(counts > 0, counts.log(), float("-inf"))


def _check_cap(opts: OVQOptions, cache_cap: int) -> None:
    if opts.max_centroids != cache_cap:
        raise ValueError(f"max_centroids={opts.max_centroids} differs from the cache's {cache_cap}; "
                         "start a new cache (prefill) to change it")


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
    (the op's, -1 for the incomplete last chunk) of the complete chunks absorbed at once: one
    scatter-add per sum, which adds each row's tokens in position order, as routing's chunk by
    chunk absorbs did (the CPU's scatter-add walks the scattered dim in order: the same sums bit
    for bit; CUDA's adds in an unordered atomic order either way)."""
    B, H, T, D = kn.shape
    C = opts.chunk_size
    n = T // C * C
    rows = opts.size(T // C)  # the routes of the complete chunks stay below it
    kf, vf = kn.detach()[:, :, :n].float(), v.detach()[:, :, :n].float()
    sums, vsums = kf.new_zeros(B, H, rows + 1, D), kf.new_zeros(B, H, rows + 1, v.shape[-1])
    counts = kf.new_zeros(B, H, rows + 1)
    ovq_absorb(sums, counts, kf, routes[:, :, :n], vsums, vf)
    gen = _generator(opts, None)
    for _ in range(T // C if gen is not None else 0):
        seeding_draw(gen, B, H, C, "cpu")  # keep the generator where routing left it (one draw per chunk)
    return OVQCache(position=T, conv=conv, key_sums=sums, value_sums=vsums, counts=counts,
                    buf_k=kn.detach()[:, :, n:], buf_v=v.detach()[:, :, n:],
                    rng=None if gen is None else gen.get_state(), max_centroids=opts.max_centroids)


def ovq_decode(cache: OVQCache, q_scaled: Tensor, kn: Tensor, v: Tensor, opts: OVQOptions,
               conv: Tensor | None) -> tuple[Tensor, OVQCache]:
    """New tokens (``q_scaled = beta * q̂``, unit keys kn, v ``[B, H, T2, *]``) -> outputs
    ``[B, H, T2, Dv]`` and the cache after them. Segments split at chunk boundaries."""
    _check_cap(opts, cache.max_centroids)
    B, H, T2, D = kn.shape
    C = opts.chunk_size
    sums, vsums, counts = cache.key_sums, cache.value_sums, cache.counts  # copied before the first write
    copied = False
    buf_k, buf_v = cache.buf_k, cache.buf_v
    gen = _generator(opts, cache.rng)
    outs, pos, view = [], cache.position, cache.view
    for off, take in chunk_segments(pos, T2, C):
        c = pos // C
        n = opts.size(c)
        buf_k = torch.cat([buf_k, kn[:, :, off:off + take].detach()], dim=2)
        buf_v = torch.cat([buf_v, v[:, :, off:off + take].detach()], dim=2)
        view = current_view(view, (n, opts.normalize_centroids), lambda: _dictionary(
            sums[:, :, :n], vsums[:, :, :n], counts[:, :, :n], opts.normalize_centroids))
        bias = torch.cat([view.bias, view.bias.new_zeros(B, H, buf_k.shape[2])], dim=2)
        q_pos, kv_pos = positions(pos, take, kn.device), positions(c * C, buf_k.shape[2], kn.device)
        visible = torch.cat([torch.ones(take, n, dtype=torch.bool, device=kn.device),
                             token_visibility((OwnChunk(C),), q_pos, kv_pos)], dim=1)
        outs.append(attend_rows(q_scaled[:, :, off:off + take], (view.keys, buf_k.float()),
                                (view.values, buf_v.float()), visible, scale=1.0, bias=bias))
        pos += take
        if pos % C == 0:  # the chunk is complete: route it, absorb it, drop its raw tokens and read form
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
            buf_k, buf_v, view = buf_k[:, :, :0], buf_v[:, :, :0], None
    new = OVQCache(position=pos, conv=conv, key_sums=sums, value_sums=vsums, counts=counts, buf_k=buf_k,
                   buf_v=buf_v, rng=None if gen is None else gen.get_state(), max_centroids=opts.max_centroids,
                   view=view)
    return torch.cat(outs, dim=2).to(v.dtype), new


def ovq_static(cache: OVQCache, opts: OVQOptions, capacity: int) -> StaticOVQCache:
    """The static cache continuing ``cache`` (not changed) for sequences of at most ``capacity``
    tokens: dictionary rows for the largest ``N_c`` up to the capacity, the chunk buffer, the
    ``(N_c, N_{c+1})`` table. Needs ``seeding="spread"`` (random seeding draws from a host
    generator at each chunk end)."""
    if opts.seeding != "spread":
        raise ValueError(f"seeding={opts.seeding!r}: a static OVQ cache needs seeding='spread' (random seeding "
                         "draws on the host at every chunk end); use the functional cache")
    _check_cap(opts, cache.max_centroids)
    C = opts.chunk_size
    n_chunks = -(-capacity // C)
    sizes = opts.sizes(n_chunks)
    rows, live, b = max(sizes), opts.size(cache.position // C), cache.buf_k.shape[2]
    sums, vsums, counts = (_padded(t, rows + 1, live) for t in (cache.key_sums, cache.value_sums, cache.counts))
    device = sums.device
    buf_v = _padded(cache.buf_v.float(), C, b)
    # what steps read: the dictionary's read form (derived just below) then the chunk's slots
    chunk_values, chunk_nonfinite = split_nonfinite(buf_v)
    keys = torch.cat([sums.new_zeros(sums.shape), _padded(cache.buf_k.float(), C, b)], dim=2)
    values = torch.cat([vsums.new_zeros(vsums.shape), chunk_values], dim=2)
    nonfinite = torch.cat([chunk_nonfinite.new_zeros(counts.shape), chunk_nonfinite], dim=2)
    bias = counts.new_zeros(*counts.shape[:2], rows + 1 + C)
    static = StaticOVQCache(position=torch.tensor(cache.position, device=device),
                            conv=None if cache.conv is None else cache.conv.clone(), key_sums=sums,
                            value_sums=vsums, counts=counts, buf_v=buf_v, bounds=chunk_bounds(sizes, n_chunks, device),
                            keys=keys, values=values, nonfinite=nonfinite, bias=bias,
                            max_centroids=opts.max_centroids)
    _derive_static_dictionary(static, opts)
    return static


def _derive_static_dictionary(cache: StaticOVQCache, opts: OVQOptions) -> None:
    """Write the read form of ``cache``'s dictionary rows (mean keys, values split for the
    non-finite rule, ``log(count)`` bias) into the first ``S + 1`` rows its steps read: once per
    absorbed chunk."""
    n = cache.key_sums.shape[2]
    keys, values, bias = _dictionary(cache.key_sums, cache.value_sums, cache.counts, opts.normalize_centroids)
    values, nonfinite = split_nonfinite(values)
    for buffer, t in ((cache.keys, keys), (cache.values, values), (cache.nonfinite, nonfinite), (cache.bias, bias)):
        buffer[:, :, :n].copy_(t)


def ovq_decode_static(cache: StaticOVQCache, q_scaled: Tensor, kn: Tensor, v: Tensor, opts: OVQOptions,
                      conv: Tensor | None) -> Tensor:
    """One new token (``q_scaled = beta * q̂``, unit key kn fp32, v ``[B, H, 1, *]``, at
    ``cache.position``) written into the chunk buffer, then reading the ``N_c`` live dictionary
    rows and its chunk causally -> ``[B, H, 1, Dv]``. Fixed shapes, no host sync; the caller
    advances ``cache.position`` and, at a chunk end, calls :func:`ovq_static_boundary`."""
    _check_cap(opts, cache.max_centroids)
    C = opts.chunk_size
    p = cache.position
    j = (p % C).view(1)
    rows = cache.key_sums.shape[2]
    slot = rows + j  # the token's row among those a step reads
    v32 = v.detach().float()
    cache.buf_v.index_copy_(2, j, v32)
    clean, nonfinite = split_nonfinite(v32)
    cache.keys.index_copy_(2, slot, kn.detach())
    cache.values.index_copy_(2, slot, clean)
    cache.nonfinite.index_copy_(2, slot, nonfinite)
    cache.write_conv(conv)
    device = kn.device
    n = cache.bounds.index_select(0, (p // C).view(1))[0, 0]  # N_c (a tensor index: no host sync)
    visible = torch.cat([torch.arange(rows, device=device) < n, torch.arange(C, device=device) <= j])
    out = attend_rows(q_scaled, cache.keys, cache.values, visible, scale=1.0, bias=cache.bias,
                      v_nonfinite=cache.nonfinite)
    return out.to(v.dtype)


def ovq_static_boundary(cache: StaticOVQCache, opts: OVQOptions, position: int, *, compile: bool = False) -> None:
    """After a static step left ``position`` tokens in ``cache`` (``cache.position``, counted on
    the host): if it completed chunk ``c``, route and absorb that chunk in place — the static
    routing step (``compile``: its compiled form, one graph for every chunk), or for a chunk that
    reads an empty dictionary (the first seeding, once) the loop's own chunk step."""
    C = opts.chunk_size
    if position % C:
        return
    c = position // C - 1
    if opts.size(c) == 0:
        route = ovq_route_chunk(cache.chunk_keys, cache.key_sums, cache.counts, 0, opts.size(c + 1), None,
                                opts.normalize_centroids)
        ovq_absorb(cache.key_sums, cache.counts, cache.chunk_keys, route, cache.value_sums, cache.buf_v)
    else:
        step = compiled_static_step if compile else ovq_static_step
        bounds = cache.bounds.index_select(0, (cache.position // C - 1).view(1))[0]
        with no_autocast(cache.chunk_keys):  # as routing: the caller's autocast would score in bf16
            step(cache.chunk_keys, cache.key_sums, cache.counts, bounds, None,
                 normalize_centroids=opts.normalize_centroids, value_sums=cache.value_sums, vc=cache.buf_v)
    _derive_static_dictionary(cache, opts)
