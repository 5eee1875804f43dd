"""Terminal rendering: one character per cell, or per tile of cells when the view is
larger than ``height x width`` (:mod:`masks.viz.pool`: a tile shows its highest-priority
label, so a visible cell is never hidden by masked neighbours). ANSI colours optional."""
from __future__ import annotations

from torch import Tensor

from .block_view import BLOCK_CHARS, BLOCK_COLORS, BLOCK_NAMES, BlockView
from .labels import label_styles
from .pool import BLOCK_PRIORITY, pool_labels, token_priority
from .token_view import TokenView


def _ansi(hex_color: str, text: str) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return f"\x1b[38;2;{r};{g};{b}m{text}\x1b[0m"


def _lines(grid: Tensor, names, glyph, hue, use_color: bool) -> list[str]:
    out = []
    for row in grid.tolist():
        cells = [glyph(names[v]) for v in row]
        if use_color:
            cells = [_ansi(hue(names[v]), c) for v, c in zip(row, cells)]
        out.append("".join(cells))
    return out


def token_text(view: TokenView, *, width: int = 120, height: int = 60, color_output: bool = False) -> str:
    """Token view as text; a legend line with the exact cell counts comes first."""
    grid = pool_labels(view.labels, height, width, token_priority(len(view.names)))
    counts, styles = view.counts(), label_styles(view.names)
    legend = "  ".join(f"{styles[nm][0]}={nm} ({counts[nm]:,})" for nm in view.names)
    lines = _lines(grid, view.names, lambda nm: styles[nm][0], lambda nm: styles[nm][1], color_output)
    return "\n".join([legend, *lines])


def block_text(view: BlockView, *, width: int = 120, height: int = 60, color_output: bool = False) -> str:
    """Block view as text: █ full, ▒ partial, blank empty."""
    grid = pool_labels(view.grid, height, width, BLOCK_PRIORITY)
    counts = view.counts()
    legend = "  ".join(f"{BLOCK_CHARS[nm]!r}={nm} ({counts[nm]:,})" for nm in BLOCK_NAMES)
    lines = _lines(grid, BLOCK_NAMES, BLOCK_CHARS.__getitem__, BLOCK_COLORS.__getitem__, color_output)
    return "\n".join([legend, *["|" + ln + "|" for ln in lines]])
