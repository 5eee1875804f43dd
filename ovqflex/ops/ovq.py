"""``ovq_attention``: OVQ-attention as one attention program (docs/design.md §4.2).

q, k ─normalize─▶ routes (no grad) ─▶ snapshots (differentiable segment means)
─▶ program [per-chunk state bank (log-count bias) ; own chunk causal] ─▶ backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from masks.program import DEFAULT_BLOCK, AttentionProgram, scaled_unit_queries, unit_rows
from masks.regions import OwnChunk
from recurrences.checks import (check_choice, check_chunk, check_finite_args, check_int, check_qkv, check_tensor,
                                options_of)
from recurrences.compiling import size_max
from recurrences.ovq import (GROWTHS, ROUTING_IMPLS, SEEDINGS, DictionarySchedule, build_ovq_snapshots,
                             build_ovq_versioned, dictionary_size, dictionary_sizes, route_ovq)
from recurrences.precision import routing_keys, to_compute_dtype
from recurrences.versioned import check_state_layout

from ..attention import attend
from ..profiling import stage
from .state_program import build_state_program


@dataclass
class OVQState:
    """What ``return_state=True`` adds: routes ``[B, H, T]`` (-1: not routed),
    counts ``[B, H, R]`` of the dictionary after the last complete chunk, and
    ``sizes`` (``sizes[c]``: dictionary size chunk ``c`` reads)."""

    routes: Tensor
    counts: Tensor
    sizes: list[int]


@dataclass(frozen=True)
class OVQOptions:
    """OVQ-attention's options, validated once; shared by :func:`ovq_program`, :func:`ovq_attention`,
    :class:`~ovqflex.OVQAttention` and its decode cache.

    ``chunk_size`` ``L`` (a multiple of 16); ``max_centroids`` ``N``, the dictionary cap; ``growth``
    (``"plateau"``: ``floor(t N / (t + N))`` slots after ``t`` tokens, ``"full"``, ``"linear"``
    over ``growth_horizon`` tokens, default ``4N``); ``seeding`` of the first chunk (``"spread"`` or
    ``"random"`` from ``seed``); ``normalize_centroids``: unit-norm dictionary keys (also for
    routing); ``state_layout`` (docs/design.md §5): ``"snapshot"`` lays out one dictionary per
    chunk (``n_chunks * N`` state rows), ``"versioned"`` checkpoints every ``checkpoint_every``
    chunks (None: about ``N / 2L``, or ``N / L`` where memory decides: ``recurrences.versioned.default_every``)
    plus one version row per token (about ``3T`` or ``2T`` rows, memory-linear), ``"auto"`` picks the one
    whose backward keeps less, or without gradients the faster forward on the device
    (``recurrences.versioned.choose_state_layout``) — same outputs and gradients;
    ``block_size``: the attention block (a power of two >= 16); ``routing``: ``"auto"``
    (``"static"`` on CUDA, ``"loop"`` elsewhere), ``"loop"`` or ``"static"`` (the same routes from a
    compiled static-shape chunk step, on CUDA the whole run replayed from one CUDA graph;
    docs/design.md §4.2).
    """

    chunk_size: int = 128
    max_centroids: int = 2048
    growth: str = "plateau"
    growth_horizon: int | None = None
    seeding: str = "spread"
    seed: int = 0
    normalize_centroids: bool = False
    state_layout: str = "auto"
    checkpoint_every: int | None = None
    block_size: int = DEFAULT_BLOCK
    routing: str = "auto"

    def __post_init__(self):
        check_chunk("chunk_size", self.chunk_size)
        check_int("max_centroids", self.max_centroids)
        check_choice("routing", self.routing, ROUTING_IMPLS)
        check_choice("growth", self.growth, GROWTHS)
        check_choice("seeding", self.seeding, SEEDINGS)
        if self.growth_horizon is not None:
            check_int("growth_horizon", self.growth_horizon)
        check_state_layout(self.state_layout, self.checkpoint_every, self.block_size)

    @property
    def schedule(self) -> DictionarySchedule:
        """The chunk size and the dictionary size each chunk reads."""
        return DictionarySchedule(self.chunk_size, self.max_centroids, self.growth, self.growth_horizon)

    def size(self, c: int) -> int:
        """Dictionary rows chunk ``c`` reads."""
        return dictionary_size(c, self.chunk_size, self.max_centroids, self.growth, self.growth_horizon)

    def sizes(self, n_chunks: int) -> list[int]:
        """``sizes[c]``: dictionary rows chunk ``c`` reads, for ``c = 0..n_chunks``."""
        return dictionary_sizes(n_chunks, self.chunk_size, self.max_centroids, self.growth, self.growth_horizon)


def ovq_program(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, options: OVQOptions | None = None,
                check_finite: bool | None = None, **option_kwargs) -> tuple[AttentionProgram, Tensor, Tensor]:
    """The OVQ attention program, without running it (what the visualizer draws).

    q, k ``[B, H, T, D]``, v ``[B, H, T, Dv]``, beta ``[H]`` -> ``(program, routes [B, H, T], sizes)``,
    ``sizes [n_chunks + 1]`` int64: the dictionary rows each chunk reads. Nothing here is planned
    from the length in Python: the sizes are a formula of it (:class:`DictionarySchedule`), so under
    ``torch.compile(dynamic=True)`` one graph serves every length.
    Options: an :class:`OVQOptions`, or its fields as keywords. q, k, v are cast to one compute
    dtype; routing reads fp32 unit keys (:mod:`recurrences.precision`). ``check_finite=True``
    refuses nan/inf in q, k, v, beta (None: :func:`ovqflex.finite_checks`; eager only). Stages are
    labelled ``ovqflex.proj`` (normalization), ``ovqflex.routing``, ``ovqflex.state_build`` and
    ``ovqflex.block_mask`` for ``torch.profiler``.
    """
    o = options_of(OVQOptions, options, option_kwargs, "OVQ options")
    check_qkv(q, k, v)
    check_tensor("beta", beta, 1)
    if beta.shape[0] != q.shape[1]:
        raise ValueError(f"beta must have shape [H]=[{q.shape[1]}], got {tuple(beta.shape)}")
    check_finite_args(check_finite, q=q, k=k, v=v, beta=beta)
    schedule = o.schedule
    q, k, v = to_compute_dtype(q, k, v)
    T = q.shape[2]
    n_chunks = size_max(1, -(-T // o.chunk_size))
    sizes = schedule.live(n_chunks + 1, q.device)  # chunks 0..n_chunks: the last is the dictionary after T
    with stage("proj"):
        kn = unit_rows(k)
        q_scaled = scaled_unit_queries(q, beta)
    with stage("routing"):
        routes = route_ovq(routing_keys(k), schedule=schedule, seeding=o.seeding, seed=o.seed,
                           normalize_centroids=o.normalize_centroids, impl=o.routing)
    program = build_state_program(
        q_scaled, kn, v, OwnChunk(o.chunk_size), scale=1.0, sizes=sizes, rows=schedule.rows(n_chunks), lag=1,
        options=o, snapshots=lambda: build_ovq_snapshots(kn, v, routes, schedule=schedule,
                                                         normalize_centroids=o.normalize_centroids),
        versioned=lambda plan: build_ovq_versioned(kn, v, routes, plan, o.normalize_centroids), count_bias=True,
        rows_at=schedule.rows)
    return program, routes, sizes


def ovq_attention(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, backend: str = "auto",
                  return_state: bool = False, options: OVQOptions | None = None, check_finite: bool | None = None,
                  **option_kwargs):
    """OVQ-attention. q, k ``[B, H, T, D]``, v ``[B, H, T, Dv]``, beta ``[H]`` -> ``[B, H, T, Dv]``
    (and an :class:`OVQState` with ``return_state=True``).

    q and k are L2-normalized inside; scores are ``beta[h] * <q̂, row>`` plus ``log(count)``
    on dictionary rows. Chunk ``c`` reads the dictionary of the chunks before it and its
    own tokens causally. Options: an :class:`OVQOptions` (chunk size, dictionary cap and growth,
    seeding, state layout, block size), or its fields as keywords. ``check_finite`` as
    :func:`ovq_program`.
    """
    o = options_of(OVQOptions, options, option_kwargs, "OVQ options")
    program, routes, sizes = ovq_program(q, k, v, beta, options=o, check_finite=check_finite)
    with stage("attention"):
        out = attend(program, backend)
    if not return_state:
        return out
    sizes = sizes.tolist()
    return out, OVQState(routes, _route_histogram(routes, sizes[q.shape[2] // o.chunk_size]), sizes)


def _route_histogram(routes: Tensor, n_slots: int) -> Tensor:
    """Counts ``[B, H, n_slots]`` of the routes (the dictionary after the last complete chunk)."""
    valid = routes >= 0
    counts = torch.zeros(*routes.shape[:2], n_slots + 1, device=routes.device)
    return counts.scatter_add(2, torch.where(valid, routes, n_slots), valid.float())[..., :n_slots]


def ovq_flops(T: int, H: int, D: int, options: OVQOptions, B: int = 1) -> float:
    """Model FLOPs of OVQ attention: per chunk, QK^T and PV over the dictionary rows it reads plus
    the causal half of its own chunk (2 matmuls x 2 FLOPs per multiply-add)."""
    chunk_size = options.chunk_size
    sizes = options.sizes(-(-T // chunk_size))
    total = 0
    for c in range(-(-T // chunk_size)):
        lq = min(chunk_size, T - c * chunk_size)
        total += lq * sizes[c] + lq * (lq + 1) / 2
    return 4.0 * B * H * D * total
