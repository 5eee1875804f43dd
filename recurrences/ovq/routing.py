"""OVQ routing (docs/design.md §4.2): which dictionary slot each token joins. Discrete, no grad.

Loops over chunks only; every chunk is vectorized over batch, heads and its
tokens. The routing dictionary is kept as fp32 running sums and counts, so its
rows are exactly the segment means the differentiable state build produces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_choice
from ..compiling import bucket_rows, resolve_routing
from ..precision import no_autocast

GROWTHS = ("plateau", "linear", "full")
SEEDINGS = ("spread", "random")


def dictionary_sizes(n_chunks: int, chunk_size: int, max_centroids: int, growth: str = "plateau",
                     growth_horizon: int | None = None) -> list[int]:
    """``N_c`` for c = 0..n_chunks: the dictionary size chunk ``c`` reads (``N_0 = 0``).

    plateau: ``floor(t N / (t + N))``; full: ``min(t, N)``; linear: ``min(N, c * n)``
    with ``n = min(L, ceil(N L / horizon))`` new slots per chunk (horizon default 4N).
    """
    return [dictionary_size(c, chunk_size, max_centroids, growth, growth_horizon) for c in range(n_chunks + 1)]


def dictionary_size(c, chunk_size: int, max_centroids: int, growth: str = "plateau",
                    growth_horizon: int | None = None):
    """``N_c``: the dictionary size chunk ``c`` reads (one entry of :func:`dictionary_sizes`).

    ``c`` may be an int, a symbolic int (a length under ``torch.compile(dynamic=True)``: the size
    stays a formula of it, so the graph is not specialized on the length) or an int tensor of chunk
    indices (the sizes of many chunks at once). Non-decreasing in ``c``.
    """
    N, L, t = max_centroids, chunk_size, c * chunk_size
    if growth == "plateau":
        return t * N // (t + N)
    if growth == "full":
        return _at_most(t, N)
    if growth == "linear":
        per = min(L, math.ceil(N * L / (growth_horizon or 4 * N)))
        return _at_most(c * per, N)
    raise ValueError(f"growth must be one of {list(GROWTHS)}, got {growth!r}")


def _at_most(x, n: int):
    return x.clamp(max=n) if isinstance(x, Tensor) else torch.sym_min(x, n)


@dataclass(frozen=True)
class DictionarySchedule:
    """How OVQ's dictionary grows: chunk ``c`` of ``chunk_size`` tokens reads ``size(c)`` rows
    (:func:`dictionary_size`: ``growth`` of ``max_centroids`` over ``growth_horizon``).

    Every size is a closed form of the chunk index, so what an op derives from the length — the sizes
    as a tensor, the largest dictionary — stays a formula of it under ``torch.compile(dynamic=True)``
    and one compiled graph serves every length.
    """

    chunk_size: int
    max_centroids: int
    growth: str = "plateau"
    growth_horizon: int | None = None

    def __post_init__(self):
        check_choice("growth", self.growth, GROWTHS)

    def size(self, c):
        """Rows chunk ``c`` reads (int, symbolic int or int tensor of chunk indices)."""
        return dictionary_size(c, self.chunk_size, self.max_centroids, self.growth, self.growth_horizon)

    def sizes(self, n_chunks: int) -> list[int]:
        """``[size(0), ..., size(n_chunks)]``."""
        return dictionary_sizes(n_chunks, self.chunk_size, self.max_centroids, self.growth, self.growth_horizon)

    def live(self, n_chunks, device) -> Tensor:
        """``[n_chunks]`` int64: rows chunks ``0..n_chunks-1`` read."""
        return self.size(torch.arange(n_chunks, device=device))

    def rows(self, n_chunks: int) -> int:
        """Rows of a state holding the dictionary of each of chunks ``0..n_chunks-1``: the largest,
        ``size(n_chunks - 1)`` (sizes never decrease). For a symbolic ``n_chunks`` (a length under
        ``torch.compile`` with dynamic shapes) rounded up to a power of two, at most ``max_centroids``
        (:func:`~recurrences.compiling.bucket_rows`): a plain int that holds for every length of the
        bucket, where the exact floor division of ``n_chunks`` would make every shape and guard built on
        it a nested formula (measured: 10x the compile time, and a recompile at the next length). The
        rows past a chunk's size are dead (empty, outside its state region)."""
        return bucket_rows(self.size(n_chunks - 1), self.max_centroids)


def _rank_first(key: Tensor, n: int) -> Tensor:
    """Indices of the ``n`` smallest entries of ``key [..., L]``, ascending, ties to lower index."""
    return torch.sort(key, dim=-1, stable=True).indices[..., :n]


def route_ovq(k: Tensor, *, schedule: DictionarySchedule, seeding: str = "spread", seed: int = 0,
              normalize_centroids: bool = False, impl: str = "auto") -> Tensor:
    """Slot of every token, ``[B, H, T]`` int64 (-1: not routed).

    k: ``[B, H, T, D]`` unit keys (any float dtype; similarities in fp32).
    ``schedule``: the chunk size and the dictionary size each chunk reads. Only complete
    chunks route (the tokens of a final partial chunk stay -1, as in a decode cache).
    ``impl``: ``"loop"``, the chunk loop below; ``"static"``, the same routes from a compiled
    static-shape chunk step (:func:`~recurrences.ovq.routing_static.route_ovq_static`; on CUDA the
    whole run replayed from one CUDA graph); ``"auto"`` (default): ``"static"`` on CUDA, ``"loop"``
    elsewhere (:func:`~recurrences.compiling.resolve_routing`).

    Routing is an opaque custom op: ``torch.compile`` keeps it as one call (no graph
    break, no unrolled chunk loop in the graph); it runs eagerly, without grad. It takes the
    schedule, not the list of sizes, so a graph compiled with a symbolic length holds for every
    length: the sizes are computed inside, from the length of ``k``.
    """
    resolve_routing(impl, k.device)  # checks impl here, where the error names the caller's argument
    o = schedule
    return _route_op(k.detach(), o.chunk_size, o.max_centroids, o.growth, o.growth_horizon, seeding, seed,
                     normalize_centroids, impl)


@torch.library.custom_op("ovqflex::route_ovq", mutates_args=())
def _route_op(k: Tensor, chunk_size: int, max_centroids: int, growth: str, growth_horizon: int | None,
              seeding: str, seed: int, normalize_centroids: bool, impl: str) -> Tensor:
    sizes = dictionary_sizes(k.shape[2] // chunk_size, chunk_size, max_centroids, growth, growth_horizon)
    if resolve_routing(impl, k.device) == "static":
        from .routing_static import route_ovq_static  # routing_static builds on this module

        return route_ovq_static(k, chunk_size=chunk_size, sizes=sizes, seeding=seeding, seed=seed,
                                normalize_centroids=normalize_centroids)
    with torch.no_grad():
        return _route(k, chunk_size, sizes, seeding, seed, normalize_centroids)


@_route_op.register_fake
def _(k, chunk_size, max_centroids, growth, growth_horizon, seeding, seed, normalize_centroids, impl):
    return k.new_empty(k.shape[:3], dtype=torch.long)


def ovq_route_chunk(kc: Tensor, sums: Tensor, counts: Tensor, n_old: int, n_new: int, u: Tensor | None,
                    normalize_centroids: bool) -> Tensor:
    """Routes ``[B, H, L]`` of one chunk's unit keys ``kc [B, H, L, D]`` (fp32) against the
    routing dictionary (fp32 ``sums [B, H, S, D]``, ``counts [B, H, S]``, ``n_old`` live rows);
    ``n_new`` tokens found new slots ``n_old..``; ``u [B, H, L]``: random seeding keys (None: spread).
    Reads the dictionary only; :func:`ovq_absorb` writes the chunk in."""
    with no_autocast(kc):
        return _route_chunk(kc, sums, counts, n_old, n_new, u, normalize_centroids)


def _route_chunk(kc, sums, counts, n_old, n_new, u, normalize_centroids):
    B, H, L, D = kc.shape
    if n_old == 0 and n_new == 0:
        return torch.full((B, H, L), -1, dtype=torch.long, device=kc.device)
    if n_old > 0:
        d = sums[:, :, :n_old] / counts[:, :, :n_old, None]
        if normalize_centroids:
            d = F.normalize(d, dim=-1)
        sim = kc @ d.transpose(-1, -2)  # [B, H, L, n_old]
        best_sim, route = sim.max(dim=-1)
        if n_new > 0:
            chosen = _rank_first(best_sim if u is None else u, n_new)
            new_ids = (n_old + torch.arange(n_new, device=kc.device)).expand(B, H, n_new)
            route = route.scatter(2, chosen, new_ids)
        return route
    # first seeding: token 0 (spread) and the tokens least similar to it
    if u is None:
        key = (kc @ kc[:, :, :1].transpose(-1, -2)).squeeze(-1)
        key[:, :, 0] = float("-inf")
    else:
        key = u
    chosen = _rank_first(key, n_new)  # [B, H, n_new]
    seeds = kc.gather(2, chosen[..., None].expand(B, H, n_new, D))
    route = (kc @ seeds.transpose(-1, -2)).argmax(dim=-1)
    return route.scatter(2, chosen, torch.arange(n_new, device=kc.device).expand(B, H, n_new))


def ovq_absorb(sums: Tensor, counts: Tensor, kc: Tensor, route: Tensor, value_sums: Tensor | None = None,
               vc: Tensor | None = None) -> None:
    """Add a routed chunk to the routing dictionary in place (routes -1 or past the last
    row go to the spare last row); with ``value_sums``/``vc`` the values too. The one write
    both routing and decode caches use, so a cache rebuilt from routes holds bit for bit
    the dictionary routing saw."""
    spare = sums.shape[2] - 1
    add_to_rows(sums, counts, kc, torch.where((route >= 0) & (route < spare), route, spare), value_sums, vc)


def add_to_rows(sums: Tensor, counts: Tensor, kc: Tensor, route: Tensor, value_sums: Tensor | None = None,
                vc: Tensor | None = None) -> None:
    """:func:`ovq_absorb`'s write for routes that all name a row of ``sums [B, H, S, D]`` (``0 <= route
    < S``; the static chunk step's are, so it skips the clamp): each token of ``kc [B, H, L, D]`` (and
    ``vc``) added to its row, one count each (a scalar add: no tensor of ones to fill first)."""
    sums.scatter_add_(2, route[..., None].expand(*route.shape, kc.shape[-1]), kc)
    counts.scatter_(2, route, 1.0, reduce="add")
    if value_sums is not None:
        value_sums.scatter_add_(2, route[..., None].expand(*route.shape, vc.shape[-1]), vc)


def seeding_draw(gen: torch.Generator | None, B: int, H: int, L: int, device) -> Tensor | None:
    """The random-seeding keys of one chunk (one draw per chunk, whether used or not)."""
    return None if gen is None else torch.rand((B, H, L), generator=gen).to(device)


def _route(k: Tensor, chunk_size: int, sizes: list[int], seeding: str, seed: int, normalize_centroids: bool) -> Tensor:
    B, H, T, D = k.shape
    L = chunk_size
    kf = k.detach().float()
    n_full = T // L
    n_slots = max(sizes[: n_full + 1] + [0])
    sums = kf.new_zeros(B, H, n_slots + 1, D)  # slot n_slots collects nothing (spare)
    counts = kf.new_zeros(B, H, n_slots + 1)
    pieces = []  # routes chunk by chunk (built functionally: compiles to plain concatenation)
    gen = torch.Generator().manual_seed(seed) if seeding == "random" else None
    for c in range(n_full):
        u = seeding_draw(gen, B, H, L, k.device)
        kc = kf[:, :, c * L:(c + 1) * L]
        route = ovq_route_chunk(kc, sums, counts, sizes[c], sizes[c + 1] - sizes[c], u, normalize_centroids)
        pieces.append(route)
        ovq_absorb(sums, counts, kc, route)
    pieces.append(torch.full((B, H, T - n_full * L), -1, dtype=torch.long, device=k.device))
    return torch.cat(pieces, dim=2)
