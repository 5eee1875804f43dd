"""The versioned (memory-linear) state layout (docs/design.md §5 "Versioned"), generic over methods.

Snapshots hold one ``rows``-row state per query chunk: ``n_chunks * rows`` rows. A slot
only changes in the chunks where tokens enter it, so the versioned layout keeps

- **checkpoints**: the snapshot of chunks ``0, R, 2R, ...`` (``R = every``), ``rows`` rows each;
- **version rows**: one per token position ``t`` (slot ``s = routes[t]``, entry chunk
  ``e = t // chunk_size + lag``): the aggregate of every token of slot ``s`` entering at chunks
  ``<= e``. Only the last token of each (slot, entry chunk) group gives a *live* row; the
  others are superseded inside their own chunk and never visible.

Query chunk ``c`` (checkpoint ``k = c // R``) sees exactly its snapshot through

- checkpoint row ``(k, s)`` iff no token of slot ``s`` enters in chunks ``(R k, c]``;
- version row ``t`` iff ``R k < e <= c`` (the token interval
  ``[(R k - lag + 1) chunk_size, (c - lag + 1) chunk_size)``, a region of :mod:`masks.versioned`) and
  ``e <= c < `` the next entry chunk of slot ``s`` (it is the slot's latest version).

Both conditions are stored per row as ``born[r] <= c < dies[r]`` (int32 ``[B, H, rows]``;
dead rows have ``born = dies = 0``), and that test alone decides: checkpoint ``k``'s rows live
within ``[R k, R (k + 1))``, a version row entering at ``e`` dies at the first checkpoint chunk
``>= e`` (which holds it from then on; one entering at a checkpoint's chunk never lives), so a
live row always lies in the intervals above (the attention mask tests only the liveness). Row
values come from one sort by (slot, position) and a segmented cumulative sum (cumsum minus the
running sum before the slot's segment, in fp64 so long sequences keep fp32 accuracy), all
differentiable; the sort and the liveness are integer bookkeeping without gradient. Every
method's state is such a sum (OVQ means, KVM gated sums, VQ code means with ``lag=2``):
:func:`versioned_sums` takes the method's weighted token vectors, its routes and its lag, and
the method applies its per-row readout (means, ``LN_s``, radius) to checkpoint and version rows
alike.

Each checkpoint's rows, and the version rows of each chunk's tokens, are placed in *liveness order*
(:func:`liveness_order`: by ``dies``, latest first, per batch row and head), so the rows a chunk sees
are a prefix of every such group, and the attention's block lists can take most state blocks as
full and skip blocks of rows already replaced (``masks.versioned.block_liveness``). The rows stay
in their group, so inside the intervals above; :class:`VersionedSums` gives each row's slot.

The layout is chosen and laid out in one place for every method,
``ovqflex.ops.state_program.build_state_program``, in three steps::

    plan = plan_versioned(n_chunks, chunk_size, rows, lag, checkpoint_every, align=block_size,
                          per_token=CHECKPOINT_ROWS_PER_TOKEN["memory" if memory_decides(...) and flex else "speed"])
    if choose_state_layout(state_layout, n_chunks=n_chunks, rows=rows, plan=plan, device_type=q.device.type,
                           grad=grad_recorded, row_bytes=row_bytes) == "versioned":
        ver = versioned(plan)   # the method's: versioned_sums of its weighted tokens + per-row readout
        regions = masks.versioned.versioned_regions(plan, sizes, ver.born, ver.dies) + (window,)

Precondition (true of every routing here): a token entering at chunk ``e`` routes to a slot
``< sizes[e]``, with ``sizes`` non-decreasing — so a row with tokens exists in the dictionary
of every chunk that can see it, and checkpoint ``k`` only needs its first ``sizes[R k]`` rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .checks import check_block_size, check_choice, check_int, host_check_is_free
from .compiling import pad_to
from .scan import cumsum
from .segments import segment_snapshot_sums, sum_dtype

STATE_LAYOUTS = ("snapshot", "versioned", "auto")


@dataclass(frozen=True)
class VersionPlan:
    """Static (Python int) shape of a versioned layout.

    ``rows``: rows per checkpoint (the largest state, rounded up to ``align``); ``every``:
    chunks between checkpoints; ``n_ckpt = ceil(n_chunks / every)``; ``n_versions``: version
    rows, one per (padded) token position ``n_chunks * chunk_size``; ``lag``: a token of chunk
    ``ct`` enters the state of chunk ``ct + lag``.
    """

    n_chunks: int
    chunk_size: int
    rows: int
    every: int
    lag: int

    @property
    def n_ckpt(self) -> int:
        return -(-self.n_chunks // self.every)

    @property
    def n_versions(self) -> int:
        return self.n_chunks * self.chunk_size

    @property
    def state_rows(self) -> int:
        """Total state rows: checkpoints then version rows."""
        return self.n_ckpt * self.rows + self.n_versions


def default_every(rows: int, chunk_size: int, n_chunks: int | None = None, per_token: int = 2) -> int:
    """``R ~ rows / (per_token chunk_size)``: the smallest ``R >= ceil(rows / (per_token chunk_size))`` whose
    ``floor(n_chunks / R)`` whole checkpoint intervals hold at most ``per_token n_chunks chunk_size`` rows, so the
    checkpoints hold at most ``per_token T + rows`` and the whole state about ``(per_token + 1) T + rows``, while a
    query chunk scans at most ``R - 1`` chunks of version rows. ``per_token=2`` (the default) halves the scan
    for the forward's speed; ``per_token=1`` is the spacing ``R ~ rows / chunk_size`` of about ``2T`` state rows,
    for when memory decides (:data:`CHECKPOINT_ROWS_PER_TOKEN`). The last, partial interval is not counted: with
    it the spacing would change with ``n_chunks mod R`` (2,048 rows, 128-token chunks, ``per_token=2``: 11, 8, 9
    for 31, 32, 33 chunks; now 8 for each), and under dynamic shapes every residue would compile a graph of its
    own."""
    check_int("per_token", per_token)
    every = max(1, -(-rows // (per_token * chunk_size)))
    while n_chunks is not None and every < n_chunks and n_chunks // every * rows > per_token * n_chunks * chunk_size:
        every += 1
    return every


def plan_versioned(n_chunks: int, chunk_size: int, rows: int, lag: int, every: int | None = None,
                   align: int = 1, per_token: int = 2) -> VersionPlan:
    """The layout of a state of ``rows`` rows read by ``n_chunks`` chunks (``every=None``:
    :func:`default_every` of the padded rows, at most about ``per_token`` checkpoint rows per token, rounded up to
    a multiple of the chunks in a block when a block of ``align`` rows holds several: every query block then
    reads one checkpoint, and its block lists need no room for two, ``masks.versioned``); checkpoint rows are
    padded to a multiple of ``align`` (the block size)."""
    if every is not None:
        check_int("checkpoint_every", every)
    rows_pad = -(-rows // align) * align
    if every is None:
        every = default_every(rows_pad, chunk_size, n_chunks, per_token)
        if align > chunk_size and align % chunk_size == 0:
            every = -(-every // (align // chunk_size)) * (align // chunk_size)
    return VersionPlan(n_chunks, chunk_size, rows_pad, every, lag)


def check_state_layout(state_layout: str, checkpoint_every: int | None, block_size: int) -> None:
    """The ``state_layout`` / ``checkpoint_every`` / ``block_size`` options of an op or layer
    (ValueError naming them; ``block_size`` aligns the checkpoint rows)."""
    check_choice("state_layout", state_layout, STATE_LAYOUTS)
    if checkpoint_every is not None:
        check_int("checkpoint_every", checkpoint_every)
    check_block_size("block_size", block_size)


#: What a state row of the versioned layout costs, in state rows of the snapshot layout, per device
#: type: the forward's program build plus its flex kernel, per state row (docs/design.md §5, "Choosing
#: the layout"). The ``stages`` benchmark prints it for each method and length (``row_cost_vs_snapshot``).
#: CPU (2 cores, torch 2.13, fp32, ``profiles/stages.toml``, two runs): 1.5-1.6 for VQ, 2.1-3.8 for OVQ
#: and KVM at 4k-16k; 2 takes the faster layout in each of its six cases. CUDA (one H200, torch 2.11, bf16, H=8,
#: D=64, chunk 128, ``ovqflex bench profiles/gpu.toml --device cuda --only stages``, one run): 2.4-4.2 for VQ,
#: 5.4-6.3 for OVQ, 3.9-7.9 for KVM at 4k-64k; the snapshot layout has 1.33x (VQ), 3.5-5.2x (OVQ) and
#: 2.6-10.7x (KVM) the versioned rows there, and 5.25 takes the faster layout in all nine cases (the two
#: nearest, OVQ at 64k and KVM at 16k, differ by 4% and 6%). Types not listed count a row as a row.
#: Each cost is an exact ratio of two ints, ``(numerator, denominator)`` (5.25 = 21/4): traced code that
#: reads a float from a module under ``torch.compile(dynamic=True)`` gets a symbolic float, and once it is
#: used as a plain number dynamo traces the whole frame again (docs/design.md §3.5); ints stay plain.
LAYOUT_ROW_COST = {"cpu": (2, 1), "cuda": (21, 4)}

#: Most bytes the keys and values of a snapshot state (every chunk's rows, all batch rows and heads) may
#: take for ``auto`` to weigh the layouts by speed (or, with gradients on the blocked backend, by their block
#: lists' widths): past it the layout with fewer rows is taken. The program copies those rows once more, so
#: the forward's peak is about three times this.
#: At 4 GiB every case of the H200 stages run keeps its measured choice (OVQ at 64k, B=1, H=8, bf16: 1.9
#: GiB of snapshot state, 4% faster than its versioned layout), while a batch of 16 at 64k (31 GiB of
#: fp32 snapshot state, out of memory on an 80 GB H100 in ``profiles/decode.toml``'s decode-batched
#: prefill) is versioned.
SNAPSHOT_MAX_BYTES = 4 * 2**30


def memory_decides(n_chunks: int, rows: int, *, grad: bool = False, row_bytes: int = 0) -> bool:
    """Whether memory, not the forward's speed, decides how a state of ``rows`` rows read by ``n_chunks`` chunks
    is laid out: gradients recorded (``grad``: a backward keeps memory in proportion to the state), or a snapshot
    state past :data:`SNAPSHOT_MAX_BYTES` at ``row_bytes`` per row (a state row's key and value bytes over the
    batch and heads; 0: not weighed)."""
    return grad or n_chunks * rows * row_bytes > SNAPSHOT_MAX_BYTES


#: Checkpoint rows per token of the default spacing (:func:`default_every`), by what decides: ``speed``, 2 (a
#: query chunk scans at most ``rows / 2`` version rows; the spacing :data:`LAYOUT_ROW_COST` was measured with),
#: or ``memory`` where the attention backend keeps the program's kv rows (flex: its backward keeps them and
#: writes their gradients, two copies of every state row), 1: a quarter fewer kv rows at long lengths (OVQ, N =
#: 2,048, chunk 128, 64k tokens: 196,608 kv rows instead of 262,144) for a fifth more candidate blocks (11,744
#: instead of 9,800; with random keys, H = 8, 9,181 listed instead of 8,374; causal attention lists 131,328).
#: The blocked backend, how a CPU trains, keeps tensors per listed block instead, so fewer blocks are its smaller
#: memory and it keeps the ``speed`` spacing (docs/design.md §5).
CHECKPOINT_ROWS_PER_TOKEN = {"speed": 2, "memory": 1}


def choose_state_layout(state_layout: str, *, n_chunks: int, rows: int, plan: VersionPlan,
                        device_type: str | None = None, grad: bool = False, row_bytes: int = 0,
                        widths: tuple[int, int] | None = None) -> str:
    """``auto`` -> where memory decides (:func:`memory_decides`: gradients recorded, or a snapshot state past
    :data:`SNAPSHOT_MAX_BYTES`), the layout whose backward keeps less: the one with fewer state rows (snapshot:
    ``n_chunks * rows``), what flex keeps — or, with gradients on the ``blocked`` backend, which keeps its
    gathered tiles instead, the one with the narrower block lists (``widths``: the snapshot's and the versioned
    program's, given for that backend; ties and a state past the bound by rows). Otherwise the cheaper forward on
    ``device_type``: versioned when its rows, at :data:`LAYOUT_ROW_COST` snapshot rows each (a ratio), are fewer
    (``None``: no device, fewer rows). docs/design.md §5, "Choosing the layout"."""
    check_choice("state_layout", state_layout, STATE_LAYOUTS)
    if state_layout != "auto":
        return state_layout
    too_big = memory_decides(n_chunks, rows, row_bytes=row_bytes)  # the snapshot state alone past the bound
    if grad and widths is not None and widths[0] != widths[1] and not too_big:
        return "snapshot" if widths[0] < widths[1] else "versioned"
    snapshot_rows = n_chunks * rows
    by_rows = grad or too_big  # memory_decides
    cost, per = (1, 1) if by_rows else LAYOUT_ROW_COST.get(device_type, (1, 1))
    return "versioned" if plan.state_rows * cost < snapshot_rows * per else "snapshot"


@dataclass
class VersionedSums:
    """Sums of a versioned layout, laid out: ``S = n_ckpt * rows + n_versions`` rows, checkpoints first.

    ``rows[i]`` ``[B, H, S, D_i]`` (in ``x_i``'s :func:`~recurrences.segments.sum_dtype`) and ``counts``
    ``[B, H, S]`` fp32: each row's sum and tokens (a version row sums its slot's tokens up to its own in (slot,
    position) order: the full aggregate on live rows); ``slot`` ``[B, H, S]`` int64: the slot a row belongs to
    (``rows``: a version row of a token in no state); ``born``, ``dies`` ``[B, H, S]`` int32: row ``r`` is live
    for query chunk ``c`` iff ``born[r] <= c < dies[r]``. Rows are in *liveness order* (:func:`liveness_order`):
    checkpoint ``k`` holds its slots at rows ``[k rows, (k + 1) rows)`` and the tokens of chunk ``j`` have their
    version rows at ``n_ckpt rows + [j L, (j + 1) L)``, each such group sorted by ``dies``, latest first (dead
    rows last), ties by slot or position; so the rows of a group live at any chunk are a prefix of it.
    """

    rows: list[Tensor]
    counts: Tensor
    slot: Tensor
    born: Tensor
    dies: Tensor


def liveness_order(dies: Tensor, tie: Tensor, n_tie: int) -> Tensor:
    """``[..., G, n]`` int64: the order of each group's rows (last dim; ``dies [..., G, n]``, ``tie [..., G,
    n]`` int64 in ``[0, n_tie)``, distinct within a group) by ``dies``, latest first, then by ``tie``. A row of
    a checkpoint or of a chunk's version rows is visible while ``born <= c < dies``, with one ``born`` for the
    group's live rows (the checkpoint's chunk, the version rows' entry chunk) and ``born = dies = 0`` for dead
    rows: in this order the rows a chunk sees are a prefix of each group, so the attention's blocks are mostly
    all visible or none (``masks.versioned``: blocks listed full, or not at all; docs/design.md §5)."""
    return torch.sort(tie - dies * n_tie, dim=-1).indices


def versioned_sums(xs: list[Tensor] | tuple[Tensor, ...], routes: Tensor, plan: VersionPlan) -> VersionedSums:
    """Checkpoint and version sums of each ``x`` in ``xs`` (``[B, H, T, D_i]``, already weighted),
    grouped by ``routes`` ``[B, H, T]`` (-1 or ``>= plan.rows``: in no state), laid out in liveness order;
    one sort shared by all ``xs``. Differentiable in ``xs``; ``T <= plan.n_versions``."""
    L, R, nc, rows, lag = plan.chunk_size, plan.every, plan.n_chunks, plan.rows, plan.lag
    Tp, n_ckpt = plan.n_versions, plan.n_ckpt
    T = routes.shape[2]
    if T > Tp:
        raise ValueError(f"routes cover T={T} tokens, more than the plan's {Tp}")
    xs, routes = [pad_to(x.to(sum_dtype(x.dtype)), 2, Tp) for x in xs], pad_to(routes, 2, Tp, value=-1)
    B, H = routes.shape[:2]
    dev = routes.device
    ckpt, ckpt_counts = segment_snapshot_sums(xs, routes, L, nc, rows, lag=lag, every=R)

    with torch.no_grad():
        pos = torch.arange(Tp, device=dev)
        entry = pos // L + lag  # [Tp]
        ok = (routes >= 0) & (routes < rows) & (entry < nc)
        slot = torch.where(ok, routes, rows)  # [B, H, Tp]; slot `rows` collects what no state holds
        order = torch.sort(slot * Tp + pos, dim=-1).indices  # by (slot, position); keys are distinct
        slot_s, entry_s = slot.gather(2, order), entry[order]
        hist = torch.zeros(B, H, rows + 1, dtype=torch.long, device=dev).scatter_add(2, slot, torch.ones_like(slot))
        seg_start = (cumsum(hist, 2) - hist).gather(2, slot_s)  # first sorted index of each token's slot
        idx = pos.expand(B, H, Tp)
        count_s = idx - seg_start + 1
        nxt_slot = torch.cat([slot_s[..., 1:], torch.full_like(slot_s[..., :1], rows + 1)], -1)
        nxt_entry = torch.cat([entry_s[..., 1:], torch.full_like(entry_s[..., :1], nc)], -1)
        same = nxt_slot == slot_s
        last = (slot_s < rows) & ~(same & (nxt_entry == entry_s))  # the group's final token: a live row
        # it lives until its slot's next entry or the next checkpoint (which holds it), whichever is first
        dies_s = torch.minimum(torch.where(same, nxt_entry, nc), -(-entry_s // R) * R)
        live_s = last & (dies_s > entry_s)  # a row entering at a checkpoint's chunk is in that checkpoint
        born_s = torch.where(live_s, entry_s, 0)
        dies_s = torch.where(live_s, dies_s, 0)
        inv = _inverse(order)  # sorted index of each position
        # version rows: each chunk's tokens in liveness order (ver_pos: the token of each version row)
        ver_dies = dies_s.gather(2, inv).view(B, H, nc, L)
        chunk_start = torch.arange(nc, device=dev)[:, None] * L  # [nc, 1]: each chunk's first version row
        ver_pos = (liveness_order(ver_dies, torch.arange(L, device=dev).expand_as(ver_dies), L)
                   + chunk_start).flatten(2)
        ver_sorted = inv.gather(2, ver_pos)  # sorted index of each version row's token
        ver_born, ver_dies = born_s.gather(2, ver_sorted), dies_s.gather(2, ver_sorted)
        ver_counts = count_s.gather(2, ver_sorted).float()
        # checkpoint (k, s) dies at the first entry of s in chunks (R k, R (k + 1)] (a later one is past the
        # next checkpoint, where it dies anyway): put each live group's entry at checkpoint (e - 1) // R
        cell = torch.where(last, ((entry_s - 1) // R) * (rows + 1) + slot_s, n_ckpt * (rows + 1))
        first = torch.full((B, H, (n_ckpt + 1) * (rows + 1)), nc, dtype=torch.long, device=dev)
        first = first.scatter_reduce(2, cell, entry_s.expand(B, H, Tp), reduce="amin")
        first = first.view(B, H, n_ckpt + 1, rows + 1)[:, :, :n_ckpt, :rows]
        ck_chunk = torch.arange(n_ckpt, device=dev)[:, None] * R  # [n_ckpt, 1]: checkpoint k is chunk R k's state
        ck_dies = torch.where(ckpt_counts > 0, torch.minimum(first, ck_chunk + R), 0)
        # [B, H, n_ckpt, rows]: the slot of each checkpoint row in liveness order
        ck_slot = liveness_order(ck_dies, torch.arange(rows, device=dev).expand_as(ck_dies), rows)
        ck_dies = ck_dies.gather(3, ck_slot)
        ck_born = torch.where(ck_dies > 0, ck_chunk, 0)
        ck_counts = ckpt_counts.gather(3, ck_slot)
        born = torch.cat([ck_born.flatten(2), ver_born], -1).to(torch.int32)
        dies = torch.cat([ck_dies.flatten(2), ver_dies], -1).to(torch.int32)
        counts = torch.cat([ck_counts.flatten(2), ver_counts], -1)
        row_slot = torch.cat([ck_slot.flatten(2), slot.gather(2, ver_pos)], -1)
        # where each checkpoint row (in slot order) and each version sum (in sorted order) is laid out
        ck_dest = (_inverse(ck_slot) + torch.arange(n_ckpt, device=dev)[:, None] * rows).flatten(2)
        ver_dest = _inverse(ver_sorted) + n_ckpt * rows

    laid = [placed_rows(plan.state_rows, (ck.flatten(2, 3), ck_dest), (_version_sums(x, order, seg_start), ver_dest))
            for ck, x in zip(ckpt, xs)]
    return VersionedSums(laid, counts, row_slot, born, dies)


def _inverse(perm: Tensor) -> Tensor:
    """The inverse of each permutation ``perm [..., n]`` (int64, along the last dim): ``out[..., perm[..., i]] = i``."""
    return torch.empty_like(perm).scatter_(-1, perm, torch.arange(perm.shape[-1], device=perm.device).expand_as(perm))


#: columns of a version-row sum done at once in fp64: the cumsum's fp64 buffers (and their gradients') are
#: ``[B, H, Tp, 16]``, a quarter of one ``[B, H, Tp, 64]`` fp64 copy, whatever the head dim
FP64_COLUMNS = 16


def _version_sums(x: Tensor, order: Tensor, seg_start: Tensor) -> Tensor:
    """Version sums ``[B, H, Tp, D]`` of ``x [B, H, Tp, D]`` (in x's dtype), in (slot, position) order: each
    token's slot sum up to it, the tokens sorted by ``order`` (``seg_start``: the sorted index where each sorted
    token's slot begins; both ``[B, H, Tp]``).

    One cumsum over all slots minus the running sum before the slot, in fp64, taken
    :data:`FP64_COLUMNS` columns at a time (the columns are independent: the same sums, a fraction
    of the fp64 memory). The cumsum runs across slots, so a non-finite token would reach every
    later slot's rows (also rows of earlier tokens): it is summed as 0 and marks the rows of its own
    slot (all columns) from it on. Eager on the CPU, a finite fp64 total proves every token finite
    (fp32 values cannot overflow fp64) and that pass is skipped."""
    xs = rows_at(x, order)  # sorted by (slot, position)
    marked = not (host_check_is_free(x) and bool(torch.isfinite(x.detach().sum(2, dtype=torch.float64)).all()))
    if marked:
        # masks of detached values (isfinite's abs would keep its input for the backward), taken once on the
        # tokens in their own dtype, not per fp64 column block: non-finite entries summed as 0 (the mask not kept
        # for the backward: _ZeroedNonFinite), and the non-finite tokens so far in each slot
        finite = torch.isfinite(xs.detach())
        bad_so_far = _slot_running_sums((~finite.all(-1)).long(), seg_start)
        xs = _ZeroedNonFinite.apply(xs, finite)
    parts = [_slot_running_sums(cols.double(), seg_start).to(x.dtype) for cols in xs.split(FP64_COLUMNS, dim=-1)]
    sums = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    if marked:
        sums = torch.where(bad_so_far[..., None] > 0, float("nan"), sums)
    return sums


class _ZeroedNonFinite(torch.autograd.Function):
    """``torch.where(finite, x, 0)`` (``finite``: a bool mask of x's shape) whose backward passes the gradient
    through whole and keeps nothing: ``where``'s backward keeps the mask, one byte per summed entry (with H = 8,
    d = 64, 32 MB per summed tensor at 64k tokens, in every compiled training step's kept set,
    ``tools/compiled_saved.py``). With finite tokens the mask is all true and the gradients are the same bits.
    A token with a non-finite entry marks its slot's rows NaN from it on, so none of its own slot's sums pass
    it a gradient; its entries then receive what the cumsum across slots leaves there (zero up to rounding)
    instead of an exact zero: as the snapshot layout, whose sums do not mask, a token gets the gradient of the
    rows it was summed into."""

    @staticmethod
    def forward(ctx, x: Tensor, finite: Tensor) -> Tensor:
        return torch.where(finite, x, 0.0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def _slot_running_sums(xs: Tensor, seg_start: Tensor) -> Tensor:
    """Running sums of ``xs [B, H, Tp, *]`` (tokens sorted by slot) within each token's slot: the
    cumsum over all tokens minus its value before the slot's first token (sorted index ``seg_start
    [B, H, Tp]``)."""
    cs = cumsum(xs, 2)
    if xs.dim() == 3:  # one column
        return cs - (cs - xs).gather(2, seg_start)
    return cs - rows_at(cs - xs, seg_start)


def rows_at(x: Tensor, index: Tensor) -> Tensor:
    """``x[b, h, index[b, h, t]]``: ``[B, H, T, C]`` rows of ``x [B, H, S, C]`` at ``index [B, H, T]`` int64.

    ``gather`` along dim 2 whose backward keeps only the index and x's shape (:class:`_RowsAt`):
    eager autograd's ``gather`` keeps ``x`` whole — for the version sums a ``[B, H, T, 16]`` fp64
    copy per column block and a ``[B, H, T, D]`` one per summed tensor, alive until the backward.
    Compiled, it is ``gather`` and ``scatter_add`` as before (an ``index_select`` of the flattened
    rows would keep only the index too, but compiled it costs more time and memory than ``gather``)."""
    return _RowsAt.apply(x, index[..., None].expand(*index.shape, x.shape[-1]))


def placed_rows(n: int, *parts: tuple[Tensor, Tensor]) -> Tensor:
    """``[B, H, n, C]``: the rows of each part ``(x [B, H, N_i, C], dest [B, H, N_i] int64)`` written at rows
    ``dest`` (the parts' ``dest`` together name every row ``0..n-1`` once per batch row and head): a
    concatenation and a permutation in one pass over the rows (``index_copy_`` of whole rows), whose backward
    reads each part's rows back (``index_select``) and keeps only the indices (:class:`_PlacedRows`)."""
    xs, dests = [x for x, _ in parts], [d for _, d in parts]
    return _PlacedRows.apply(n, len(parts), *dests, *xs)


class _PlacedRows(torch.autograd.Function):
    """:func:`placed_rows`: ``forward(n, k, dest_1..dest_k, x_1..x_k)``."""

    @staticmethod
    def forward(ctx, n: int, k: int, *args: Tensor) -> Tensor:
        dests, xs = args[:k], args[k:]
        B, H, _, C = xs[0].shape
        base = torch.arange(B * H, device=xs[0].device).view(B, H, 1) * n
        flat = [(d + base).flatten() for d in dests]  # rows of the flattened [B * H * n, C] output
        out = xs[0].new_empty(B * H * n, C)
        for x, f in zip(xs, flat):
            out.index_copy_(0, f, x.reshape(-1, C))
        ctx.save_for_backward(*flat)
        ctx.shapes = [x.shape for x in xs]
        return out.view(B, H, n, C)

    @staticmethod
    def backward(ctx, grad: Tensor):
        g = grad.reshape(-1, grad.shape[-1])
        return (None, None, *(None for _ in ctx.shapes),
                *(g.index_select(0, f).view(shape) for f, shape in zip(ctx.saved_tensors, ctx.shapes)))


class _RowsAt(torch.autograd.Function):
    """``x.gather(2, index)`` (index ``[B, H, T, C]``) that saves the index and x's shape for the backward."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.x_shape = x.shape
        return x.gather(2, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.x_shape).scatter_add(2, index, grad), None


def snapshot_from_versioned(rows_of: Tensor, vs: VersionedSums, plan: VersionPlan, c: int) -> tuple[Tensor, Tensor]:
    """Test/inspection helper: the state query chunk ``c`` sees through a versioned layout.

    ``rows_of`` ``[B, H, S, D]`` the laid-out rows (checkpoints then versions). Returns
    ``(state [B, H, rows, D], seen [B, H, rows] int64)`` by slot: the sum of the visible rows of each
    slot and how many there are (0 or 1 in a correct layout). Plain gathers, ``O(S)``: not for the training path.
    """
    B, H, S, D = rows_of.shape
    k = c // plan.every
    r = torch.arange(S, device=rows_of.device)
    lo_t = max(0, (k * plan.every - plan.lag + 1) * plan.chunk_size)
    hi_t = max(0, (c - plan.lag + 1) * plan.chunk_size)
    off = plan.n_ckpt * plan.rows
    in_ck = (r >= k * plan.rows) & (r < (k + 1) * plan.rows)
    in_ver = (r >= off + lo_t) & (r < off + hi_t)
    live = (vs.born <= c) & (c < vs.dies) & (in_ck | in_ver)
    slot = torch.where(live, vs.slot, plan.rows)
    state = rows_of.new_zeros(B, H, plan.rows + 1, D).scatter_add(2, slot[..., None].expand(B, H, S, D),
                                                                   rows_of * live[..., None])
    seen = torch.zeros(B, H, plan.rows + 1, dtype=torch.long, device=r.device).scatter_add(2, slot, live.long())
    return state[:, :, :plan.rows], seen[:, :, :plan.rows]


@dataclass
class Versioned:
    """A method's state in the versioned layout, after its per-row readout (OVQ dictionary means,
    KVM ``LN_s`` keys and radius values, VQ codebook means; the snapshot layout's counterpart is
    :class:`recurrences.segments.Snapshots`): ``S = plan.state_rows`` rows, checkpoints first.

    keys ``[B, H, S, D]``, values ``[B, H, S, Dv]``, counts ``[B, H, S]`` fp32 (tokens per row),
    born/dies ``[B, H, S]`` int32 (row ``r`` is live for chunk ``c`` iff ``born <= c < dies``).
    """

    keys: Tensor
    values: Tensor
    counts: Tensor
    born: Tensor
    dies: Tensor
    plan: VersionPlan

    def bias(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """``log(count)`` of live rows, ``-inf`` for rows no chunk sees: ``[B, H, S]`` in ``dtype`` (the log
        taken in it: fp32, or fp64 for an fp64 program)."""
        return torch.where(self.dies > self.born, self.counts.to(dtype).clamp_min(1.0).log(), float("-inf"))


def versioned_means(k: Tensor, v: Tensor, routes: Tensor, plan: VersionPlan) -> Versioned:
    """Means of the keys and values routed to each slot, laid out as :func:`versioned_sums`, in k's and v's
    dtypes (divided in the sums' dtype)."""
    vs = versioned_sums([k, v], routes, plan)
    (ks, vv), denom = vs.rows, vs.counts.clamp_min(1.0)[..., None]
    return Versioned((ks / denom.to(ks.dtype)).to(k.dtype), (vv / denom.to(vv.dtype)).to(v.dtype), vs.counts, vs.born,
                     vs.dies, plan)
