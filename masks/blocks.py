"""Analytic block-sparse structure of a program (docs/design.md §3.2).

The block lists are derived from the regions' interval bounds evaluated at the
first and last query of each query block — never from a dense evaluation of the
``mask_mod``. A region with a per-row predicate inside its interval may then sort its
candidate blocks into full, partial and unseen from a summary of each whole kv block
(``Region.refine_blocks``: the versioned layout's liveness, one pass over its rows). Work
and memory are proportional to the number of candidate blocks (``n_q_blocks x width``,
with ``width`` a static bound from the regions) and state rows, plus the zero-padded
index storage FlexAttention's CPU kernel insists on.

Everything here is plain tensor code with static shapes, so a layer that builds
its program inside ``torch.compile(fullgraph=True)`` traces it without breaks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from recurrences.compiling import size_max, size_min
from recurrences.scan import cumsum

from .regions import Geometry, Region


def _cdiv(a, b):
    return -(-a // b)


@dataclass
class BlockLayout:
    """Compact block lists, one row per query block.

    ``kv_num``/``kv_idx``: partial blocks (mask_mod applied), ``[nQB]`` and
    ``[nQB, Wp]`` int32, ascending, entries past ``kv_num`` are 0.
    ``full_num``/``full_idx``: blocks every query of the row block sees fully.
    """

    geom: Geometry
    kv_num: Tensor
    kv_idx: Tensor
    full_num: Tensor
    full_idx: Tensor

    def entries(self) -> tuple[Tensor, Tensor, Tensor]:
        """Partial and full blocks merged into one ascending list per query block, for gathering
        backends (the ``blocked`` backend, the visualizer).

        Returns ``idx [nQB, W]`` (int64, 0 where unused), ``valid [nQB, W]`` and ``full [nQB, W]``
        bool, ``W = Wp``: both lists come from one de-duplicated set of at most ``Wp`` candidate
        blocks (:func:`build_block_layout`), so ``kv_num + full_num <= Wp`` and a backend that
        gathers ``W`` blocks per query block gathers no always-empty half.
        """
        wp, wf = self.kv_idx.shape[-1], self.full_idx.shape[-1]
        dev = self.kv_idx.device
        listed = torch.cat([torch.arange(wp, device=dev) < self.kv_num[:, None],
                            torch.arange(wf, device=dev) < self.full_num[:, None]], dim=-1)
        is_full = torch.cat([torch.zeros(wp, dtype=torch.bool, device=dev),
                             torch.ones(wf, dtype=torch.bool, device=dev)]).expand_as(listed)
        unused = self.geom.n_kv_blocks  # past every block index: sorts last
        key = torch.where(listed, torch.cat([self.kv_idx, self.full_idx], dim=-1).long(), unused)
        key, order = torch.sort(key, dim=-1)  # a block is in one list only: no ties among listed ones
        key, order = key[:, :wp], order[:, :wp]
        valid = key < unused
        return torch.where(valid, key, 0), valid, is_full.gather(-1, order) & valid

    def visible_blocks(self) -> Tensor:
        """Number of (query block, kv block) tiles listed, partial + full (0-d)."""
        return self.kv_num.sum() + self.full_num.sum()

    def block_mask(self, mask_mod, *, with_q_side: bool = False) -> BlockMask:
        """The FlexAttention ``BlockMask`` (leading dims ``[1, 1]``, broadcast over B, H).

        The CPU flex kernel requires index storage at least ``n_kv_blocks`` wide, so
        the compact lists are zero-padded to that width. ``with_q_side`` also builds
        the transposed (q-major) lists the backward kernel needs, analytically.
        """
        g = self.geom
        kv_idx = _pad_width(self.kv_idx, g.n_kv_blocks)
        full_idx = _pad_width(self.full_idx, g.n_kv_blocks)
        bm = BlockMask.from_kv_blocks(
            self.kv_num.view(1, 1, -1),
            kv_idx.view(1, 1, *kv_idx.shape),
            self.full_num.view(1, 1, -1),
            full_idx.view(1, 1, *full_idx.shape),
            BLOCK_SIZE=(g.block_q, g.block_kv),
            mask_mod=mask_mod,
            seq_lengths=(g.q_pad, g.kv_len),
            compute_q_blocks=False,
        )
        if with_q_side:
            qn, qi = _transpose(self.kv_num, self.kv_idx, g.n_kv_blocks, g.n_q_blocks)
            fqn, fqi = _transpose(self.full_num, self.full_idx, g.n_kv_blocks, g.n_q_blocks)
            bm.q_num_blocks, bm.q_indices = qn.view(1, 1, -1), qi.view(1, 1, *qi.shape)
            bm.full_q_num_blocks, bm.full_q_indices = fqn.view(1, 1, -1), fqi.view(1, 1, *fqi.shape)
        return bm


def _pad_width(idx: Tensor, width: int) -> Tensor:
    if idx.shape[-1] >= width:
        return idx[..., :width].contiguous()
    out = idx.new_zeros(idx.shape[0], width)
    out[:, : idx.shape[-1]] = idx
    return out


def _transpose(num: Tensor, idx: Tensor, n_rows_out: int, width_out: int) -> tuple[Tensor, Tensor]:
    """Turn row-major block lists into column-major ones (kv block -> q blocks).

    Cost O(entries log entries): the valid (row, col) pairs are sorted by column.
    """
    n_rows, w = idx.shape
    dev = idx.device
    valid = torch.arange(w, device=dev) < num[:, None]
    rows = torch.arange(n_rows, device=dev)[:, None].expand(n_rows, w)
    big = n_rows_out * n_rows  # sorts invalid entries last
    key = torch.where(valid, idx.long() * n_rows + rows, big).flatten()
    key = torch.sort(key).values
    ok = key < big
    col, row = key // n_rows, key % n_rows
    counts = torch.zeros(n_rows_out + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, torch.where(ok, col, n_rows_out), torch.ones_like(col))
    counts = counts[:n_rows_out]
    start = cumsum(counts, 0) - counts
    pos = torch.arange(key.numel(), device=dev) - start[col.clamp(max=n_rows_out - 1)]
    out = torch.zeros(n_rows_out * width_out + 1, dtype=torch.int32, device=dev)
    flat = torch.where(ok, col * width_out + pos, n_rows_out * width_out)
    out.scatter_(0, flat, row.to(torch.int32))
    return counts.to(torch.int32), out[:-1].view(n_rows_out, width_out)


def _region_width(region: Region, geom: Geometry) -> int:
    return size_min(region.max_blocks(geom), geom.n_kv_blocks)


def list_width(regions: Sequence[Region], geom: Geometry) -> int:
    """The width ``Wp`` of the block lists :func:`build_block_layout` makes for ``regions`` over ``geom``: each
    region's :meth:`~masks.regions.Region.max_blocks` (at most every kv block), summed, at most every kv block.
    Static, from the regions' int fields alone, so it is known before their tensors are (a state layout's,
    before its state is built: ``ovqflex.ops.state_program``); the ``blocked`` backend gathers this many kv
    blocks for every query block."""
    return size_min(sum(_region_width(r, geom) for r in regions), geom.n_kv_blocks)


def build_block_layout(
    regions: tuple[Region, ...], params: tuple[tuple[Tensor, ...], ...], geom: Geometry, *, refine: bool = True
) -> BlockLayout:
    """Block lists of the union of ``regions`` (their ``params`` already on device). ``refine=False``: the
    candidate lists alone, every block of a region that is not ``exact`` partial (``Region.refine_blocks``
    skipped): the same outputs, with the work a kernel does without the refinement (the ``stages`` bench
    times both)."""
    if not regions:
        raise ValueError("a program needs at least one region")
    bq, bk, nkv = geom.block_q, geom.block_kv, geom.n_kv_blocks
    dev = params[0][0].device
    q_first = torch.arange(geom.n_q_blocks, device=dev, dtype=torch.int32) * bq
    ends = torch.stack([q_first, q_first + (bq - 1)])  # [2, nQB]: each query block's first and last query
    cands, valids, fulls = [], [], []
    full_width = 0  # the widths of the regions that can list full blocks: the full lists need no wider
    memo: dict = {}  # summaries of whole blocks, shared by the regions of one shared test (Region.refine_blocks)
    for region, p in zip(regions, params):
        lo, hi = (x.long() for x in region.bounds(p, ends))  # both ends of every block in one evaluation
        # rows some query of the block sees: [lo(first), hi(last)); rows all see: [lo(last), hi(first))
        blo, flo = lo[0] // bk, _cdiv(lo[1], bk)
        bhi, fhi = _cdiv(hi[1], bk), hi[0] // bk
        width = _region_width(region, geom)
        cand = blo[:, None] + torch.arange(width, device=dev)
        valid = (cand < bhi[:, None]) & (cand < nkv)
        full = valid & (cand >= flo[:, None]) & (cand < fhi[:, None])
        if region.exact:
            full_width += width
        else:
            refined = region.refine_blocks(p, geom, ends, cand, valid, memo) if refine else None
            if refined is None:  # rows inside the interval may be masked: every block is partial
                full = torch.zeros_like(full)
            else:
                (valid, full), full_width = refined, full_width + width
        cands.append(cand)
        valids.append(valid)
        fulls.append(full)
    cand, valid, full = torch.cat(cands, -1), torch.cat(valids, -1), torch.cat(fulls, -1)

    # de-duplicate blocks listed by several regions; a block full in any region is full
    big = 2 * nkv + 2
    key = torch.where(valid, 2 * cand + (~full).long(), big)
    key = torch.sort(key, dim=-1).values
    blk = key // 2
    prev = torch.cat([torch.full_like(blk[:, :1], -1), blk[:, :-1]], dim=-1)
    keep = (key < big) & (blk != prev)
    is_full = (key % 2) == 0
    out_w = size_min(cand.shape[-1], nkv)  # list_width(regions, geom): the sum of the widths above
    kv_num, kv_idx = _compact(blk, keep & ~is_full, out_w, big)
    full_num, full_idx = _compact(blk, keep & is_full, size_max(1, size_min(full_width, nkv)), big)
    return BlockLayout(geom, kv_num, kv_idx, full_num, full_idx)


def _compact(blk: Tensor, keep: Tensor, width: int, big: int) -> tuple[Tensor, Tensor]:
    srt = torch.sort(torch.where(keep, blk, big), dim=-1).values[:, :width]
    num = keep.sum(-1)
    idx = torch.where(torch.arange(width, device=blk.device) < num[:, None], srt, 0)
    return num.to(torch.int32), idx.to(torch.int32)
