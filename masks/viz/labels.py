"""Cell labels of a drawn program: which region a visible (query, kv row) cell belongs to.

A cell takes the label of the first region containing it in :data:`REGION_ORDER`
(regions may overlap: sinks lie inside a causal window); a region name outside
that list (a new method's) comes after them, in program order. A cell no region
contains — or whose kv row has bias ``-inf`` (an empty state row) — is ``masked``.
Label ``0`` is always ``masked``; label ``k`` is ``names[k]``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..program import AttentionProgram
from recurrences.checks import check_int

MASKED = "masked"
REGION_ORDER = ("sink", "state", "window", "causal")
PALETTE = {MASKED: "#f0f0f0", "sink": "#d62728", "state": "#1f77b4", "window": "#2ca02c", "causal": "#ff7f0e"}
_EXTRA = ("#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
CHARS = {MASKED: ".", "sink": "S", "state": "#", "window": "w", "causal": "c"}


def label_names(program: AttentionProgram) -> tuple[str, ...]:
    """``("masked", *region names in drawing priority)`` for this program."""
    present = list(dict.fromkeys(r.name for r in program.regions))
    known = [n for n in REGION_ORDER if n in present]
    return (MASKED, *known, *[n for n in present if n not in REGION_ORDER])


def label_styles(names) -> dict[str, tuple[str, str]]:
    """``{name: (glyph, hex colour)}`` of a view's labels (``names``, as :func:`label_names` gives them): the
    known ones their own (:data:`CHARS`, :data:`PALETTE`); each other name (a new method's region) its first
    letter, lower case, else upper case, unless a label before it has that glyph, else the first free one of
    ``a-z0-9``, and the :data:`_EXTRA` colours in turn. So no two labels of one view share a glyph, nor a colour
    while it holds at most ``len(_EXTRA)`` unknown names."""
    styles = {n: (CHARS[n], PALETTE[n]) for n in names if n in PALETTE}
    taken = {glyph for glyph, _ in styles.values()}
    others = [n for n in names if n not in PALETTE]
    pool = "abcdefghijklmnopqrstuvwxyz0123456789"
    for i, name in enumerate(others):
        glyph = next((g for g in (name[:1].lower(), name[:1].upper(), *pool) if g and g not in taken), "?")
        taken.add(glyph)
        styles[name] = (glyph, _EXTRA[i % len(_EXTRA)])
    return styles


def check_batch_head(program: AttentionProgram, batch: int, head: int) -> None:
    B, H = program.q.shape[:2]
    check_int("batch", batch, minimum=0)
    check_int("head", head, minimum=0)
    if batch >= B:
        raise ValueError(f"batch must be < B={B}, got {batch}")
    if head >= H:
        raise ValueError(f"head must be < H={H}, got {head}")


def row_bias(program: AttentionProgram, batch: int = 0, head: int = 0) -> Tensor | None:
    """Bias ``[KV]`` fp32 of every kv row for one (batch, head), or None (no score_mod)."""
    check_batch_head(program, batch, head)
    return None if program.bias is None else program.bias[batch, head].float()


def label_cells(program: AttentionProgram, q_idx: Tensor, kv_idx: Tensor, bias: Tensor | None, *, batch: int = 0,
                head: int = 0) -> Tensor:
    """Labels (uint8, indices into :func:`label_names`) of the broadcast cells ``(q_idx, kv_idx)`` of one batch
    row and head (what the versioned layout's per-row liveness reads, :mod:`masks.versioned`).

    q_idx ``[Q, 1]`` (or ``[Q]`` with kv_idx ``[KV]`` for one row each), kv_idx ``[1, KV]``;
    bias ``[KV_total]`` of that batch row and head, or None. Work is ``O(cells x regions)``: small views only.
    """
    check_batch_head(program, batch, head)
    names = label_names(program)
    shape = torch.broadcast_shapes(q_idx.shape, kv_idx.shape)
    out = torch.zeros(shape, dtype=torch.uint8, device=q_idx.device)
    free = torch.ones(shape, dtype=torch.bool, device=q_idx.device)
    b, h = (torch.tensor(i, device=q_idx.device) for i in (batch, head))
    for k, name in enumerate(names[1:], start=1):
        for region, p in zip(program.regions, program.params):
            if region.name != name:
                continue
            hit = region.contains(p, q_idx, kv_idx, b, h) & free
            out[hit] = k
            free &= ~hit
    if bias is not None:
        dead = torch.isneginf(bias[kv_idx.long()]).expand(shape)
        out[dead] = 0
    return out
