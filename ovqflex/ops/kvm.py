"""``kvm_attention``: Key-Value Means as one attention program (docs/design.md §4.3).

k ─LN_s(rope dims zeroed)─▶ memory keys ─routes (no grad)─▶ snapshots (differentiable
gated segment sums, LN_s / radius readout) ─▶ program [per-chunk state bank x tau_state ;
block sliding window of Nb chunks x tau_bswa, causal] ─▶ backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from masks.program import DEFAULT_BLOCK, AttentionProgram
from masks.regions import BlockWindow
from recurrences.checks import (check_choice, check_chunk, check_companion, check_finite_args, check_int, check_number,
                                check_qkv, check_tensor, options_of)
from recurrences.kvm import (ROUTING_IMPLS, KVMBudget, KVMSchedule, build_kvm_snapshots, build_kvm_versioned,
                             check_sink_len, kvm_state_sizes, memory_keys, route_kvm, routing_memory_keys)
from recurrences.precision import to_compute_dtype
from recurrences.versioned import check_state_layout

from ..attention import attend
from ..profiling import stage
from .state_program import build_state_program


@dataclass
class KVMState:
    """What ``return_state=True`` adds: routes ``[B, H, T]`` (state row of each absorbed
    token, -1 otherwise), founder ``[B, H, T]`` bool (the token created its row) and
    ``live [n_chunks]`` int64 (state rows query chunk ``c`` reads; :attr:`sizes` as a list)."""

    routes: Tensor
    founder: Tensor
    live: Tensor

    @property
    def sizes(self) -> list[int]:
        """``sizes[c]``: state rows query chunk ``c`` reads (read from :attr:`live`, a host sync)."""
        return self.live.tolist()


def _check_vector(name: str, x, n: int, like: Tensor) -> None:
    check_tensor(name, x, 1)
    if x.shape[0] != n:
        raise ValueError(f"{name} must have shape [{n}], got {tuple(x.shape)}")
    if x.device != like.device:
        raise ValueError(f"{name} must be on {like.device}, got {x.device}")


@dataclass(frozen=True)
class KVMOptions(KVMBudget):
    """Key-Value Means' options, validated once; shared by :func:`kvm_program`, :func:`kvm_attention`,
    :class:`~ovqflex.KVMAttention` and its decode cache.

    The state budget (the fields of :class:`~recurrences.kvm.KVMBudget`:
    ``budget="fixed"|"power_law"|"saturation"``, ``state_min_len``, ``growth_factor``,
    ``growth_exponent``, ``round_down``, ``saturation_n``, ``max_state_chunks``: the rows cap in
    chunks, None: uncapped; :mod:`recurrences.kvm.budget`); ``chunk_size`` ``C`` (a multiple of 16);
    ``n_bswa_chunks`` ``Nb``, the block window; ``sink_len`` protected sink rows (< ``C``);
    ``rope_dims`` (None: ``D // 2``), the leading channels zeroed in memory keys; ``use_vlens``
    (False: state values ``s_v / count`` instead of the founder's radius); ``ln_eps`` of ``LN_s``; ``state_layout``
    (``"snapshot"``: one state per query chunk; ``"versioned"``: checkpoints every
    ``checkpoint_every`` chunks plus one version row per token, memory-linear; ``"auto"``: the one
    whose backward keeps less, or without gradients the faster forward, ``recurrences.versioned.
    choose_state_layout``; docs/design.md §5); ``block_size``, the attention block (a power of two >= 16); ``routing``:
    ``"auto"`` (``"static"`` on CUDA, ``"loop"`` elsewhere), ``"loop"`` or ``"static"`` (the same routes
    from a compiled static-shape chunk step, on CUDA the whole run replayed from one CUDA graph;
    docs/design.md §4.3).
    """

    chunk_size: int = 128
    n_bswa_chunks: int = 2
    sink_len: int = 1
    rope_dims: int | None = None
    use_vlens: bool = True
    ln_eps: float = 1e-5
    state_layout: str = "auto"
    checkpoint_every: int | None = None
    block_size: int = DEFAULT_BLOCK
    routing: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        check_choice("routing", self.routing, ROUTING_IMPLS)
        check_state_layout(self.state_layout, self.checkpoint_every, self.block_size)
        check_chunk("chunk_size", self.chunk_size)
        check_int("n_bswa_chunks", self.n_bswa_chunks)
        check_sink_len(self.sink_len, self.chunk_size)
        check_number("ln_eps", self.ln_eps)
        r = self.rope_dims
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r % 2 or r < 0):
            raise ValueError(f"rope_dims must be None (head_dim // 2) or an even int >= 0, got {r!r}")

    def head_rope_dims(self, head_dim: int) -> int:
        """``rope_dims`` for heads of ``head_dim`` channels (None: ``head_dim // 2``), checked."""
        rope_dims = head_dim // 2 if self.rope_dims is None else self.rope_dims
        if rope_dims % 2 or rope_dims > head_dim:
            raise ValueError(f"rope_dims must be an even int in [0, head_dim={head_dim}], got {rope_dims!r}")
        return rope_dims

    @property
    def schedule(self) -> KVMSchedule:
        """The state rows each query chunk reads: chunk size, block window and budget."""
        return KVMSchedule(self.chunk_size, self.n_bswa_chunks, self)  # (options are a budget, and more)

    def state_sizes(self, seq_len: int) -> list[int]:
        """``sizes[c]``: state rows query chunk ``c`` reads, for the chunks of ``seq_len`` tokens."""
        return kvm_state_sizes(seq_len, self.chunk_size, self.n_bswa_chunks, self)


def _check_kvm_args(q, k, v, gate, ln_s_weight, ln_s_bias, tau_state, tau_bswa, check_finite) -> None:
    check_qkv(q, k, v)
    B, H, T, D = q.shape
    if gate is not None:
        check_companion("gate", gate, (B, H, T), q)
    _check_vector("ln_s_weight", ln_s_weight, D, q)
    _check_vector("ln_s_bias", ln_s_bias, D, q)
    for name, tau in (("tau_state", tau_state), ("tau_bswa", tau_bswa)):
        if tau is not None:
            _check_vector(name, tau, H, q)
    check_finite_args(check_finite, q=q, k=k, v=v, gate=gate, ln_s_weight=ln_s_weight, ln_s_bias=ln_s_bias,
                      tau_state=tau_state, tau_bswa=tau_bswa)


def kvm_program(q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None = None, *, ln_s_weight: Tensor,
                ln_s_bias: Tensor, tau_state: Tensor | None = None, tau_bswa: Tensor | None = None,
                options: KVMOptions | None = None, check_finite: bool | None = None,
                **option_kwargs) -> tuple[AttentionProgram, KVMState]:
    """The KVM attention program, without running it (what the visualizer draws), and its
    :class:`KVMState`. Arguments as :func:`kvm_attention`. Stages are labelled
    ``ovqflex.routing``, ``ovqflex.state_build`` and ``ovqflex.block_mask`` for ``torch.profiler``.
    """
    o = options_of(KVMOptions, options, option_kwargs, "KVM options")
    _check_kvm_args(q, k, v, gate, ln_s_weight, ln_s_bias, tau_state, tau_bswa, check_finite)
    rope_dims = o.head_rope_dims(q.shape[-1])
    chunk_size, n_bswa_chunks, ln_eps = o.chunk_size, o.n_bswa_chunks, o.ln_eps
    q, k, v, gate = to_compute_dtype(q, k, v, gate)
    B, H, T, D = q.shape
    schedule = o.schedule
    n_chunks = -(-T // chunk_size)
    live = schedule.live(n_chunks, q.device)
    gate = torch.ones(B, H, T, dtype=q.dtype, device=q.device) if gate is None else gate
    with stage("routing"):
        kbar = memory_keys(k, rope_dims, ln_s_weight, ln_s_bias, ln_eps)
        kbar32 = routing_memory_keys(k, rope_dims, ln_s_weight, ln_s_bias, ln_eps)  # fp32, whatever the dtype
        routes, founder = route_kvm(kbar32, gate, ln_s_weight, ln_s_bias, schedule=schedule, sink_len=o.sink_len,
                                    ln_eps=ln_eps, impl=o.routing)
    k_win = k if tau_bswa is None else k * tau_bswa.to(k.dtype).view(1, H, 1, 1)
    readout = dict(ln_weight=ln_s_weight, ln_bias=ln_s_bias, ln_eps=ln_eps, tau_state=tau_state, use_vlens=o.use_vlens)
    program = build_state_program(
        q, k_win, v, BlockWindow(n_bswa_chunks, chunk_size), scale=D ** -0.5, sizes=live, rows=schedule.rows(n_chunks),
        lag=n_bswa_chunks, options=o,
        snapshots=lambda: build_kvm_snapshots(kbar, v, gate, routes, founder, schedule=schedule, **readout),
        versioned=lambda plan: build_kvm_versioned(kbar, v, gate, routes, founder, plan, **readout),
        rows_at=schedule.rows)
    return program, KVMState(routes, founder, live)


def kvm_attention(q: Tensor, k: Tensor, v: Tensor, gate: Tensor | None = None, *, backend: str = "auto",
                  return_state: bool = False, **options):
    """KVM attention. q, k ``[B, H, T, D]`` already normalized and rotated, v ``[B, H, T, Dv]``,
    gate ``[B, H, T]`` merge gates ``1 + elu(x W_g)`` (None: no gate, all 1) -> ``[B, H, T, Dv]``
    (and a :class:`KVMState` with ``return_state=True``). q, k, v and gate are cast to one
    compute dtype; routing reads fp32 memory keys (:mod:`recurrences.precision`).

    Keyword arguments (:func:`kvm_program`): ``ln_s_weight``, ``ln_s_bias`` ``[D]`` (the state
    LayerNorm, required), ``tau_state``, ``tau_bswa`` ``[H]`` (None: 1), and the options: a
    :class:`KVMOptions` (``options=``) or its fields as keywords (chunk, window, sinks, ``rope_dims``,
    the state budget, ``use_vlens``, ``ln_eps``, the state layout, ``block_size``), and ``check_finite``:
    True refuses nan/inf in every tensor argument (None: :func:`ovqflex.finite_checks`; eager only).

    The first ``Nb * C`` tokens attend causally; query chunk ``c`` after that sees the state
    built from tokens ``[0, (c - Nb + 1) C)`` and its ``Nb``-chunk block window.
    """
    program, state = kvm_program(q, k, v, gate, **options)
    with stage("attention"):
        out = attend(program, backend)
    return (out, state) if return_state else out


def kvm_flops(T: int, H: int, D: int, options: KVMOptions, B: int = 1) -> float:
    """Model FLOPs of KVM attention: the causal front, then per query chunk its state rows, the
    ``Nb - 1`` whole window chunks before it and the causal half of its own chunk."""
    C, Nb, sizes = options.chunk_size, options.n_bswa_chunks, options.state_sizes(T)
    front = min(T, Nb * C)
    total = front * (front + 1) / 2
    for c in range(Nb, -(-T // C)):
        lq = min(C, T - c * C)
        total += lq * (sizes[c] + (Nb - 1) * C) + lq * (lq + 1) / 2
    return 4.0 * B * H * D * total
