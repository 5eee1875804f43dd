"""Regions of the versioned state layout (docs/design.md §5 "Versioned"; rows from :mod:`recurrences.versioned`).

State rows are ``[checkpoints: n_ckpt x rows ; version rows: one per token position]``.
Query chunk ``c`` (checkpoint ``k = c // R``) reads

- :class:`CheckpointBank`: rows ``[k rows, k rows + live[k])`` (``live[k] = sizes[R k]``);
- :class:`VersionRows`: the version rows of tokens ``[(R k - lag + 1) L, (c - lag + 1) L)``,
  i.e. those entering the state in chunks ``(R k, c]``.

Both are intervals with non-decreasing bounds (the analytic block builder's contract), and
inside them a row is visible only while ``born[b, h, r] <= c < dies[b, h, r]`` — a per-row
predicate read from captured int32 tensors (``[B, H, rows + 1]``: the last row dead, read for every
kv row after the state's, so token rows are never live), so these regions are not ``exact``. The
liveness alone decides (a live row always lies in its region's interval,
:mod:`recurrences.versioned`), so the two regions share it as one test (``shared_test``): the
``mask_mod`` compares two gathered rows with the query's chunk once, not each region's interval
and liveness. The queries of padding chunks read the last chunk's state, as
:class:`~masks.regions.StateBank` does.

Blocks (:meth:`CheckpointBank.refine_blocks`): the liveness of each whole kv block, over its rows in
every batch row and head, is summarised once (:func:`block_liveness`: the earliest birth and the
latest death of its live rows, the latest birth and the earliest death of all its rows), and a
candidate block of a query block whose chunks run from ``c0`` to ``c1`` is listed when some row may
live then, and full when every row lives from ``c0`` to ``c1``: no ``mask_mod`` runs on it. The rows
are laid out in liveness order (``recurrences.versioned.liveness_order``: each checkpoint's and each
chunk's rows by death, latest first), so a chunk's live rows are a prefix of each checkpoint: most of
its blocks are full, its dead rows' blocks are not listed, and the rows of a head that differ from
the others' fall in a block or two at the prefix's end.

Viewers: the token view and the query inspector pass ``contains`` the batch row and head they draw
(``masks.viz.labels.label_cells``), without which it reads batch 0, head 0; statistics computed from the
interval bounds alone (``masks.viz.stats``) count every candidate row, live or not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from recurrences.versioned import VersionPlan

from .regions import Geometry, Region, _i32, known_multiple, touched_chunks


def _in_one_interval(geom: Geometry, chunk_size: int, every: int) -> bool:
    """Whether the chunks of every query block lie in one checkpoint interval (``every`` chunks): a block
    inside one chunk, or of ``t`` whole chunks (starting at a multiple of ``t``) with ``t`` dividing ``every``
    (provably, for a symbolic ``every``)."""
    t = touched_chunks(geom, chunk_size)
    return t == 1 or (geom.block_q % chunk_size == 0 and known_multiple(every, t))


def _liveness(born: Tensor, dies: Tensor, geom: Geometry) -> tuple[Tensor, Tensor]:
    """born, dies ``[B, H, rows + 1]`` int32: the state's rows, then one dead row (``born = dies = 0``),
    which :func:`_live` reads for every later kv row (state padding, tokens)."""
    if born.shape[-1] > geom.n_state:
        raise ValueError(f"liveness covers {born.shape[-1]} rows, more than the program's {geom.n_state} state rows")
    return F.pad(born.to(torch.int32), (0, 1)), F.pad(dies.to(torch.int32), (0, 1))


#: born of a block without live rows in :func:`block_liveness`: later than any chunk
NEVER = 2**30


def block_liveness(born: Tensor, dies: Tensor, geom: Geometry) -> Tensor:
    """``[4, n + 1]`` int32 over the ``n`` kv blocks of ``geom.block_kv`` rows that hold state rows (``born,
    dies [B, H, S + 1]`` as :func:`_liveness` gives them: state rows, then one dead row): per block, over its
    rows in every batch row and head, the earliest birth of a live row (:data:`NEVER` if none), the latest
    death, the latest birth and the earliest death (a dead row's 0: never full); the last column a block of
    no state row. A block's row may live for some chunk of ``[c0, c1]`` only if ``first_born <= c1`` and
    ``last_dies > c0``; every row lives for every such chunk iff ``last_born <= c0`` and ``first_dies > c1``.
    Rows past the state (a block shared with token rows) are dead."""
    bk, S = geom.block_kv, born.shape[-1] - 1
    n = -(-S // bk)
    unseen = torch.tensor([NEVER, 0, 0, 0], dtype=torch.int32, device=born.device)[:, None]
    if not born.shape[0] * born.shape[1]:  # an empty batch: no rows to reduce, every block as one of no state row
        return unseen.expand(4, n + 1)
    born, dies = (F.pad(x[..., :S], (0, n * bk - S)).unflatten(-1, (n, bk)).transpose(0, 2).flatten(1)
                  for x in (born, dies))  # [n, B * H * bk]: dead rows (0, 0) pad the last block
    stats = torch.stack([torch.where(dies > born, born, NEVER).amin(-1), dies.amax(-1), born.amax(-1),
                         dies.amin(-1)])
    return torch.cat([stats, unseen], dim=1)


def _refine(region: Region, p, born: Tensor, dies: Tensor, geom: Geometry, ends: Tensor, cand: Tensor,
            valid: Tensor, memo: dict) -> tuple[Tensor, Tensor]:
    """``Region.refine_blocks`` of a versioned region (``born, dies`` its captured liveness; ``region._chunk``
    the chunk its test reads for a query): the blocks some row may be live in, and those whose rows all live
    for every chunk of the query block."""
    key = region.shared_test
    if key not in memo:
        memo[key] = block_liveness(born, dies, geom)
    stats = memo[key]
    c0, c1 = (c[:, None] for c in region._chunk(p, ends))  # the query block's first and last chunk
    s = stats[:, torch.clamp(cand, max=stats.shape[1] - 1)]  # [4, nQB, width]; past the state: no row
    listed = valid & (s[0] <= c1) & (s[1] > c0)
    return listed, listed & (s[2] <= c0) & (s[3] > c1)


def _live(born: Tensor, dies: Tensor, c: Tensor, kv_idx: Tensor, b, h) -> Tensor:
    """``born[b, h, r] <= c < dies[b, h, r]`` (``b, h`` None: batch 0, head 0, as a viewer draws), a kv
    row past the liveness (state padding, tokens) reading its last, dead row."""
    r = torch.clamp(kv_idx, min=0, max=born.shape[-1] - 1)
    b = 0 if b is None else b
    h = 0 if h is None else h
    return (born[b, h, r] <= c) & (c < dies[b, h, r])


@dataclass(frozen=True, eq=False)
class CheckpointBank(Region):
    """Checkpoint ``k = c // every`` of query chunk ``c``: rows ``[k rows, k rows + live[k])``,
    each visible while the slot has no newer version (``born <= c < dies``). ``max_live``: the most rows any
    checkpoint holds (None: ``rows``), a static bound of ``live`` that narrows the block lists (the last
    checkpoint's, since sizes never decrease: a growing state's checkpoints hold fewer rows than the
    largest state, which ``rows`` is sized for)."""

    rows: int
    chunk_size: int
    every: int
    n_chunks: int
    live: Tensor
    born: Tensor
    dies: Tensor
    max_live: int | None = None
    name: ClassVar[str] = "state"
    exact: ClassVar[bool] = False
    shared_test: ClassVar[str] = "versioned-liveness"  # a program has one state: these two regions share it

    def params(self, geom, device):
        born, dies = _liveness(self.born, self.dies, geom)
        return (_i32([self.rows, self.chunk_size, self.every, self.n_chunks - 1], device),
                self.live.to(device=device, dtype=torch.int32), born, dies)

    @staticmethod
    def _chunk(p, q_idx):
        t = p[0]
        return torch.clamp(q_idx // t[1], max=t[3])

    @staticmethod
    def bounds(p, q_idx):
        t, live = p[0], p[1]
        k = CheckpointBank._chunk(p, q_idx) // t[2]
        lo = k * t[0]
        return lo, lo + live[k]

    def contains(self, p, q_idx, kv_idx, b=None, h=None):
        lo, hi = self.bounds(p, q_idx)
        return (kv_idx >= lo) & (kv_idx < hi) & self.test_shared(p, q_idx, kv_idx, b, h)

    def test_shared(self, p, q_idx, kv_idx, b=None, h=None):
        return _live(p[2], p[3], self._chunk(p, q_idx), kv_idx, b, h)

    def refine_blocks(self, p, geom, ends, cand, valid, memo):
        return _refine(self, p, p[2], p[3], geom, ends, cand, valid, memo)

    def max_span(self, geom):
        # chunks c0..c1 of one query block touch checkpoints c0 // R .. c1 // R: from the first one's start to
        # the last one's live rows
        live = self.rows if self.max_live is None else self.max_live
        if _in_one_interval(geom, self.chunk_size, self.every):
            return live
        return -(-(touched_chunks(geom, self.chunk_size) - 1) // self.every) * self.rows + live

    def start_lattice(self, geom):
        return 0, self.rows  # checkpoint k's rows start at k rows


@dataclass(frozen=True, eq=False)
class VersionRows(Region):
    """Version rows (one per token position, from state row ``offset``) of the tokens entering
    the state in chunks ``(every * (c // every), c]``, each visible while it is its slot's latest."""

    chunk_size: int
    every: int
    lag: int
    n_chunks: int
    offset: int
    n_versions: int
    born: Tensor
    dies: Tensor
    name: ClassVar[str] = "state"
    exact: ClassVar[bool] = False
    shared_test: ClassVar[str] = "versioned-liveness"  # a program has one state: these two regions share it

    def params(self, geom, device):
        born, dies = _liveness(self.born, self.dies, geom)
        return (_i32([self.chunk_size, self.every, self.lag, self.n_chunks - 1, self.offset, self.n_versions], device),
                born, dies)

    @staticmethod
    def _chunk(p, q_idx):
        t = p[0]
        return torch.clamp(q_idx // t[0], max=t[3])

    @staticmethod
    def bounds(p, q_idx):
        t = p[0]
        c = VersionRows._chunk(p, q_idx)
        first = (c // t[1]) * t[1]  # the checkpoint's chunk
        lo = torch.minimum(torch.clamp((first - t[2] + 1) * t[0], min=0), t[5])  # tensor bounds: no .item()
        hi = torch.minimum(torch.clamp((c - t[2] + 1) * t[0], min=0), t[5])
        return t[4] + lo, t[4] + hi

    def contains(self, p, q_idx, kv_idx, b=None, h=None):
        lo, hi = self.bounds(p, q_idx)
        return (kv_idx >= lo) & (kv_idx < hi) & self.test_shared(p, q_idx, kv_idx, b, h)

    def test_shared(self, p, q_idx, kv_idx, b=None, h=None):
        return _live(p[1], p[2], self._chunk(p, q_idx), kv_idx, b, h)

    def refine_blocks(self, p, geom, ends, cand, valid, memo):
        return _refine(self, p, p[1], p[2], geom, ends, cand, valid, memo)

    def max_span(self, geom):
        # over one query block: chunks c0..c1 read tokens from (R floor(c0/R) - lag + 1) L to (c1 - lag + 1) L,
        # and c1 - R floor(c0/R) <= R - 1 when c0..c1 lie in one checkpoint interval
        extra = 0 if _in_one_interval(geom, self.chunk_size, self.every) else touched_chunks(geom, self.chunk_size) - 1
        return (self.every - 1 + extra) * self.chunk_size

    def start_lattice(self, geom):
        return self.offset, self.chunk_size  # the version rows of whole chunks (clamped to the last)


def versioned_regions(plan: VersionPlan, sizes: Tensor | Sequence[int], born: Tensor,
                      dies: Tensor, max_live: int | None = None) -> tuple[Region, Region]:
    """The two state regions of a versioned layout; ``sizes [>= n_chunks]`` (ints or an int tensor): rows
    chunk ``c`` reads; ``max_live``: at least the last checkpoint's ``sizes[every (n_ckpt - 1)]``, as a plain
    int (None: ``plan.rows``), which bounds the checkpoints' block lists (:class:`CheckpointBank`)."""
    live = torch.as_tensor(sizes, device=born.device)[:: plan.every][: plan.n_ckpt].to(torch.int32)
    return (CheckpointBank(plan.rows, plan.chunk_size, plan.every, plan.n_chunks, live, born, dies, max_live),
            VersionRows(plan.chunk_size, plan.every, plan.lag, plan.n_chunks, plan.n_ckpt * plan.rows, plan.n_versions,
                        born, dies))
