"""The drawn block view against dense tiles (small T) and closed-form counts (T = 65,536)."""
import numpy as np
import torch
from matplotlib.colors import to_rgb

from masks.program import build_program
from masks.regions import Causal
from masks.viz import block_view
from masks.viz.block_view import BLOCK_COLORS
from masks.viz.figures import block_figure
from masks.viz.terminal import block_text


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
