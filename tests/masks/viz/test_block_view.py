"""The drawn block view against dense tiles (small T) and closed-form counts (T = 65,536); both figures' marks."""
import numpy as np
import torch
from matplotlib.colors import to_rgb

from masks.program import build_program
from masks.regions import Causal
from masks.viz import block_view, token_view
from masks.viz.block_view import BLOCK_COLORS, BLOCK_NAMES
from masks.viz.figures import block_figure, token_figure
from masks.viz.terminal import block_text
from tests.masks.viz.viz_cases import make_program


def _dense_tiles(program):
    g = program.geom
    q = torch.arange(g.q_pad)[:, None]
    kv = torch.arange(g.kv_len)[None, :]
    m = torch.zeros(g.q_pad, g.kv_len, dtype=torch.bool)
    for r, p in zip(program.regions, program.params):
        m |= r.contains(p, q, kv)
    t = m.view(g.n_q_blocks, g.block_q, g.n_kv_blocks, g.block_kv)
    return t.any(3).any(1), t.all(3).all(1)


def test_grid_agrees_with_dense_tiles(program):
    some, every = _dense_tiles(program)
    grid = block_view(program).grid
    assert grid.shape == some.shape
    assert bool((grid[some] >= 1).all()), "a block with a visible cell is drawn empty"
    assert bool((grid == 2)[~every].logical_not().all()), "a block drawn full has an invisible cell"
    assert bool((grid[~some] != 2).all())


def test_figure_pixels_are_the_block_states(program):
    grid = block_view(program).grid.numpy()
    fig = block_figure(block_view(program))
    (im,) = [im for ax in fig.axes for im in ax.get_images()]
    drawn = np.asarray(im.get_array())
    assert drawn.shape[:2] == grid.shape
    for k, name in enumerate(("empty", "partial", "full")):
        rgb = np.array([round(255 * c) for c in to_rgb(BLOCK_COLORS[name])], dtype=drawn.dtype)
        assert (drawn == rgb).all(-1).sum() == (grid == k).sum(), name


def test_causal_64k_block_view_has_closed_form_counts():
    """T = 65,536 causal, 128-blocks: 512 diagonal partial blocks, 512*511/2 full ones —
    built from the block lists (a dense mask would be 4 G cells)."""
    T, B = 65536, 128
    x = torch.zeros(1, 1, T, 1)
    program = build_program(x, x, x, (Causal(),), scale=1.0, block_size=B)
    view = block_view(program)
    n = T // B
    assert view.counts() == {"empty": n * n - n * (n + 1) // 2, "partial": n, "full": n * (n - 1) // 2}
    assert view.grid.dtype == torch.uint8 and view.grid.shape == (n, n)
    text = block_text(view, width=64, height=32)
    rows = text.splitlines()[1:]
    assert len(rows) == 32 and rows[-1].count("█") == 64  # last tile row: every kv tile holds a full block
    assert all(len(r) == 66 and r[0] == r[-1] == "|" for r in rows)  # 64 tiles between two borders


def test_the_figures_mark_where_the_state_ends_and_carry_their_title():
    """Both figures: a dashed line between the state's last kv row (block) and the first token's, the axis label
    naming the state's rows (blocks), the title given; the block figure's legend counts its blocks. A program
    without state has no line, and no title when given none."""
    program = make_program("bank")
    g, tv, bv = program.geom, token_view(program), block_view(program)
    token_fig, block_fig = token_figure(tv, "bank T=80"), block_figure(bv, "bank T=80")
    for fig, x in ((token_fig, tv.n_state - 0.5), (block_fig, g.n_state // g.block_kv - 0.5)):
        (line,) = [ln for ax in fig.axes for ln in ax.get_lines()]
        assert list(line.get_xdata()) == [x, x] and line.get_linestyle() == "--"
        assert fig._suptitle.get_text() == "bank T=80"
    labels = [ax.get_xlabel() for fig in (token_fig, block_fig) for ax in fig.axes if ax.get_xlabel()]
    assert labels == [f"kv row (state rows 0..{tv.n_state - 1}, then token j at row {tv.n_state} + j)",
                      f"kv block (16 rows; state blocks 0..{g.n_state // 16 - 1})"]
    (legend,) = [ax.get_legend() for ax in block_fig.axes if ax.get_legend()]
    counts = bv.counts()
    assert [t.get_text() for t in legend.get_texts()] == [f"{n} ({counts[n]:,})" for n in BLOCK_NAMES]
    plain = make_program("causal")
    for fig in (token_figure(token_view(plain)), block_figure(block_view(plain))):
        assert not [ln for ax in fig.axes for ln in ax.get_lines()] and fig._suptitle is None
        assert [ax.get_xlabel() for ax in fig.axes] in (["kv row (token)"], ["kv block (16 rows)"])
