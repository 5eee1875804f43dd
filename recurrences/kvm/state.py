"""Differentiable KVM state: snapshots and the versioned layout (docs/design.md §4.3, §5).

Given the routes, the state query chunk ``c`` reads is, per row, a sum over the
tokens absorbed before it (tokens of chunks ``< c - Nb + 1``): the founder with
weight 1 and every merged token with its gate ``g``. Keys and values are the
shared segment sums of :mod:`recurrences.segments` (``lag = Nb``); the readout
transforms follow: ``LN_s`` on the key sums, and values renormalized to the
founder's radius ``rho = ||v_founder||`` (or divided by the row's token count).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..precision import no_autocast
from ..segments import segment_snapshot_sums
from ..versioned import VersionPlan, versioned_sums


def memory_keys(k: Tensor, rope_dims: int, ln_weight: Tensor, ln_bias: Tensor, ln_eps: float = 1e-5) -> Tensor:
    """``kbar = LN_s(k with its first rope_dims channels zeroed)``: k ``[B, H, T, D]`` -> ``[B, H, T, D]``."""
    D = k.shape[-1]
    keep = (torch.arange(D, device=k.device) >= rope_dims).to(k.dtype)
    return F.layer_norm(k * keep, (D,), ln_weight.to(k.dtype), ln_bias.to(k.dtype), ln_eps)


def routing_memory_keys(k: Tensor, rope_dims: int, ln_weight: Tensor, ln_bias: Tensor,
                        ln_eps: float = 1e-5) -> Tensor:
    """The fp32 memory keys KVM routing reads (:mod:`recurrences.precision`): :func:`memory_keys`
    of ``k.float()`` with fp32 ``LN_s`` parameters, autocast off, detached. ``[B, H, T, D]``."""
    with no_autocast(k):
        return memory_keys(k.detach().float(), rope_dims, ln_weight.detach().float(), ln_bias.detach().float(),
                           ln_eps)


@dataclass
class KVMSnapshots:
    """Per-query-chunk readout state, ``R`` rows each (``R`` = largest state any chunk reads).

    keys ``[B, H, n_chunks, R, D]`` (``LN_s`` of the key sums, before ``tau_state``),
    values ``[B, H, n_chunks, R, Dv]`` (readout values), counts ``[B, H, n_chunks, R]`` fp32
    tokens per row, live ``[n_chunks]`` int64 (rows chunk ``c`` reads: ``sizes[c]``).
    """

    keys: Tensor
    values: Tensor
    counts: Tensor
    live: Tensor


def build_kvm_snapshots(kbar: Tensor, v: Tensor, gate: Tensor, routes: Tensor, founder: Tensor, *, chunk: int,
                        n_bswa_chunks: int, sizes: list[int], ln_weight: Tensor, ln_bias: Tensor,
                        ln_eps: float = 1e-5, use_vlens: bool = True, norm_eps: float = 1e-12) -> KVMSnapshots:
    """kbar ``[B, H, T, D]`` memory keys, v ``[B, H, T, Dv]``, gate ``[B, H, T]``, routes/founder
    ``[B, H, T]`` from :func:`~recurrences.kvm.routing.route_kvm`; ``sizes[c]`` live rows of chunk c."""
    B, H, T, D = kbar.shape
    n_chunks, rows = len(sizes), max(sizes)
    weight = torch.where(founder, torch.ones_like(gate), gate).to(kbar.dtype)[..., None]  # [B, H, T, 1]
    sk, counts = segment_snapshot_sums(weight * kbar, routes, chunk, n_chunks, rows, lag=n_bswa_chunks)
    sv, _ = segment_snapshot_sums(weight.to(v.dtype) * v, routes, chunk, n_chunks, rows, lag=n_bswa_chunks)
    keys = F.layer_norm(sk, (D,), ln_weight.to(sk.dtype), ln_bias.to(sk.dtype), ln_eps)
    if use_vlens:
        # radius of a row: the norm of its founder's value, fixed for the row's lifetime
        slot = torch.where(founder & (routes >= 0), routes, rows)
        radius = torch.linalg.vector_norm(v.float(), dim=-1) * founder
        rho = radius.new_zeros(B, H, rows + 1).scatter_add(2, slot, radius)[..., :rows]  # [B, H, R]
        svf = sv.float()
        values = rho[:, :, None, :, None] * svf / torch.linalg.vector_norm(svf, dim=-1, keepdim=True).clamp_min(norm_eps)
    else:
        values = sv.float() / counts.clamp_min(1.0)[..., None]
    live = torch.tensor(sizes, dtype=torch.long, device=kbar.device)
    return KVMSnapshots(keys, values.to(v.dtype), counts, live)


@dataclass
class KVMVersioned:
    """The versioned layout (docs/design.md §5) of the same states: ``S = plan.state_rows`` rows,
    checkpoints then one version row per token (:mod:`recurrences.versioned`, ``lag = Nb``).

    keys ``[B, H, S, D]`` (``LN_s`` of the key sums, before ``tau_state``), values
    ``[B, H, S, Dv]`` (readout values), born/dies ``[B, H, S]`` int32 (row ``r`` is live for
    query chunk ``c`` iff ``born <= c < dies``).
    """

    keys: Tensor
    values: Tensor
    born: Tensor
    dies: Tensor
    plan: VersionPlan


def build_kvm_versioned(kbar: Tensor, v: Tensor, gate: Tensor, routes: Tensor, founder: Tensor, plan: VersionPlan, *,
                        ln_weight: Tensor, ln_bias: Tensor, ln_eps: float = 1e-5, use_vlens: bool = True,
                        norm_eps: float = 1e-12) -> KVMVersioned:
    """Versioned rows of the KVM states: the same gated sums and per-row readout as
    :func:`build_kvm_snapshots` (``LN_s`` keys; values at the founder's radius or ``s_v / count``)."""
    B, H, T, D = kbar.shape
    rows = plan.rows
    weight = torch.where(founder, torch.ones_like(gate), gate).to(kbar.dtype)[..., None]
    vs = versioned_sums([weight * kbar, weight.to(v.dtype) * v], routes, plan)
    sk = torch.cat([vs.ckpt[0].flatten(2, 3), vs.ver[0]], 2)
    sv = torch.cat([vs.ckpt[1].flatten(2, 3), vs.ver[1]], 2)
    keys = F.layer_norm(sk, (D,), ln_weight.to(sk.dtype), ln_bias.to(sk.dtype), ln_eps)
    if use_vlens:
        slot = torch.where(founder & (routes >= 0), routes, rows)
        radius = torch.linalg.vector_norm(v.float(), dim=-1) * founder
        rho = radius.new_zeros(B, H, rows + 1).scatter_add(2, slot, radius)  # [B, H, rows + 1], spare last
        row_rho = torch.cat([rho[:, :, :rows].repeat(1, 1, plan.n_ckpt), rho.gather(2, vs.ver_slot)], 2)
        svf = sv.float()
        values = row_rho[..., None] * svf / torch.linalg.vector_norm(svf, dim=-1, keepdim=True).clamp_min(norm_eps)
    else:
        counts = torch.cat([vs.ckpt_counts.flatten(2), vs.ver_counts], 2)
        values = sv.float() / counts.clamp_min(1.0)[..., None]
    return KVMVersioned(keys, values.to(v.dtype), vs.born, vs.dies, plan)
