"""Token-level view: one cell per (query, kv row), labelled by region (small T only)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..program import AttentionProgram
from .labels import label_cells, label_names, row_bias

#: Largest number of cells a token view materializes (use the block view beyond).
MAX_TOKEN_CELLS = 1 << 22


@dataclass
class TokenView:
    """``labels [Q, KV]`` uint8 (indices into ``names``) for queries ``q_range`` and kv
    rows ``kv_range``; ``bias [KV]`` fp32 of those rows (None: the program has no
    score_mod); ``n_state``: kv rows before the first token row."""

    labels: Tensor
    names: tuple[str, ...]
    bias: Tensor | None
    q_range: tuple[int, int]
    kv_range: tuple[int, int]
    n_state: int

    def counts(self) -> dict[str, int]:
        """Number of cells per label (``masked`` included)."""
        n = torch.bincount(self.labels.flatten().long(), minlength=len(self.names))
        return {name: int(c) for name, c in zip(self.names, n)}


def _check_range(name: str, rng, limit: int) -> tuple[int, int]:
    if rng is None:
        return 0, limit
    if len(rng) != 2 or not all(isinstance(v, int) for v in rng) or not 0 <= rng[0] < rng[1] <= limit:
        raise ValueError(f"{name} must be (start, stop) with 0 <= start < stop <= {limit}, got {rng!r}")
    return int(rng[0]), int(rng[1])


def token_view(program: AttentionProgram, *, batch: int = 0, head: int = 0, q_range=None, kv_range=None,
               max_cells: int = MAX_TOKEN_CELLS) -> TokenView:
    """Label every cell of queries ``q_range`` (default all real queries) x kv rows ``kv_range``
    (default state rows and the real token rows, ``[0, S + q_len)``).

    Refuses more than ``max_cells`` cells with a ValueError pointing at the block view.
    """
    g = program.geom
    bias = row_bias(program, batch, head)
    q0, q1 = _check_range("q_range", q_range, g.q_len)
    k0, k1 = _check_range("kv_range", kv_range, g.n_state + g.q_len)
    cells = (q1 - q0) * (k1 - k0)
    if cells > max_cells:
        raise ValueError(f"token view of {q1 - q0} queries x {k1 - k0} kv rows = {cells} cells exceeds "
                         f"max_cells={max_cells}; use the block view or a smaller q_range/kv_range")
    dev = program.q.device
    q_idx = torch.arange(q0, q1, device=dev)[:, None]
    kv_idx = torch.arange(k0, k1, device=dev)[None, :]
    labels = label_cells(program, q_idx, kv_idx, bias, batch=batch, head=head)
    return TokenView(labels.cpu(), label_names(program), None if bias is None else bias[k0:k1].cpu(),
                     (q0, q1), (k0, k1), g.n_state)
