"""OVQ routing with static shapes (docs/design.md §4.2): the chunk loop of
:func:`~recurrences.ovq.routing.route_ovq`, every chunk step on tensors of one shape.

The loop's dictionary already lives in fixed buffers (fp32 ``sums [B, H, S+1, D]``,
``counts [B, H, S+1]``, ``S = max(sizes)``, row ``S`` the spare); what grows is the
number of live rows it reads. Here a step reads all ``S+1`` rows and masks the dead
ones (``arange(S+1) < N_c``, scores ``-inf``); the sizes ``N_c, N_{c+1}`` are a device
tensor; the ``n_new`` founders are the tokens whose rank in the stable sort is below
``N_{c+1} - N_c`` (a mask, not a slice). So ``torch.compile(fullgraph=True,
dynamic=False)`` compiles the step once for every chunk, and the loop over chunks
(:func:`route_chunks_static`) has no host sync and no data-dependent shape: the
target of one CUDA-graph capture.

Same routes as the loop, bit for bit: live rows are divided by the same counts (dead
rows by 1, never 0/0), dead scores are ``-inf`` (they never win a max, and the live
scores, the max and its first index are those of the loop), the founders are the
loop's ``sort(stable)[:n_new]`` in the same order, and the absorb is the loop's own
:func:`~recurrences.ovq.routing.ovq_absorb`. What it relies on: a score
``<kc_i, d_j>`` (and a row norm with ``normalize_centroids``) is computed the same
whether the dictionary has ``N_c`` or ``S+1`` rows, and the compiled kernels sum in the
eager kernels' order. Both hold on the CPU (tests/recurrences/ovq/test_routing_static.py);
on CUDA, cuBLAS and the reduction kernels pick their algorithm by shape, and the eager
loop's ``scatter_add_`` is an atomic (unordered) sum, so there only near-ties can differ.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from ..precision import no_autocast
from .routing import ovq_absorb, ovq_route_chunk, seeding_draw


def route_ovq_static(k: Tensor, *, chunk_size: int, sizes: list[int], seeding: str = "spread", seed: int = 0,
                     normalize_centroids: bool = False, compile: bool = True) -> Tensor:
    """Slot of every token, ``[B, H, T]`` int64 (-1: not routed): what ``route_ovq`` returns.

    k: ``[B, H, T, D]`` unit keys (any float dtype; routing in fp32); ``sizes``:
    ``dictionary_sizes(...)``. The leading chunks that read an empty dictionary
    (``N_c = 0``: chunk 0, the first seeding) run :func:`ovq_route_chunk` as the loop
    does; every later chunk is one static step (``compile``: ``compiled_static_step``, compiled
    once per input shape and per ``(seeding, normalize_centroids)``). No grad.
    """
    with torch.no_grad(), no_autocast(k):
        B, H, T, D = k.shape
        L, n_full = chunk_size, k.shape[2] // chunk_size
        kf = k.detach().float()
        n_slots = max(sizes[: n_full + 1] + [0])
        sums = kf.new_zeros(B, H, n_slots + 1, D)
        counts = kf.new_zeros(B, H, n_slots + 1)
        routes = torch.full((B, H, T), -1, dtype=torch.long, device=k.device)
        gen = torch.Generator().manual_seed(seed) if seeding == "random" else None
        draws = [] if gen is None else [seeding_draw(gen, B, H, L, "cpu") for _ in range(n_full)]
        u = torch.stack(draws).to(k.device) if draws else None  # [n_full, B, H, L]: the loop's draws
        first = 0
        while first < n_full and sizes[first] == 0:  # an empty dictionary: the loop's own chunk step
            kc = kf[:, :, first * L:(first + 1) * L]
            route = ovq_route_chunk(kc, sums, counts, 0, sizes[first + 1], None if u is None else u[first],
                                    normalize_centroids)
            ovq_absorb(sums, counts, kc, route)
            routes[:, :, first * L:(first + 1) * L] = route
            first += 1
        step = functools.partial(compiled_static_step if compile else ovq_static_step,
                                 normalize_centroids=normalize_centroids)
        bounds = torch.tensor(sizes[: n_full + 1], dtype=torch.long, device=k.device)
        route_chunks_static(routes, kf, sums, counts, bounds, u, chunk_size=L, first=first, step=step)
        return routes


def route_chunks_static(routes: Tensor, kf: Tensor, sums: Tensor, counts: Tensor, bounds: Tensor, u: Tensor | None,
                        *, chunk_size: int, first: int, step) -> None:
    """Routes and absorbs the complete chunks ``first..T // chunk_size - 1`` in place: the CUDA-graph target.

    routes ``[B, H, T]`` int64 (each chunk's slice written), kf ``[B, H, T, D]`` fp32 unit keys,
    sums ``[B, H, S+1, D]`` / counts ``[B, H, S+1]`` fp32 (updated), bounds ``[n_full + 1]`` int64
    dictionary sizes on kf's device (``bounds[first] > 0``), u ``[n_full, B, H, L]`` random-seeding
    draws or None (spread); ``step(kc, sums, counts, bounds, u)``: :func:`ovq_static_step` (or
    ``compiled_static_step``) with ``normalize_centroids`` bound. Every launch reads and writes fixed
    buffers at fixed offsets, with no host sync, so ``torch.cuda.graph`` can capture the whole
    call (after one warm-up call that compiles the step) and replay it on new contents of kf
    (and u), with sums and counts zeroed and the leading chunks (``first``) replayed as before.
    """
    L = chunk_size
    for c in range(first, kf.shape[2] // L):
        sl = slice(c * L, (c + 1) * L)
        routes[:, :, sl] = step(kf[:, :, sl], sums, counts, bounds[c:c + 2], None if u is None else u[c])


def ovq_static_step(kc: Tensor, sums: Tensor, counts: Tensor, bounds: Tensor, u: Tensor | None, *,
                    normalize_centroids: bool) -> Tensor:
    """One chunk against a dictionary with ``N_c = bounds[0] > 0`` live rows: routes ``[B, H, L]``, then absorbs them.

    kc ``[B, H, L, D]`` fp32 unit keys; sums ``[B, H, S+1, D]``, counts ``[B, H, S+1]`` fp32 (row
    ``S`` the spare; updated in place by :func:`ovq_absorb`); bounds ``[2]`` int64 ``(N_c,
    N_{c+1})``; u ``[B, H, L]`` random-seeding draws (None: spread). The ``N_{c+1} - N_c`` tokens
    first in the stable order of their best similarity (or of u) found slots ``N_c, N_c + 1, …``;
    the others join their best live slot (first index on ties).
    """
    L, R = kc.shape[2], sums.shape[2]
    n_old, n_new = bounds[0], bounds[1] - bounds[0]
    live = torch.arange(R, device=kc.device) < n_old                        # [S+1]
    d = sums / torch.where(live, counts, 1.0)[..., None]
    if normalize_centroids:
        d = _unit_rows(d)
    sim = (kc @ d.transpose(-1, -2)).masked_fill(~live, float("-inf"))       # [B, H, L, S+1]
    best_sim, route = sim.max(dim=-1)
    order = torch.sort(best_sim if u is None else u, dim=-1, stable=True).indices
    rank = torch.empty_like(order).scatter_(2, order, torch.arange(L, device=kc.device).expand_as(order))
    route = torch.where(rank < n_new, n_old + rank, route)
    ovq_absorb(sums, counts, kc, route)
    return route


@torch.library.custom_op("ovqflex::ovq_unit_rows", mutates_args=())
def _unit_rows(d: Tensor) -> Tensor:
    """``F.normalize(d, dim=-1)`` by the eager kernel: inductor's own sum of squares rounds
    differently, and routing must read the loop's normalised means bit for bit."""
    return F.normalize(d, dim=-1)


@_unit_rows.register_fake
def _(d):
    return torch.empty_like(d)


# compiled once per input shape, seeding (u or None) and normalize_centroids: one graph serves every chunk
compiled_static_step = torch.compile(ovq_static_step, fullgraph=True, dynamic=False)
