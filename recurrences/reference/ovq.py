"""Sequential reference of OVQ-attention (OVQ paper, arXiv 2602.03922, section 3.2 and appendix 8.3).

This is the test oracle for the fused implementation: the paper's chunk loop,
written plainly. One Python iteration per chunk; inside a chunk everything is
vectorized over batch and heads with gather/scatter, like the paper's
pseudo-code. Autograd flows through the loop (q, k, v, beta); routes and counts
are discrete constants computed without grad, in float32.

Routing keeps its own float32, no-grad copy of the key dictionary (built with
the same running-mean rule from the same routes), so routing never depends on
the input dtype; the differentiable dictionary lives in the compute dtype
(float32, or float64 for float64 inputs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROWTHS = ("plateau", "full", "linear")
SEEDINGS = ("spread", "random")


@dataclass
class OVQReferenceResult:
    out: torch.Tensor      # [B, H, T, Dv], dtype of q
    routes: torch.Tensor   # [B, H, T] int64, slot id per token, -1 = not routed
    counts: torch.Tensor   # [B, H, N] float32, final number of tokens per slot
    sizes: list[int]       # len n_chunks + 1; sizes[c] = dictionary size before chunk c
    keys: torch.Tensor     # [B, H, N, D] final key dictionary (running means of unit keys)
    values: torch.Tensor   # [B, H, N, Dv] final value dictionary (running means of values)
    gaps: torch.Tensor     # [B, H, T] float32, how far each decision falls short of the loop's own (0: its own)


def ovq_schedule(n_chunks: int, chunk_size: int, max_centroids: int,
                 growth: str = "plateau", growth_horizon: int | None = None) -> list[int]:
    """Scheduled dictionary sizes ``[N_0, ..., N_{n_chunks}]`` with ``N_c = grow(L*c)``."""
    L, N = chunk_size, max_centroids
    if growth == "plateau":
        return [(L * c) * N // (L * c + N) for c in range(n_chunks + 1)]
    if growth == "full":
        return [min(L * c, N) for c in range(n_chunks + 1)]
    if growth == "linear":
        horizon = growth_horizon if growth_horizon is not None else 4 * N
        per_chunk = min(L, -(-(N * L) // horizon))  # ceil(N*L / horizon)
        return [min(N, c * per_chunk) for c in range(n_chunks + 1)]
    raise ValueError(f"growth must be one of {GROWTHS}, got {growth!r}")


def _first_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximal entry along the last dim (ties -> lowest index)."""
    idx = torch.arange(x.shape[-1], device=x.device).expand_as(x)
    is_max = x == x.max(dim=-1, keepdim=True).values
    return torch.where(is_max, idx, x.shape[-1]).min(dim=-1).values


def _running_mean_update(D: torch.Tensor, counts: torch.Tensor, r: torch.Tensor, x: torch.Tensor):
    """Paper eq. 19 for one chunk. D [B,H,N,d], counts [B,H,N] f32, r [B,H,l] int64, x [B,H,l,d].

    ``D[s] += sum_{t -> s} (x_t - D_old[s]) / (c_old[s] + c_chunk[s])``; out-of-place.
    """
    new_counts = counts.scatter_add(2, r, torch.ones(r.shape, dtype=counts.dtype, device=r.device))
    lr = 1.0 / new_counts.gather(2, r).to(D.dtype)                       # [B,H,l], in D's dtype
    r_d = r.unsqueeze(-1).expand(*r.shape, D.shape[-1])                  # [B,H,l,d]
    delta = (x - D.gather(2, r_d)) * lr.unsqueeze(-1)
    return D.scatter_add(2, r_d, delta), new_counts


def _seed_keys(kr: torch.Tensor, seeding: str, u: torch.Tensor | None) -> torch.Tensor:
    """What the first seeding ranks the tokens of a chunk by [B,H,l], lowest first. Spread: token 0
    first (key -2, below any cosine), then ascending similarity to token 0; random: the draw ``u``."""
    if seeding == "random":
        return u
    sim0 = (kr * kr[:, :, :1]).sum(-1)                                  # [B,H,l] similarity to token 0
    return torch.cat([torch.full_like(sim0[..., :1], -2.0), sim0[..., 1:]], dim=-1)


def _route_chunk(kr: torch.Tensor, dict_read: torch.Tensor, n_old: int, n_new: int,
                 seeding: str, u: torch.Tensor | None) -> torch.Tensor:
    """Slot ids [B,H,l] for one complete chunk. kr [B,H,l,D] unit keys (f32), dict_read [B,H,n_old,D] f32."""
    B, H, l, _ = kr.shape
    dev = kr.device
    if n_old > 0:
        sim = torch.einsum("bhld,bhnd->bhln", kr, dict_read)            # [B,H,l,n_old]
        best_sim = sim.max(dim=-1).values
        route = _first_argmax(sim)
        if n_new > 0:
            order_key = best_sim if seeding == "spread" else u
            chosen = torch.argsort(order_key, dim=-1, stable=True)[..., :n_new]   # [B,H,n_new]
            ids = torch.arange(n_old, n_old + n_new, device=dev).expand(B, H, n_new)
            route = route.scatter(2, chosen, ids)
        return route
    # First seeding: empty dictionary, n_new > 0 seeds taken from this chunk.
    seeds = torch.argsort(_seed_keys(kr, seeding, u), dim=-1, stable=True)[..., :n_new]
    seed_keys = kr.gather(2, seeds.unsqueeze(-1).expand(B, H, n_new, kr.shape[-1]))
    route = _first_argmax(torch.einsum("bhld,bhsd->bhls", kr, seed_keys))
    ids = torch.arange(n_new, device=dev).expand(B, H, n_new)
    return route.scatter(2, seeds, ids)                                # seeds own their slot


def _rank_gaps(order_key: torch.Tensor, own_sorted: torch.Tensor, slot: torch.Tensor, is_founder: torch.Tensor):
    """Founder gaps: the founder of new slot ``i`` ([B,H,l] ``slot`` = i on founders) is the loop's
    rank-``i`` token, so its key must equal the ``i``-th lowest key ``own_sorted[..., i]``; its gap is
    the distance between the two (inf where a new slot has no founder or more than one)."""
    idx = torch.where(is_founder, slot, 0)
    hits = torch.zeros_like(own_sorted).scatter_add(2, idx, is_founder.float())
    key = torch.zeros_like(own_sorted).scatter_add(2, idx, torch.where(is_founder, order_key, 0.0))
    per_slot = torch.where(hits == 1, (key - own_sorted).abs(), torch.inf)
    return torch.where(is_founder, per_slot.gather(2, idx), 0.0)


def _decision_gaps(kr: torch.Tensor, dict_read: torch.Tensor, n_old: int, n_new: int, seeding: str,
                   u: torch.Tensor | None, r: torch.Tensor) -> torch.Tensor:
    """How far the slot ids ``r`` [B,H,l] (forced) fall short of the loop's own decisions in this
    chunk, on the same dictionary, in similarity units [B,H,l] f32: 0 for the loop's own choice, so a
    route that differs only at a near-tie has a gap of a few ulps (docs/design.md §4.2 "Near ties").

    - a token merged into an old slot: best similarity minus the similarity to its slot;
    - the founder of a new slot ``n_old + i``: the distance of its ranking key (best similarity,
      or the draw ``u``) to the loop's ``i``-th lowest key;
    - first seeding: each slot's seed is taken to be the member whose ranking key is nearest the
      loop's key at that rank; its gap is that distance, the other members' is best seed similarity
      minus the similarity to their own seed.
    """
    B, H, l, _ = kr.shape
    if n_old > 0:
        sim = torch.einsum("bhld,bhnd->bhln", kr, dict_read)
        best = sim.max(dim=-1).values
        founder = r >= n_old
        merge_gap = best - sim.gather(3, r.clamp(max=n_old - 1).unsqueeze(-1)).squeeze(-1)
        if n_new == 0:
            return merge_gap
        order_key = best if seeding == "spread" else u
        own_sorted = order_key.sort(dim=-1, stable=True).values[..., :n_new]
        founder_gap = _rank_gaps(order_key, own_sorted, r - n_old, founder)
        return torch.where(founder, founder_gap, merge_gap)
    keys = _seed_keys(kr, seeding, u)
    own_sorted = keys.sort(dim=-1, stable=True).values[..., :n_new]
    dist = (keys - own_sorted.gather(2, r)).abs()                       # each token as its slot's seed
    best_dist = torch.full_like(own_sorted, torch.inf).scatter_reduce(2, r, dist, "amin")
    pos = torch.arange(l, device=kr.device).expand(B, H, l)
    candidate = torch.where(dist == best_dist.gather(2, r), pos, l)
    seed_of = torch.full((B, H, n_new), l, device=kr.device).scatter_reduce(2, r, candidate, "amin")
    is_seed = pos == seed_of.gather(2, r)
    seeds = kr.gather(2, seed_of.unsqueeze(-1).expand(B, H, n_new, kr.shape[-1]))  # [B,H,n_new,D]
    seed_sim = torch.einsum("bhld,bhsd->bhls", kr, seeds)
    member_gap = seed_sim.max(dim=-1).values - seed_sim.gather(3, r.unsqueeze(-1)).squeeze(-1)
    return torch.where(is_seed, best_dist.gather(2, r), member_gap)


def _check_forced(r: torch.Tensor, c: int, n_old: int, n_next: int, routed: bool) -> None:
    if not routed:
        if (r != -1).any():
            raise ValueError(f"routes: chunk {c} is not routed, its routes must all be -1")
        return
    if ((r < 0) | (r >= n_next)).any():
        raise ValueError(f"routes: chunk {c} must use slot ids in [0, {n_next}), "
                         f"got values in [{int(r.min())}, {int(r.max())}]")
    hits = torch.zeros(*r.shape[:2], max(n_next, 1), dtype=torch.long, device=r.device)
    hits = hits.scatter_add(2, r, torch.ones_like(r))
    if n_next > n_old and (hits[..., n_old:n_next] == 0).any():
        raise ValueError(f"routes: chunk {c} must create every new slot {n_old}..{n_next - 1}")


def _validate(q, k, v, beta, chunk_size, max_centroids, growth, growth_horizon, seeding, seed, routes):
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got {type(x).__name__}"
                            + (f" of dtype {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must have rank 4 [B, H, T, D], got shape {tuple(x.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.shape[:3] != q.shape[:3]:
            raise ValueError(f"{name} must match q in [B, H, T]={tuple(q.shape[:3])}, got {tuple(x.shape)}")
        if x.dtype != q.dtype or x.device != q.device:
            raise TypeError(f"{name} must have q's dtype/device ({q.dtype}, {q.device}), got ({x.dtype}, {x.device})")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have q's head dim D={q.shape[-1]}, got {k.shape[-1]}")
    if beta.shape != (q.shape[1],):
        raise ValueError(f"beta must have shape [H]=({q.shape[1]},), got {tuple(beta.shape)}")
    if beta.device != q.device:
        raise TypeError(f"beta must be on q's device {q.device}, got {beta.device}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not isinstance(max_centroids, int) or isinstance(max_centroids, bool) or max_centroids < 1:
        raise ValueError(f"max_centroids must be an int >= 1, got {max_centroids!r}")
    if growth not in GROWTHS:
        raise ValueError(f"growth must be one of {GROWTHS}, got {growth!r}")
    if growth_horizon is not None and (not isinstance(growth_horizon, int)
                                       or isinstance(growth_horizon, bool) or growth_horizon < 1):
        raise ValueError(f"growth_horizon must be a positive int or None, got {growth_horizon!r}")
    if seeding not in SEEDINGS:
        raise ValueError(f"seeding must be one of {SEEDINGS}, got {seeding!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if routes is not None:
        if not isinstance(routes, torch.Tensor) or routes.dtype != torch.int64:
            raise TypeError(f"routes must be an int64 torch.Tensor, got "
                            f"{routes.dtype if isinstance(routes, torch.Tensor) else type(routes).__name__}")
        if routes.shape != q.shape[:3]:
            raise ValueError(f"routes must have shape [B, H, T]={tuple(q.shape[:3])}, got {tuple(routes.shape)}")


def ovq_attention_reference(q, k, v, beta, *, chunk_size: int, max_centroids: int,
                            growth: str = "plateau", growth_horizon: int | None = None,
                            seeding: str = "spread", seed: int = 0, normalize_centroids: bool = False,
                            routes: torch.Tensor | None = None) -> OVQReferenceResult:
    """OVQ-attention by the paper's chunk loop.

    q, k: [B, H, T, D]; v: [B, H, T, Dv]; beta: [H]. ``routes`` ([B, H, T] int64)
    forces the slot ids instead of routing; ``gaps`` [B, H, T] then says how far each forced
    decision falls short of the loop's own on the same (forced) history (``_decision_gaps``; 0 for
    the loop's own routes). Returns out [B, H, T, Dv] (q's dtype), routes [B, H, T],
    counts [B, H, N] f32, sizes, the final dictionaries and the gaps.
    """
    _validate(q, k, v, beta, chunk_size, max_centroids, growth, growth_horizon, seeding, seed, routes)
    B, H, T, D = q.shape
    Dv, L, N, dev = v.shape[-1], chunk_size, max_centroids, q.device
    cdt = torch.promote_types(q.dtype, torch.float32)      # compute dtype (f32 or f64)
    n_chunks = -(-T // L)
    schedule = ovq_schedule(n_chunks, L, N, growth, growth_horizon)

    qh = F.normalize(q.to(cdt), dim=-1) * beta.to(cdt).view(1, H, 1, 1)
    kh = F.normalize(k.to(cdt), dim=-1)
    vv = v.to(cdt)
    kr_all = F.normalize(k.detach().float(), dim=-1)        # routing keys, float32

    D_k = torch.zeros(B, H, N, D, dtype=cdt, device=dev)     # differentiable dictionaries
    D_v = torch.zeros(B, H, N, Dv, dtype=cdt, device=dev)
    R_k = torch.zeros(B, H, N, D, dtype=torch.float32, device=dev)  # routing copy, no grad
    counts = torch.zeros(B, H, N, dtype=torch.float32, device=dev)
    out_routes = torch.full((B, H, T), -1, dtype=torch.long, device=dev)
    gaps = torch.zeros(B, H, T, dtype=torch.float32, device=dev)
    gen = torch.Generator().manual_seed(seed) if seeding == "random" else None
    outs, sizes = [], [0]

    for c in range(n_chunks):
        s, e = c * L, min((c + 1) * L, T)
        l, n_old = e - s, sizes[c]
        u = torch.rand((B, H, L), generator=gen).to(dev) if gen is not None else None

        # Prediction: rows [D_k[:n_old] ; k_c], values [D_v[:n_old] ; v_c], bias [log counts ; 0].
        dk_read = F.normalize(D_k[:, :, :n_old], dim=-1) if normalize_centroids else D_k[:, :, :n_old]
        rows = torch.cat([dk_read, kh[:, :, s:e]], dim=2)                 # [B,H,n_old+l,D]
        vals = torch.cat([D_v[:, :, :n_old], vv[:, :, s:e]], dim=2)       # [B,H,n_old+l,Dv]
        causal = torch.ones(l, l, dtype=torch.bool, device=dev).tril()
        tok_bias = torch.zeros(l, l, dtype=cdt, device=dev).masked_fill(~causal, float("-inf"))
        dict_bias = counts[:, :, :n_old].to(cdt).log()                    # [B,H,n_old]
        bias = torch.cat([dict_bias.unsqueeze(2).expand(B, H, l, n_old),
                          tok_bias.expand(B, H, l, l)], dim=-1)           # [B,H,l,n_old+l]
        scores = torch.einsum("bhid,bhjd->bhij", qh[:, :, s:e], rows) + bias
        outs.append(torch.einsum("bhij,bhjd->bhid", scores.softmax(dim=-1), vals))

        # Update (complete chunks only; nothing to do while the schedule stays at 0).
        n_next = schedule[c + 1]
        routed = l == L and not (n_old == 0 and n_next == 0)
        if routes is not None:
            r = routes[:, :, s:e].to(dev)
            _check_forced(r, c, n_old, n_next, routed)
        if not routed:
            sizes.append(n_old)
            continue
        with torch.no_grad():
            r_read = F.normalize(R_k[:, :, :n_old], dim=-1) if normalize_centroids else R_k[:, :, :n_old]
            if routes is None:
                r = _route_chunk(kr_all[:, :, s:e], r_read, n_old, n_next - n_old, seeding, u)
            else:
                gaps[:, :, s:e] = _decision_gaps(kr_all[:, :, s:e], r_read, n_old, n_next - n_old, seeding, u, r)
        out_routes[:, :, s:e] = r
        D_k, _ = _running_mean_update(D_k, counts, r, kh[:, :, s:e])
        D_v, _ = _running_mean_update(D_v, counts, r, vv[:, :, s:e])
        R_k, counts = _running_mean_update(R_k, counts, r, kr_all[:, :, s:e])
        sizes.append(n_next)

    out = torch.cat(outs, dim=2) if outs else vv.new_zeros(B, H, 0, Dv)
    return OVQReferenceResult(out=out.to(q.dtype), routes=out_routes, counts=counts,
                              sizes=sizes, keys=D_k, values=D_v, gaps=gaps)
