"""OVQ routing (SPEC §4.2): which dictionary slot each token joins. Discrete, no grad.

Loops over chunks only; every chunk is vectorized over batch, heads and its
tokens. The routing dictionary is kept as fp32 running sums and counts, so its
rows are exactly the segment means the differentiable state build produces.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

GROWTHS = ("plateau", "linear", "full")
SEEDINGS = ("spread", "random")


def dictionary_sizes(n_chunks: int, chunk: int, max_centroids: int, growth: str = "plateau",
                     growth_horizon: int | None = None) -> list[int]:
    """``N_c`` for c = 0..n_chunks: the dictionary size chunk ``c`` reads (``N_0 = 0``).

    plateau: ``floor(t N / (t + N))``; full: ``min(t, N)``; linear: ``min(N, c * n)``
    with ``n = min(L, ceil(N L / horizon))`` new slots per chunk (horizon default 4N).
    """
    N, L = max_centroids, chunk
    sizes = []
    for c in range(n_chunks + 1):
        t = c * L
        if growth == "plateau":
            sizes.append(t * N // (t + N))
        elif growth == "full":
            sizes.append(min(t, N))
        elif growth == "linear":
            per = min(L, math.ceil(N * L / (growth_horizon or 4 * N)))
            sizes.append(min(N, c * per))
        else:
            raise ValueError(f"growth must be one of {list(GROWTHS)}, got {growth!r}")
    return sizes


def _rank_first(key: Tensor, n: int) -> Tensor:
    """Indices of the ``n`` smallest entries of ``key [..., L]``, ascending, ties to lower index."""
    return torch.sort(key, dim=-1, stable=True).indices[..., :n]


def route_ovq(k: Tensor, *, chunk: int, sizes: list[int], seeding: str = "spread", seed: int = 0,
              normalize_centroids: bool = False) -> Tensor:
    """Slot of every token, ``[B, H, T]`` int64 (-1: not routed).

    k: ``[B, H, T, D]`` unit keys (any float dtype; similarities in fp32).
    ``sizes``: ``dictionary_sizes(...)`` for the complete chunks. Only complete
    chunks route (the tokens of a final partial chunk stay -1, as in a decode cache).

    Routing is an opaque custom op: ``torch.compile`` keeps it as one call (no graph
    break, no unrolled chunk loop in the graph); it runs eagerly, without grad.
    """
    return _route_op(k.detach(), chunk, list(sizes), seeding, seed, normalize_centroids)


@torch.library.custom_op("ovqflex::route_ovq", mutates_args=())
def _route_op(k: Tensor, chunk: int, sizes: list[int], seeding: str, seed: int, normalize_centroids: bool) -> Tensor:
    with torch.no_grad():
        return _route(k, chunk, sizes, seeding, seed, normalize_centroids)


@_route_op.register_fake
def _(k, chunk, sizes, seeding, seed, normalize_centroids):
    return k.new_empty(k.shape[:3], dtype=torch.long)


def _route(k: Tensor, chunk: int, sizes: list[int], seeding: str, seed: int, normalize_centroids: bool) -> Tensor:
    B, H, T, D = k.shape
    L = chunk
    kf = k.detach().float()
    n_full = T // L
    n_slots = max(sizes[: n_full + 1] + [0])
    sums = kf.new_zeros(B, H, n_slots + 1, D)  # slot n_slots collects nothing (spare)
    counts = kf.new_zeros(B, H, n_slots + 1)
    pieces = []  # routes chunk by chunk (built functionally: compiles to plain concatenation)
    gen = torch.Generator().manual_seed(seed) if seeding == "random" else None
    for c in range(n_full):
        u = torch.rand((B, H, L), generator=gen).to(k.device) if gen is not None else None
        n_old, n_new = sizes[c], sizes[c + 1] - sizes[c]
        if n_old == 0 and n_new == 0:
            pieces.append(torch.full((B, H, L), -1, dtype=torch.long, device=k.device))
            continue
        kc = kf[:, :, c * L:(c + 1) * L]
        if n_old > 0:
            d = sums[:, :, :n_old] / counts[:, :, :n_old, None]
            if normalize_centroids:
                d = F.normalize(d, dim=-1)
            sim = kc @ d.transpose(-1, -2)  # [B, H, L, n_old]
            best_sim, route = sim.max(dim=-1)
            if n_new > 0:
                chosen = _rank_first(best_sim if u is None else u, n_new)
                new_ids = (n_old + torch.arange(n_new, device=k.device)).expand(B, H, n_new)
                route = route.scatter(2, chosen, new_ids)
        else:  # first seeding: token 0 (spread) and the tokens least similar to it
            if u is None:
                key = (kc @ kc[:, :, :1].transpose(-1, -2)).squeeze(-1)
                key[:, :, 0] = float("-inf")
            else:
                key = u
            chosen = _rank_first(key, n_new)  # [B, H, n_new]
            seeds = kc.gather(2, chosen[..., None].expand(B, H, n_new, D))
            route = (kc @ seeds.transpose(-1, -2)).argmax(dim=-1)
            route = route.scatter(2, chosen, torch.arange(n_new, device=k.device).expand(B, H, n_new))
        pieces.append(route)
        sums.scatter_add_(2, route[..., None].expand(B, H, L, D), kc)
        counts.scatter_add_(2, route, torch.ones_like(route, dtype=counts.dtype))
    pieces.append(torch.full((B, H, T - n_full * L), -1, dtype=torch.long, device=k.device))
    return torch.cat(pieces, dim=2)
