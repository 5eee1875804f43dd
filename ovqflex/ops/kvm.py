"""``kvm_attention``: Key-Value Means as one attention program (docs/design.md §4.3).

k ─LN_s(rope dims zeroed)─▶ memory keys ─routes (no grad)─▶ snapshots (differentiable
gated segment sums, LN_s / radius readout) ─▶ program [per-chunk state bank x tau_state ;
block sliding window of Nb chunks x tau_bswa, causal] ─▶ backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from masks.program import DEFAULT_BLOCK, AttentionProgram, build_program
from masks.regions import BlockWindow, StateBank
from masks.versioned import versioned_regions
from recurrences.checks import check_chunk, check_companion, check_int, check_qkv, check_tensor
from recurrences.kvm import (KVMBudget, build_kvm_snapshots, build_kvm_versioned, kvm_state_sizes, memory_keys,
                             route_kvm, routing_memory_keys)
from recurrences.precision import to_compute_dtype
from recurrences.versioned import check_state_layout, choose_state_layout, plan_versioned

from ..attention import attend
from ..profiling import stage


@dataclass
class KVMState:
    """What ``return_state=True`` adds: routes ``[B, H, T]`` (state row of each absorbed
    token, -1 otherwise), founder ``[B, H, T]`` bool (the token created its row) and
    ``sizes`` (``sizes[c]``: state rows query chunk ``c`` reads)."""

    routes: Tensor
    founder: Tensor
    sizes: list[int]


def _check_vector(name: str, x, n: int, like: Tensor) -> None:
    check_tensor(name, x, 1)
    if x.shape[0] != n:
        raise ValueError(f"{name} must have shape [{n}], got {tuple(x.shape)}")
    if x.device != like.device:
        raise ValueError(f"{name} must be on {like.device}, got {x.device}")


def check_kvm_options(head_dim: int, chunk_size, n_bswa_chunks, sink_len, rope_dims, state_layout, checkpoint_every,
                      block_size) -> int:
    """Validate the shape options shared by :func:`kvm_program` and ``KVMAttention``;
    returns ``rope_dims`` resolved (None: ``head_dim // 2``)."""
    check_state_layout(state_layout, checkpoint_every, block_size)
    check_chunk("chunk_size", chunk_size)
    check_int("n_bswa_chunks", n_bswa_chunks)
    check_int("sink_len", sink_len, minimum=0)
    if sink_len >= chunk_size:
        raise ValueError(f"sink_len must be < chunk_size={chunk_size} (the initial state), got {sink_len}")
    rope_dims = head_dim // 2 if rope_dims is None else rope_dims
    if (isinstance(rope_dims, bool) or not isinstance(rope_dims, int) or rope_dims % 2
            or not 0 <= rope_dims <= head_dim):
        raise ValueError(f"rope_dims must be an even int in [0, head_dim={head_dim}], got {rope_dims!r}")
    return rope_dims


def _check_kvm_args(q, k, v, gate, ln_s_weight, ln_s_bias, tau_state, tau_bswa, chunk_size, n_bswa_chunks,
                    sink_len, rope_dims, state_layout, checkpoint_every, block_size) -> int:
    """Validate the op's inputs; returns the resolved ``rope_dims``."""
    check_qkv(q, k, v)
    B, H, T, D = q.shape
    if gate is not None:
        check_companion("gate", gate, (B, H, T), q)
    _check_vector("ln_s_weight", ln_s_weight, D, q)
    _check_vector("ln_s_bias", ln_s_bias, D, q)
    for name, tau in (("tau_state", tau_state), ("tau_bswa", tau_bswa)):
        if tau is not None:
            _check_vector(name, tau, H, q)
    return check_kvm_options(D, chunk_size, n_bswa_chunks, sink_len, rope_dims, state_layout, checkpoint_every,
                             block_size)


def kvm_program(q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None = None, *, ln_s_weight: Tensor,
                ln_s_bias: Tensor, tau_state: Tensor | None = None, tau_bswa: Tensor | None = None,
                chunk_size: int = 128, n_bswa_chunks: int = 2, sink_len: int = 1, rope_dims: int | None = None,
                budget: str = "fixed", state_min_len: int | None = None, growth_factor: float = 16.0,
                growth_exponent: float = 0.5, round_down: int = 1, saturation_n: int = 1024,
                max_state_chunks: int | None = 1, use_vlens: bool = True, ln_eps: float = 1e-5,
                state_layout: str = "auto", checkpoint_every: int | None = None,
                block_size: int = DEFAULT_BLOCK) -> tuple[AttentionProgram, KVMState]:
    """The KVM attention program, without running it (what the visualizer draws), and its
    :class:`KVMState`. Arguments as :func:`kvm_attention`. Stages are labelled
    ``ovqflex.routing``, ``ovqflex.state_build`` and ``ovqflex.block_mask`` for ``torch.profiler``.
    """
    rope_dims = _check_kvm_args(q, k, v, gate, ln_s_weight, ln_s_bias, tau_state, tau_bswa, chunk_size,
                                n_bswa_chunks, sink_len, rope_dims, state_layout, checkpoint_every, block_size)
    q, k, v, gate = to_compute_dtype(q, k, v, gate)
    B, H, T, D = q.shape
    spec = KVMBudget(budget, state_min_len, growth_factor, growth_exponent, round_down, saturation_n,
                     max_state_chunks)
    sizes = kvm_state_sizes(T, chunk_size, n_bswa_chunks, spec)
    gate = torch.ones(B, H, T, dtype=q.dtype, device=q.device) if gate is None else gate
    window = BlockWindow(n_bswa_chunks, chunk_size)
    rows = max(sizes, default=0)
    with stage("routing"):
        kbar = memory_keys(k, rope_dims, ln_s_weight, ln_s_bias, ln_eps)
        kbar32 = routing_memory_keys(k, rope_dims, ln_s_weight, ln_s_bias, ln_eps)  # fp32, whatever the dtype
        routes, founder = route_kvm(kbar32, gate, ln_s_weight, ln_s_bias, chunk=chunk_size,
                                    n_bswa_chunks=n_bswa_chunks, sizes=sizes, sink_len=sink_len, ln_eps=ln_eps)
    state = KVMState(routes, founder, sizes)
    k_win = k if tau_bswa is None else k * tau_bswa.to(k.dtype).view(1, H, 1, 1)
    if rows == 0:  # T <= Nb*C: the front only, plain causal attention
        with stage("block_mask"):
            return build_program(q, k_win, v, (window,), scale=D ** -0.5, block_size=block_size), state
    plan = plan_versioned(len(sizes), chunk_size, rows, n_bswa_chunks, checkpoint_every, align=block_size)
    if choose_state_layout(state_layout, n_chunks=len(sizes), rows=rows, plan=plan) == "versioned":
        with stage("state_build"):
            ver = build_kvm_versioned(kbar, v, gate, routes, founder, plan, ln_weight=ln_s_weight, ln_bias=ln_s_bias,
                                      ln_eps=ln_eps, use_vlens=use_vlens)
            keys = ver.keys if tau_state is None else ver.keys * tau_state.to(ver.keys.dtype).view(1, H, 1, 1)
        with stage("block_mask"):
            regions = versioned_regions(plan, sizes, ver.born, ver.dies) + (window,)
            program = build_program(q, k_win, v, regions, scale=D ** -0.5, state_k=keys, state_v=ver.values,
                                    block_size=block_size)
        return program, state
    with stage("state_build"):
        snap = build_kvm_snapshots(kbar, v, gate, routes, founder, chunk=chunk_size, n_bswa_chunks=n_bswa_chunks,
                                   sizes=sizes, ln_weight=ln_s_weight, ln_bias=ln_s_bias, ln_eps=ln_eps,
                                   use_vlens=use_vlens)
        keys = snap.keys if tau_state is None else snap.keys * tau_state.to(snap.keys.dtype).view(1, H, 1, 1, 1)
    with stage("block_mask"):
        program = build_program(q, k_win, v, (StateBank(rows, chunk_size, snap.live), window), scale=D ** -0.5,
                                state_k=keys.flatten(2, 3), state_v=snap.values.flatten(2, 3), block_size=block_size)
    return program, state


def kvm_attention(q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None = None, *, backend: str = "auto",
                  return_state: bool = False, **options):
    """KVM attention. q, k ``[B, H, T, D]`` already normalized and rotated, v ``[B, H, T, Dv]``,
    gate ``[B, H, T]`` merge gates ``1 + elu(x W_g)`` (None: no gate, all 1) -> ``[B, H, T, Dv]``
    (and a :class:`KVMState` with ``return_state=True``). q, k, v and gate are cast to one
    compute dtype; routing reads fp32 memory keys (:mod:`recurrences.precision`).

    Keyword options (:func:`kvm_program`): ``ln_s_weight``, ``ln_s_bias`` ``[D]`` (the state
    LayerNorm, required), ``tau_state``, ``tau_bswa`` ``[H]`` (None: 1), ``chunk_size=128``,
    ``n_bswa_chunks=2``, ``sink_len=1``, ``rope_dims=D//2`` (leading channels zeroed in memory
    keys), the budget (``budget="fixed"|"power_law"|"saturation"``, ``state_min_len``,
    ``growth_factor=16``, ``growth_exponent=0.5``, ``round_down=1``, ``saturation_n=1024``,
    ``max_state_chunks=1`` rows cap in chunks, None: uncapped; see :mod:`recurrences.kvm.budget`),
    ``use_vlens=True`` (False: state values ``s_v / count`` instead of the founder's radius),
    ``ln_eps``, ``state_layout="auto"`` (``"snapshot"``: one state per query chunk;
    ``"versioned"``: checkpoints every ``checkpoint_every`` chunks plus one version row per token,
    memory-linear; ``"auto"``: fewer rows; docs/design.md §5), ``checkpoint_every``, ``block_size``.

    The first ``Nb * C`` tokens attend causally; query chunk ``c`` after that sees the state
    built from tokens ``[0, (c - Nb + 1) C)`` and its ``Nb``-chunk block window.
    """
    program, state = kvm_program(q, k, v, gate, **options)
    with stage("attention"):
        out = attend(program, backend)
    return (out, state) if return_state else out


def kvm_flops(T: int, H: int, D: int, chunk_size: int, n_bswa_chunks: int, sizes: list[int], B: int = 1) -> float:
    """Model FLOPs of KVM attention: the causal front, then per query chunk its ``sizes[c]`` state
    rows, the ``Nb - 1`` whole window chunks before it and the causal half of its own chunk."""
    C, Nb = chunk_size, n_bswa_chunks
    front = min(T, Nb * C)
    total = front * (front + 1) / 2
    for c in range(Nb, -(-T // C)):
        lq = min(C, T - c * C)
        total += lq * (sizes[c] + (Nb - 1) * C) + lq * (lq + 1) / 2
    return 4.0 * B * H * D * total
