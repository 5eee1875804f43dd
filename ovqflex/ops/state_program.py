"""``build_state_program``: the attention program of a stateful method (docs/design.md §3, §5).

Every stateful op (OVQ, KVM, VQ) ends the same way once its routes are known: the kv rows
are ``[state rows ; token rows]``, and the state is laid out in one of two ways with the same
outputs and gradients — a per-chunk snapshot bank (:class:`~masks.regions.StateBank`) or the
versioned layout (:mod:`recurrences.versioned`, :mod:`masks.versioned`) — or is absent when no
chunk reads a state. This module owns that fork; a method supplies

- its token region (``window``: ``OwnChunk``, ``BlockWindow``) and the queries and keys the
  program reads (temperatures already folded in: KVM's ``tau_state`` into its state keys' readout,
  :func:`recurrences.kvm.state.state_keys`);
- ``sizes`` (rows each chunk reads: ints, or an int tensor), ``rows`` and ``lag`` (its schedule);
- two builders of the same state after its per-row readout: ``snapshots() -> Snapshots`` and
  ``versioned(plan) -> Versioned`` (segment sums, :mod:`recurrences.segments`, and
  ``versioned_sums``);
- the score pieces on state rows: ``count_bias`` (``log(count)``) and ``bias_shift`` (a per-head
  term subtracted from that bias).
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor

from masks.blocks import list_width
from masks.program import AttentionProgram, build_program, program_geometry
from masks.regions import Region, StateBank
from masks.versioned import versioned_regions
from recurrences.compiling import is_symbolic, size_max
from recurrences.precision import work_dtype
from recurrences.segments import Snapshots
from recurrences.versioned import (CHECKPOINT_ROWS_PER_TOKEN, Versioned, VersionPlan, choose_state_layout,
                                   memory_decides, plan_versioned)

from ..attention import auto_backend
from ..profiling import stage


class StateLayoutOptions(Protocol):
    """The options every stateful op has (``OVQOptions``, ``KVMOptions``, ``VQOptions``)."""

    chunk_size: int
    state_layout: str
    checkpoint_every: int | None
    block_size: int


def _per_head(x: Tensor, like: Tensor) -> Tensor:
    """``x [H]`` viewed to broadcast over ``like [B, H, ...]``."""
    return x.view(1, -1, *(1,) * (like.dim() - 2))


def _checkpoint_rows_per_token(backend: str, n_chunks: int, rows: int, grad: bool, row_bytes: int) -> int:
    """The default checkpoint spacing's rows per token (:data:`~recurrences.versioned.CHECKPOINT_ROWS_PER_TOKEN`):
    ``memory`` where memory decides and ``backend`` (what ``backend="auto"`` runs the program on) is flex, which
    keeps its kv rows, else ``speed``."""
    memory = memory_decides(n_chunks, rows, grad=grad, row_bytes=row_bytes)
    return CHECKPOINT_ROWS_PER_TOKEN["memory" if memory and backend == "flex" else "speed"]


def _list_widths(T: int, window: Region, rows: int, plan: VersionPlan, block_size: int,
                 max_live: int | None) -> tuple[int, int]:
    """The width of the block lists of the snapshot and of the versioned program (:func:`masks.blocks.list_width`),
    before either state is built: the state regions get stand-ins for their tensors, which no width reads."""
    stand_in = torch.zeros(1, dtype=torch.int32)
    snapshot = (StateBank(rows, plan.chunk_size, stand_in), window)
    versioned = versioned_regions(plan, [0], stand_in, stand_in, max_live) + (window,)
    return (list_width(snapshot, program_geometry(T, plan.n_chunks * rows, block_size)),
            list_width(versioned, program_geometry(T, plan.state_rows, block_size)))


def _state_bias(state: Snapshots | Versioned, count_bias: bool, bias_shift: Tensor | None) -> Tensor | None:
    """The state rows' bias (fp32, fp64 for fp64 keys, or None), in the state's own shape."""
    if not count_bias:
        return None
    bias = state.bias(work_dtype(state.keys))
    return bias if bias_shift is None else bias - _per_head(bias_shift.to(bias.dtype), bias)


def build_state_program(q: Tensor, k: Tensor, v: Tensor, window: Region, *, scale: float,
                        sizes: Tensor | Sequence[int], rows: int, lag: int, options: StateLayoutOptions,
                        snapshots: Callable[[], Snapshots], versioned: Callable[[VersionPlan], Versioned],
                        count_bias: bool = False, bias_shift: Tensor | None = None,
                        rows_at: Callable[[int], int] | None = None) -> AttentionProgram:
    """The program ``[state rows ; tokens]`` of a stateful method, in the layout ``options.state_layout``.

    q, k ``[B, H, T, D]``, v ``[B, H, T, Dv]``: the queries and token keys/values the program reads;
    ``window``: the token region; ``scale``: the softmax scale. ``sizes [>= n_chunks]`` (ints or an int tensor):
    state rows chunk ``c`` reads (non-decreasing); ``rows``: ``R``, the rows of the largest state (0: no state — the
    program is the window alone); ``lag``: a token of chunk ``ct`` enters the state of chunk
    ``ct + lag``. ``options``: ``chunk_size``, ``state_layout`` (``"snapshot"``, ``"versioned"``,
    ``"auto"``: :func:`~recurrences.versioned.choose_state_layout`: when gradients are recorded or the snapshot
    state would be large, the one whose backward keeps less on the backend ``auto`` runs it on (fewer rows;
    with gradients on ``blocked``, the narrower block lists), else the cheaper one on q's device),
    ``checkpoint_every`` and ``block_size``.

    ``snapshots()`` (keys ``[B, H, n_chunks, R, D]``) and ``versioned(plan)`` (keys ``[B, H, S, D]``)
    build the same state after the method's per-row readout; only the chosen one runs. With
    ``count_bias`` state rows get the bias ``log(count)`` (``-inf`` on empty or dead rows) minus
    ``bias_shift [H]`` (if given); without it, no bias.
    ``rows_at(n)`` (optional; a growing state's schedule): the rows of a state holding the states of chunks
    ``0..n-1`` (``rows = rows_at(n_chunks)``); with a plain length it bounds the versioned checkpoints' rows by
    the last checkpoint's, narrowing their block lists.
    """
    if bias_shift is not None and not count_bias:
        raise ValueError("bias_shift shifts the log-count bias: it needs count_bias=True")
    C, block_size = options.chunk_size, options.block_size
    if rows == 0:
        with stage("block_mask"):
            return build_program(q, k, v, (window,), scale=scale, block_size=block_size)
    n_chunks = size_max(1, -(-q.shape[2] // C))
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    row_bytes = q.shape[0] * q.shape[1] * (k.shape[-1] + v.shape[-1]) * k.element_size()  # a state row, all b, h
    backend = auto_backend(q.device, q.dtype, grad)
    plan = plan_versioned(n_chunks, C, rows, lag, options.checkpoint_every, align=block_size,
                          per_token=_checkpoint_rows_per_token(backend, n_chunks, rows, grad, row_bytes))
    max_live = None  # the last checkpoint's rows, where a plain length makes it a plain int
    if rows_at is not None and not is_symbolic(n_chunks):
        max_live = rows_at(plan.every * (plan.n_ckpt - 1) + 1)
    widths = None
    if options.state_layout == "auto" and grad and backend == "blocked":
        widths = _list_widths(q.shape[2], window, rows, plan, block_size, max_live)
    layout = choose_state_layout(options.state_layout, n_chunks=n_chunks, rows=rows, plan=plan,
                                 device_type=q.device.type, grad=grad, row_bytes=row_bytes, widths=widths)
    if layout == "versioned":
        with stage("state_build"):
            ver = versioned(plan)
            bias = _state_bias(ver, count_bias, bias_shift)
        with stage("block_mask"):
            regions = versioned_regions(plan, sizes, ver.born, ver.dies, max_live) + (window,)
            return build_program(q, k, v, regions, scale=scale, state_k=ver.keys, state_v=ver.values, state_bias=bias,
                                 block_size=block_size)
    with stage("state_build"):
        snap = snapshots()
        bias = _state_bias(snap, count_bias, bias_shift)
    with stage("block_mask"):
        return build_program(q, k, v, (StateBank(rows, C, snap.live), window), scale=scale,
                             state_k=snap.keys.flatten(2, 3), state_v=snap.values.flatten(2, 3),
                             state_bias=None if bias is None else bias.flatten(2, 3), block_size=block_size)
