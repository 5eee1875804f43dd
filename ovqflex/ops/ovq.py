"""``ovq_attention``: OVQ-attention as one attention program (docs/design.md §4.2).

q, k ─normalize─▶ routes (no grad) ─▶ snapshots (differentiable segment means)
─▶ program [per-chunk state bank (log-count bias) ; own chunk causal] ─▶ backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from masks.program import DEFAULT_BLOCK, AttentionProgram, build_program
from masks.regions import OwnChunk, StateBank
from masks.versioned import versioned_regions
from recurrences.checks import check_choice, check_chunk, check_int, check_qkv, check_tensor
from recurrences.ovq import GROWTHS, SEEDINGS, build_ovq_snapshots, build_ovq_versioned, dictionary_sizes, route_ovq
from recurrences.precision import routing_keys, to_compute_dtype
from recurrences.versioned import check_state_layout, choose_state_layout, plan_versioned

from ..attention import attend
from ..profiling import stage


@dataclass
class OVQState:
    """What ``return_state=True`` adds: routes ``[B, H, T]`` (-1: not routed),
    counts ``[B, H, R]`` of the dictionary after the last complete chunk, and
    ``sizes`` (``sizes[c]``: dictionary size chunk ``c`` reads)."""

    routes: Tensor
    counts: Tensor
    sizes: list[int]


def _check_ovq_args(q, k, v, beta, chunk_size, max_centroids, growth, seeding, growth_horizon, state_layout,
                    checkpoint_every, block_size):
    check_qkv(q, k, v)
    check_tensor("beta", beta, 1)
    if beta.shape[0] != q.shape[1]:
        raise ValueError(f"beta must have shape [H]=[{q.shape[1]}], got {tuple(beta.shape)}")
    check_chunk("chunk_size", chunk_size)
    check_int("max_centroids", max_centroids)
    check_choice("growth", growth, GROWTHS)
    check_choice("seeding", seeding, SEEDINGS)
    if growth_horizon is not None:
        check_int("growth_horizon", growth_horizon)
    check_state_layout(state_layout, checkpoint_every, block_size)


def ovq_program(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, chunk_size: int = 128, max_centroids: int,
                growth: str = "plateau", growth_horizon: int | None = None, seeding: str = "spread",
                seed: int = 0, normalize_centroids: bool = False, state_layout: str = "auto",
                checkpoint_every: int | None = None,
                block_size: int = DEFAULT_BLOCK) -> tuple[AttentionProgram, Tensor, list[int]]:
    """The OVQ attention program, without running it (what the visualizer draws).

    q, k ``[B, H, T, D]``, v ``[B, H, T, Dv]``, beta ``[H]`` -> ``(program, routes [B, H, T], sizes)``.
    q, k, v are cast to one compute dtype; routing reads fp32 unit keys (:mod:`recurrences.precision`).
    Stages are labelled ``ovqflex.proj`` (normalization), ``ovqflex.routing``,
    ``ovqflex.state_build`` and ``ovqflex.block_mask`` for ``torch.profiler``.
    """
    _check_ovq_args(q, k, v, beta, chunk_size, max_centroids, growth, seeding, growth_horizon, state_layout,
                    checkpoint_every, block_size)
    q, k, v = to_compute_dtype(q, k, v)
    B, H, T, _ = q.shape
    n_chunks = max(1, -(-T // chunk_size))
    sizes = dictionary_sizes(n_chunks, chunk_size, max_centroids, growth, growth_horizon)
    with stage("proj"):
        qn, kn = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        q_scaled = qn * beta.to(qn.dtype).view(1, H, 1, 1)
    with stage("routing"):
        routes = route_ovq(routing_keys(k), chunk=chunk_size, sizes=sizes, seeding=seeding, seed=seed,
                           normalize_centroids=normalize_centroids)
    rows = max(sizes[:n_chunks])
    if rows == 0:  # no chunk reads a dictionary: attention inside each chunk only
        with stage("block_mask"):
            program = build_program(q_scaled, kn, v, (OwnChunk(chunk_size),), scale=1.0, block_size=block_size)
        return program, routes, sizes
    plan = plan_versioned(n_chunks, chunk_size, rows, 1, checkpoint_every, align=block_size)
    if choose_state_layout(state_layout, n_chunks=n_chunks, rows=rows, plan=plan) == "versioned":
        with stage("state_build"):
            ver = build_ovq_versioned(kn, v, routes, plan, normalize_centroids)
        with stage("block_mask"):
            regions = versioned_regions(plan, sizes, ver.born, ver.dies) + (OwnChunk(chunk_size),)
            program = build_program(q_scaled, kn, v, regions, scale=1.0, state_k=ver.keys, state_v=ver.values,
                                    state_bias=ver.bias(), block_size=block_size)
        return program, routes, sizes
    with stage("state_build"):
        snap = build_ovq_snapshots(kn, v, routes, chunk=chunk_size, sizes=sizes,
                                   normalize_centroids=normalize_centroids)
        bias = torch.where(snap.counts > 0, snap.counts.log(), float("-inf"))
    with stage("block_mask"):
        program = build_program(
            q_scaled, kn, v, (StateBank(rows, chunk_size, snap.live), OwnChunk(chunk_size)), scale=1.0,
            state_k=snap.keys.flatten(2, 3), state_v=snap.values.flatten(2, 3), state_bias=bias.flatten(2, 3),
            block_size=block_size,
        )
    return program, routes, sizes


def ovq_attention(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, chunk_size: int = 128, max_centroids: int,
                  growth: str = "plateau", growth_horizon: int | None = None, seeding: str = "spread",
                  seed: int = 0, normalize_centroids: bool = False, backend: str = "auto",
                  state_layout: str = "auto", checkpoint_every: int | None = None,
                  return_state: bool = False, block_size: int = DEFAULT_BLOCK):
    """OVQ-attention. q, k ``[B, H, T, D]``, v ``[B, H, T, Dv]``, beta ``[H]`` -> ``[B, H, T, Dv]``
    (and an :class:`OVQState` with ``return_state=True``).

    q and k are L2-normalized inside; scores are ``beta[h] * <q̂, row>`` plus ``log(count)``
    on dictionary rows. Chunk ``c`` reads the dictionary of the chunks before it and its
    own tokens causally.

    ``state_layout`` (docs/design.md §5): ``"snapshot"`` lays out one dictionary per chunk
    (``n_chunks * N`` state rows); ``"versioned"`` checkpoints every ``checkpoint_every``
    chunks (None: ``ceil(N / 2L)``) plus one version row per token (about ``2T`` rows,
    memory-linear); ``"auto"`` picks the one with fewer rows. Outputs and gradients are the same.
    """
    program, routes, sizes = ovq_program(
        q, k, v, beta, chunk_size=chunk_size, max_centroids=max_centroids, growth=growth,
        growth_horizon=growth_horizon, seeding=seeding, seed=seed, normalize_centroids=normalize_centroids,
        state_layout=state_layout, checkpoint_every=checkpoint_every, block_size=block_size)
    with stage("attention"):
        out = attend(program, backend)
    if not return_state:
        return out
    T = q.shape[2]
    return out, OVQState(routes, _route_histogram(routes, sizes[T // chunk_size]), sizes)


def _route_histogram(routes: Tensor, n_slots: int) -> Tensor:
    """Counts ``[B, H, n_slots]`` of the routes (the dictionary after the last complete chunk)."""
    valid = routes >= 0
    counts = torch.zeros(*routes.shape[:2], n_slots + 1, device=routes.device)
    return counts.scatter_add(2, torch.where(valid, routes, n_slots), valid.float())[..., :n_slots]


def ovq_flops(T: int, H: int, D: int, chunk_size: int, sizes: list[int], B: int = 1) -> float:
    """Model FLOPs of OVQ attention: per chunk, QK^T and PV over its ``sizes[c]`` dictionary rows
    plus the causal half of its own chunk (2 matmuls x 2 FLOPs per multiply-add)."""
    total = 0
    for c in range(-(-T // chunk_size)):
        lq = min(chunk_size, T - c * chunk_size)
        total += lq * sizes[c] + lq * (lq + 1) / 2
    return 4.0 * B * H * D * total
