"""The shared differentiable state build: per-chunk snapshot sums by slot (docs/design.md §1, §5).

Every stateful method (OVQ, KVM, VQ) reduces to the same step once its routes are
known: the state a query chunk reads is a sum, over the tokens routed before it,
of (weighted) token vectors, grouped by slot. One ``index_add`` of the tokens into
``[chunk, slot]`` cells and one cumulative sum over chunks build every snapshot;
no Python loop on the gradient path. :class:`Snapshots` is what every method's snapshot build
returns (the versioned layout's counterpart is :class:`recurrences.versioned.Versioned`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .compiling import pad_to
from .scan import cumsum


def segment_snapshot_sums(xs: Sequence[Tensor], routes: Tensor, chunk_size: int, n_chunks: int, rows: int,
                          lag: int = 1, every: int = 1) -> tuple[list[Tensor], Tensor]:
    """Per-chunk prefix sums by slot of each ``x`` in ``xs``, grouped by the same routes.

    xs: ``[B, H, T, D_i]`` each (e.g. keys and values), routes ``[B, H, T]`` (-1 or >= rows:
    ignored). A token of chunk ``ct`` is in the snapshot of every chunk ``c >= ct + lag`` (OVQ:
    ``lag=1``, the chunk after it; KVM: ``lag = n_bswa_chunks``, once it has left the window); tokens
    that would enter at ``ct + lag >= n_chunks`` are in no snapshot.
    Returns the sums ``[B, H, n_out, rows, D_i]`` of each x (in :func:`sum_dtype`: x's, fp32 for fp16) and the
    token counts ``[B, H, n_out, rows]`` fp32 of the snapshots of chunks ``0, every, 2 every, ...`` (``n_out =
    ceil(n_chunks / every)``; ``every > 1``: the checkpoints of the versioned layout, :mod:`recurrences.versioned`).
    The cells and counts are computed once for all ``xs``; each x is added into a zeroed buffer in place,
    every cell rounded once to x's dtype (:data:`NARROW_ADDS`), then summed over chunks by
    :func:`~recurrences.scan.cumsum`, which accumulates in fp32 and rounds each snapshot once.
    """
    T = routes.shape[2]
    pad = -T % chunk_size  # whole chunks only: inductor's CPU codegen mis-tiles `arange(T) // chunk` otherwise
    xs, routes = [pad_to(x.to(sum_dtype(x.dtype)), 2, T + pad) for x in xs], pad_to(routes, 2, T + pad, value=-1)
    B, H, T = routes.shape
    dev = routes.device
    slot = torch.where((routes >= 0) & (routes < rows), routes, rows)  # spare slot `rows` drops a token
    # token of chunk ct enters at chunk e = ct + lag, i.e. output ceil(e / every) onwards (clamped into a
    # spare output n_out; e >= n_chunks lands there too), then cumsum over outputs
    n_out = -(-n_chunks // every)
    entry = torch.arange(T, device=dev) // chunk_size + lag
    tok_chunk = torch.clamp((entry + every - 1) // every, max=n_out)
    n_cells = (n_out + 1) * (rows + 1)
    bh = torch.arange(B * H, device=dev).view(B, H, 1) * n_cells
    cell = (bh + tok_chunk.view(1, 1, T) * (rows + 1) + slot).reshape(-1)  # [B*H*T] global cell

    def by_chunk(cells: Tensor) -> Tensor:  # [B*H*n_cells, *] -> the snapshots' [B, H, n_out, rows, *] prefix sums
        cells = cells.view(B, H, n_out + 1, rows + 1, *cells.shape[1:])[:, :, :n_out, :rows]
        return cumsum(cells, 2)

    counts = torch.zeros(B * H * n_cells, device=dev).index_add_(0, cell, torch.ones(B * H * T, device=dev))
    once = [x.dtype == torch.bfloat16 and NARROW_ADDS.get(dev.type, False) for x in xs]  # (fp16: summed in fp32)
    group = _cell_leaders(cell, B * H * n_cells) if any(once) else None
    sums = [by_chunk(_cell_sums(x.reshape(B * H * T, x.shape[-1]), cell, B * H * n_cells, group if o else None))
            for x, o in zip(xs, once)]
    return sums, by_chunk(counts)


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a state's sums of ``dtype`` tokens are kept in: their own, but fp32 for fp16, whose largest value
    (65,504) a row's sum outgrows long before its mean does (an fp16 OVQ op whose one busy row summed 2,048 values
    near 60 had made its state, and every output, NaN). The readouts divide in it and round the rows they give
    the attention to the tokens' dtype once."""
    return torch.float32 if dtype == torch.float16 else dtype


#: whether a device's ``index_add_`` adds bf16 in its own dtype, rounding every add into its cell
#: (CUDA's atomics; the CPU's scatter accumulates in fp32 and rounds each cell once): there a cell's
#: bf16 tokens are summed in fp32 first (:func:`_cell_sums`), so a cell of ``n`` tokens is rounded once, not
#: ``n`` times (fp16 tokens are summed in fp32 throughout, :func:`sum_dtype`)
NARROW_ADDS = {"cpu": False, "cuda": True}


def _cell_leaders(cell: Tensor, n_cells: int) -> Tensor:
    """``[N]`` int64: for each of the ``N`` tokens, the first token of its ``cell`` (``[N]``, values
    ``< n_cells``), the row its cell's fp32 sum is kept in."""
    with torch.no_grad():
        token = torch.arange(cell.shape[0], device=cell.device)
        first = torch.full((n_cells,), cell.shape[0], device=cell.device, dtype=torch.long)
        return first.scatter_reduce_(0, cell, token, reduce="amin")[cell]


def _cell_sums(x: Tensor, cell: Tensor, n_cells: int, group: Tensor | None) -> Tensor:
    """``[n_cells, D]`` sums, in x's dtype, of the tokens ``x [N, D]`` by ``cell [N]``, added in place into
    a zeroed buffer. ``group`` (:func:`_cell_leaders`): a cell's tokens are first summed in fp32 into the
    row of its first token, and only that row's sum, rounded once, is added to the cell (the other rows
    are zeros, which add exactly): one rounding per cell whatever the order of the adds.

    Eager, differentiable in x through :class:`_CellSums`, whose backward keeps only ``cell``: autograd's
    ``index_add`` keeps its source whole, here the tokens (and with ``group`` their fp32 copy and its
    grouped sums), ``[N, D]`` copies alive until the backward for a gradient that needs none of them.
    Compiled, autograd's own ``index_add``: AOTAutograd's partitioner keeps only what the backward graph
    reads (the cells), and torch 2.11 compiles the ``index_add_`` of a fresh buffer inside an
    ``autograd.Function`` to a zero gradient (torch 2.13 does not;
    ``tests/recurrences/test_segments.py`` checks the compiled gradient)."""
    if torch.compiler.is_compiling():
        return _sum_cells(x, cell, n_cells, group)
    return _CellSums.apply(x, cell, n_cells, group)


def _sum_cells(x: Tensor, cell: Tensor, n_cells: int, group: Tensor | None) -> Tensor:
    if group is not None:
        wide = x.float()
        x = torch.zeros_like(wide).index_add_(0, group, wide).to(x.dtype)
    return x.new_zeros(n_cells, x.shape[-1]).index_add_(0, cell, x)


class _CellSums(torch.autograd.Function):
    """:func:`_cell_sums`, eager. The gradient of a token is its cell's, whichever path summed it (a grouped
    token reaches its cell through its leader, in the same cell; the fp32 round trip is the identity for
    the gradient): one ``index_select`` of the cells' gradient, in x's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, cell: Tensor, n_cells: int, group: Tensor | None) -> Tensor:
        ctx.save_for_backward(cell)
        return _sum_cells(x, cell, n_cells, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (cell,) = ctx.saved_tensors
        return grad.index_select(0, cell), None, None, None


@dataclass
class Snapshots:
    """A method's state in the snapshot layout (docs/design.md §5): one state of ``R`` rows per query
    chunk (``R``: the largest state any chunk reads), after the method's per-row readout.

    keys ``[B, H, n_chunks, R, D]``, values ``[B, H, n_chunks, R, Dv]``, counts ``[B, H, n_chunks, R]``
    fp32 (tokens per row, 0 for empty rows), live ``[n_chunks]`` int64 (rows chunk ``c`` reads).
    """

    keys: Tensor
    values: Tensor
    counts: Tensor
    live: Tensor

    def bias(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``log(count)`` of the rows, ``-inf`` for empty rows: ``[B, H, n_chunks, R]`` in ``dtype`` (the
        log taken in it: fp32, or fp64 for an fp64 program)."""
        counts = self.counts.to(dtype)
        return torch.where(counts > 0, counts.log(), float("-inf"))
