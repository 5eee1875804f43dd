"""Matplotlib figures of the token and block views (written as PNG or SVG).

Figures are built with ``matplotlib.figure.Figure`` (no pyplot, no global backend).
The main image of each figure is exactly the RGB array of :func:`token_rgb` /
:func:`block_rgb` — one pixel per cell up to ``MAX_PIXELS`` per side, beyond that one
pixel per tile of cells pooled by priority (:mod:`masks.viz.pool`), so a thin visible
band of a 64k-token view is not lost to image resampling.
"""
from __future__ import annotations

import numpy as np
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .block_view import BLOCK_COLORS, BLOCK_NAMES, BlockView
from .labels import MASKED, PALETTE, label_styles
from .pool import BLOCK_PRIORITY, pool_labels, token_priority
from .token_view import TokenView


MAX_PIXELS = 1000


def _rgb_table(names) -> np.ndarray:
    styles = label_styles(names)
    return (np.array([to_rgb(styles[n][1]) for n in names]) * 255).round().astype(np.uint8)


def token_rgb(view: TokenView, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """``[Q, KV, 3]`` uint8 (pooled beyond ``max_pixels`` per side): the colour of each cell's label."""
    labels = pool_labels(view.labels, max_pixels, max_pixels, token_priority(len(view.names)))
    return _rgb_table(view.names)[labels.numpy()]


def block_rgb(view: BlockView, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """``[n_q_blocks, n_kv_blocks, 3]`` uint8 (pooled beyond ``max_pixels`` per side)."""
    table = (np.array([to_rgb(BLOCK_COLORS[n]) for n in BLOCK_NAMES]) * 255).round().astype(np.uint8)
    return table[pool_labels(view.grid, max_pixels, max_pixels, BLOCK_PRIORITY).numpy()]


def _size(rows: int, cols: int, width: float = 10.0) -> tuple[float, float]:
    return width, float(np.clip(width * rows / max(cols, 1), 2.5, 12.0))


def token_figure(view: TokenView, title: str = "") -> Figure:
    """Token view: the bias of each kv row on top (if any), cells coloured by region below,
    a dashed line where the state rows end and the token rows begin."""
    q0, q1 = view.q_range
    k0, k1 = view.kv_range
    w, h = _size(q1 - q0, k1 - k0)
    fig = Figure(figsize=(w, h + (1.2 if view.bias is not None else 0.6)), layout="constrained")
    extent = (k0 - 0.5, k1 - 0.5, q1 - 0.5, q0 - 0.5)
    if view.bias is not None:
        top, ax = fig.subplots(2, 1, sharex=True, height_ratios=[1, max(4, 8 * h / w)])
        b = view.bias.numpy()
        masked = np.ma.masked_invalid(b[None, :])
        cmap = __import__("matplotlib").colormaps["viridis"].with_extremes(bad=PALETTE[MASKED])
        im = top.imshow(masked, aspect="auto", interpolation="nearest", cmap=cmap,
                        extent=(k0 - 0.5, k1 - 0.5, 0.5, -0.5))
        top.set_yticks([])
        top.set_title("bias per kv row (-inf: background)", fontsize=8, loc="left")
        fig.colorbar(im, ax=top, location="right", fraction=0.02, pad=0.01)
    else:
        ax = fig.subplots()
    ax.imshow(token_rgb(view), aspect="auto", interpolation="nearest", extent=extent)
    if k0 < view.n_state < k1:
        ax.axvline(view.n_state - 0.5, color="k", lw=0.8, ls="--")
    ax.set_xlabel(f"kv row (state rows 0..{view.n_state - 1}, then token j at row {view.n_state} + j)"
                  if view.n_state else "kv row (token)")
    ax.set_ylabel("query")
    counts = view.counts()
    styles = label_styles(view.names)
    ax.legend(handles=[Patch(color=styles[n][1], label=f"{n} ({counts[n]:,})") for n in view.names],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def block_figure(view: BlockView, title: str = "") -> Figure:
    """Block view: one cell per (query block, kv block): full / partial / empty."""
    g = view.geom
    w, h = _size(g.n_q_blocks, g.n_kv_blocks)
    fig = Figure(figsize=(w, h + 0.6), layout="constrained")
    ax = fig.subplots()
    ax.imshow(block_rgb(view), aspect="auto", interpolation="nearest",
              extent=(-0.5, g.n_kv_blocks - 0.5, g.n_q_blocks - 0.5, -0.5))
    if g.n_state:
        ax.axvline(g.n_state // g.block_kv - 0.5, color="k", lw=0.8, ls="--")
    ax.set_xlabel(f"kv block ({g.block_kv} rows; state blocks 0..{g.n_state // g.block_kv - 1})"
                  if g.n_state else f"kv block ({g.block_kv} rows)")
    ax.set_ylabel(f"query block ({g.block_q} queries)")
    counts = view.counts()
    ax.legend(handles=[Patch(color=BLOCK_COLORS[n], label=f"{n} ({counts[n]:,})") for n in BLOCK_NAMES],
              loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
