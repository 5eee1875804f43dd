"""Differentiable KVM state: snapshots and the versioned layout (docs/design.md §4.3, §5).

Given the routes, the state query chunk ``c`` reads is, per row, a sum over the
tokens absorbed before it (tokens of chunks ``< c - Nb + 1``): the founder with
weight 1 and every merged token with its gate ``g``. Keys and values are the
shared segment sums of :mod:`recurrences.segments` (``lag = Nb``); the readout
transforms follow: ``LN_s`` on the key sums, and values renormalized to the
founder's radius ``rho = ||v_founder||`` (or divided by the row's token count).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..compiling import eager_kernels
from ..precision import no_autocast, widened, work_dtype
from ..segments import Snapshots, segment_snapshot_sums
from ..versioned import Versioned, VersionPlan, versioned_sums
from .budget import KVMSchedule


def memory_keys(k: Tensor, rope_dims: int, ln_weight: Tensor, ln_bias: Tensor, ln_eps: float = 1e-5) -> Tensor:
    """``kbar = LN_s(k with its first rope_dims channels zeroed)``: k ``[B, H, T, D]`` -> ``[B, H, T, D]`` in k's dtype.

    Autocast off: CUDA's autocast runs ``layer_norm`` in fp32 (the CPU's keeps its input's dtype), which made
    the memory keys, the key sums and ``LN_s``'s kept input fp32 in a bf16 CUDA layer only (the state sums stay
    in the compute dtype: docs/precision.md)."""
    D = k.shape[-1]
    keep = (torch.arange(D, device=k.device) >= rope_dims).to(k.dtype)
    with no_autocast(k):
        return F.layer_norm(k * keep, (D,), ln_weight.to(k.dtype), ln_bias.to(k.dtype), ln_eps)


def routing_memory_keys(k: Tensor, rope_dims: int, ln_weight: Tensor, ln_bias: Tensor,
                        ln_eps: float = 1e-5) -> Tensor:
    """The fp32 memory keys KVM routing reads (:mod:`recurrences.precision`): :func:`memory_keys`
    of ``k.float()`` with fp32 ``LN_s`` parameters, autocast off, detached; compiled too, the bits the
    eager op routes on (:func:`~recurrences.compiling.eager_kernels`). ``[B, H, T, D]``."""
    return _ln_s_keys(k.detach(), rope_dims, ln_weight.detach(), ln_bias.detach(), ln_eps)


@eager_kernels("ovqflex::ln_s_keys", torch.float32)
def _ln_s_keys(k: Tensor, rope_dims: int, ln_weight: Tensor, ln_bias: Tensor, ln_eps: float) -> Tensor:
    return memory_keys(k.float(), rope_dims, ln_weight.float(), ln_bias.float(), ln_eps)  # autocast off inside


def _weighted(kbar: Tensor, v: Tensor, gate: Tensor, founder: Tensor) -> tuple[Tensor, Tensor]:
    """The summed token vectors: founders with weight 1, merged tokens with their gate ``g``."""
    weight = torch.where(founder, torch.ones_like(gate), gate).to(kbar.dtype)[..., None]  # [B, H, T, 1]
    return weight * kbar, weight.to(v.dtype) * v


def _founder_radius(v: Tensor, routes: Tensor, founder: Tensor, rows: int) -> Tensor:
    """``rho [B, H, rows + 1]`` fp32 (fp64 for fp64 v): the norm of each row's founder value, fixed for the
    row's lifetime (the last entry is a spare for tokens in no row)."""
    B, H = v.shape[:2]
    slot = torch.where(founder & (routes >= 0), routes, rows)
    # fp32 norms read from v itself (on the CPU the same bits as the norm of v.float()), without keeping that fp32
    # copy of every token's value for the backward (the norm keeps its input)
    radius = torch.linalg.vector_norm(v, dim=-1, dtype=work_dtype(v)) * founder
    return radius.new_zeros(B, H, rows + 1).scatter_add(2, slot, radius)


def state_keys(sk: Tensor, ln_weight: Tensor, ln_bias: Tensor, ln_eps: float, tau_state: Tensor | None) -> Tensor:
    """The state's key rows ``LN_s(sk) * tau_state[h]``: sk ``[B, H, ..., D]`` -> the same shape, sk's dtype.

    The temperature is folded into ``LN_s``'s affine map: ``x̂ (w tau_h) + b tau_h``, one ``addcmul`` in sk's
    :func:`work_dtype` (no row-sized intermediate beside x̂), rounded once. Its gradient then reads the
    normalized rows, which the backward recomputes from the sums ``LN_s`` keeps anyway; a product of the keys
    with ``tau_state`` kept the keys for it besides (a compiled KVM layer at 64k under bf16 autocast: 124 MB,
    ``tools/compiled_saved.py kvm --layer``)."""
    D = sk.shape[-1]
    with no_autocast(sk):  # as memory_keys: CUDA's autocast would upcast sk for LN_s and keep that copy
        if tau_state is None:
            return F.layer_norm(sk, (D,), ln_weight.to(sk.dtype), ln_bias.to(sk.dtype), ln_eps)
        dt = work_dtype(sk)
        tau = tau_state.to(dt).view(1, -1, *(1,) * (sk.dim() - 2))  # [1, H, 1.., 1]
        normalized = F.layer_norm(sk, (D,), eps=ln_eps).to(dt)
        return torch.addcmul(ln_bias.to(dt) * tau, normalized, ln_weight.to(dt) * tau).to(sk.dtype)


def readout_rows(sk: Tensor, sv: Tensor, counts: Tensor, rho: Tensor | None, dtype: torch.dtype, ln_weight: Tensor,
                 ln_bias: Tensor, ln_eps: float, tau_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-row readout of the gated sums ``sk [B, H, ..., D]``, ``sv [B, H, ..., Dv]`` (fp32 for fp16 tokens,
    :func:`~recurrences.segments.sum_dtype`), both rows rounded once to ``dtype``: keys ``LN_s(sk) *
    tau_state[h]`` (:func:`state_keys`; ``tau_state [H]`` or None: 1); values ``rho * sv / max(||sv||, 1e-12)``
    (``rho [B, H, ...]``, the founder radius) or, with ``rho=None``, ``sv / count``. The state builds and the
    decode caches (:mod:`ovqflex.ops.kvm_decode`) read their rows through it. The norm's floor is a literal: a
    float that traced code reads from a default or a module global is symbolic under
    ``torch.compile(dynamic=True)``, and torch 2.11 traces the frame again when ``clamp_min`` uses it
    (docs/design.md §3.5)."""
    keys = state_keys(sk, ln_weight, ln_bias, ln_eps, tau_state).to(dtype)
    svf = widened(sv)
    if rho is not None:
        # one product with a per-row scale: the backward keeps svf (the norm's input too) and the [..., 1]
        # scale, not a second row-sized product
        values = svf * (rho[..., None] / torch.linalg.vector_norm(svf, dim=-1, keepdim=True).clamp_min(1e-12))
    else:
        values = svf / counts.clamp_min(1.0)[..., None]
    return keys, values.to(dtype)


def build_kvm_snapshots(kbar: Tensor, v: Tensor, gate: Tensor, routes: Tensor, founder: Tensor, *,
                        schedule: KVMSchedule, ln_weight: Tensor, ln_bias: Tensor, ln_eps: float = 1e-5,
                        tau_state: Tensor | None = None, use_vlens: bool = True) -> Snapshots:
    """kbar ``[B, H, T, D]`` memory keys, v ``[B, H, T, Dv]``, gate ``[B, H, T]``, routes/founder
    ``[B, H, T]`` from :func:`~recurrences.kvm.routing.route_kvm`; ``schedule``: the chunk size, the block
    window and the rows chunk ``c`` reads (:class:`~recurrences.kvm.budget.KVMSchedule`). Rows ``R``:
    ``schedule.rows``. Keys are ``LN_s`` of the key sums times ``tau_state [H]`` (None: 1), values the
    readout values; counts the tokens per row."""
    n_chunks = -(-kbar.shape[2] // schedule.chunk_size)
    rows = schedule.rows(n_chunks)
    wk, wv = _weighted(kbar, v, gate, founder)
    (sk, sv), counts = segment_snapshot_sums((wk, wv), routes, schedule.chunk_size, n_chunks, rows,
                                             lag=schedule.n_bswa_chunks)
    rho = _founder_radius(v, routes, founder, rows)[:, :, None, :rows] if use_vlens else None  # [B, H, 1, R]
    keys, values = readout_rows(sk, sv, counts, rho, v.dtype, ln_weight, ln_bias, ln_eps, tau_state)
    return Snapshots(keys, values, counts, schedule.live(n_chunks, kbar.device))


def build_kvm_versioned(kbar: Tensor, v: Tensor, gate: Tensor, routes: Tensor, founder: Tensor, plan: VersionPlan, *,
                        ln_weight: Tensor, ln_bias: Tensor, ln_eps: float = 1e-5,
                        tau_state: Tensor | None = None, use_vlens: bool = True) -> Versioned:
    """The versioned layout (docs/design.md §5, ``plan.lag = Nb``) of the same states: the same gated
    sums and per-row readout as :func:`build_kvm_snapshots`; a version row has its slot's founder radius."""
    rows = plan.rows
    vs = versioned_sums(list(_weighted(kbar, v, gate, founder)), routes, plan)
    (sk, sv), counts = vs.rows, vs.counts
    row_rho = None
    if use_vlens:
        rho = _founder_radius(v, routes, founder, rows)  # [B, H, rows + 1], spare last
        row_rho = rho.gather(2, vs.slot)  # each row's slot's (a version row of no slot: the spare's)
    keys, values = readout_rows(sk, sv, counts, row_rho, v.dtype, ln_weight, ln_bias, ln_eps, tau_state)
    return Versioned(keys, values, counts, vs.born, vs.dies, plan)
