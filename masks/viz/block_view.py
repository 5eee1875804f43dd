"""Block-level view: one cell per (query block, kv block), from the analytic block lists.

Never evaluates the mask: the grid is ``[n_q_blocks, n_kv_blocks]`` bytes scattered
from the program's ``BlockLayout`` (64k tokens with a 2k-row state bank per 128-token
chunk: 512 x 8,704 cells, 4.5 MB).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..blocks import BlockLayout
from ..program import AttentionProgram
from ..regions import Geometry

EMPTY, PARTIAL, FULL = 0, 1, 2
BLOCK_NAMES = ("empty", "partial", "full")
BLOCK_COLORS = {"empty": "#f0f0f0", "partial": "#fd8d3c", "full": "#08519c"}
BLOCK_CHARS = {"empty": " ", "partial": "▒", "full": "█"}


@dataclass
class BlockView:
    """``grid [n_q_blocks, n_kv_blocks]`` uint8: 0 empty, 1 partial (mask_mod applied), 2 full."""

    grid: Tensor
    geom: Geometry

    def counts(self) -> dict[str, int]:
        n = torch.bincount(self.grid.flatten().long(), minlength=3)
        return {name: int(c) for name, c in zip(BLOCK_NAMES, n)}


def block_view(program: AttentionProgram | BlockLayout) -> BlockView:
    """The block grid of a program (or of its layout). Memory: one byte per block."""
    lay = program.layout if isinstance(program, AttentionProgram) else program
    g = lay.geom
    idx, valid, full = lay.entries()  # [nQB, W]
    rows = torch.arange(g.n_q_blocks, device=idx.device)[:, None].expand_as(idx)
    grid = torch.zeros(g.n_q_blocks, g.n_kv_blocks, dtype=torch.uint8, device=idx.device)
    value = torch.where(full, FULL, PARTIAL).to(torch.uint8)
    grid[rows[valid], idx[valid]] = value[valid]
    return BlockView(grid.cpu(), g)
