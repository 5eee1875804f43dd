"""The drawn token view: per-cell colours, legend and terminal characters equal the dense truth."""
import numpy as np
import pytest
import torch
from matplotlib.colors import to_rgb

from masks.program import build_program
from masks.regions import Causal, Sinks, TokenWindow
from masks.viz import PALETTE, token_view
from masks.viz.figures import token_figure
from masks.viz.labels import CHARS, label_styles
from masks.viz.terminal import token_text

from tests.masks.viz.viz_cases import dense_truth, make_program


def _counts(names, labels):
    return {n: int((labels == k).sum()) for k, n in enumerate(names)}


@pytest.mark.parametrize("head", [0, 1], ids=["head0", "head1"])
def test_view_labels_equal_dense_regions(program, head):
    """Each head's view (the versioned layout's rows live per head: its views had drawn head 0's liveness for
    every head)."""
    names, truth = dense_truth(program, head)
    view = token_view(program, head=head)
    assert view.names == tuple(names)
    assert torch.equal(view.labels.long(), truth)
    assert view.counts() == _counts(names, truth)


def test_the_versioned_case_has_heads_that_differ():
    """(What makes the head parametrization above a test of the head: the two heads' views differ.)"""
    program = make_program("versioned")
    assert not torch.equal(dense_truth(program, 0)[1], dense_truth(program, 1)[1])


def test_figure_pixels_are_the_region_colours(program):
    """The figure's main image has one pixel per cell, coloured by the cell's region."""
    names, truth = dense_truth(program)
    fig = token_figure(token_view(program))
    images = [im for ax in fig.axes for im in ax.get_images() if np.asarray(im.get_array()).ndim == 3]
    assert len(images) == 1
    drawn = np.asarray(images[0].get_array())
    assert drawn.shape[:2] == tuple(truth.shape)
    palette = {n: tuple(round(255 * c) for c in to_rgb(PALETTE[n])) for n in names}
    for k, n in enumerate(names):
        is_colour = (drawn == np.array(palette[n], dtype=drawn.dtype)).all(-1)
        assert is_colour.sum() == int((truth == k).sum()), n
    legend = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert legend == [f"{n} ({int((truth == k).sum()):,})" for k, n in enumerate(names)]


def test_a_views_bias_is_that_of_its_kv_rows():
    program = make_program("bank")
    view = token_view(program, head=1, q_range=(40, 60), kv_range=(10, 50))
    assert view.labels.shape == (20, 40) and torch.equal(view.bias, program.bias[0, 1, 10:50].float())


def test_bias_strip_shows_the_row_bias():
    program = make_program("bank")
    view = token_view(program, head=1)
    fig = token_figure(view)
    strips = [np.ma.asarray(im.get_array()) for ax in fig.axes for im in ax.get_images()
              if np.asarray(im.get_array()).ndim == 2]
    assert len(strips) == 1
    expected = program.bias[0, 1, : view.kv_range[1]].numpy()
    finite = np.isfinite(expected)
    assert np.array_equal(strips[0].mask[0], ~finite)
    assert np.allclose(strips[0].data[0][finite], expected[finite])


def test_terminal_characters_count_the_cells(program):
    names, truth = dense_truth(program)
    text = token_text(token_view(program), width=10_000, height=10_000)
    legend, *rows = text.splitlines()
    assert len(rows) == truth.shape[0] and all(len(r) == truth.shape[1] for r in rows)
    drawn = "".join(rows)
    for k, n in enumerate(names):
        assert drawn.count(CHARS[n]) == int((truth == k).sum()), n
        assert f"{CHARS[n]}={n} ({int((truth == k).sum()):,})" in legend


def test_pooled_terminal_keeps_a_lone_visible_cell():
    """A tile shows its highest-priority label: one sink cell in a tile of masked cells shows."""
    program = make_program("sinks", T=160)
    text = token_text(token_view(program, q_range=(150, 160)), width=16, height=4)
    rows = text.splitlines()[1:]
    assert len(rows) <= 4 and all(len(r) <= 16 for r in rows)
    assert all(r[0] == "S" for r in rows)  # the 3 sink columns pool into the first tile column


def test_pooled_tiles_past_the_edge_show_only_the_cells_they_cover():
    """5 x 5 cells into at most 2 x 2 tiles of 3 x 3: the edge tiles hold 2 cells of the grid per side
    and pad the rest, which shows nothing (not a visible label)."""
    from masks.viz.pool import pool_labels, token_priority

    labels = torch.zeros(5, 5, dtype=torch.int8)
    labels[4, 1] = 2
    pooled = pool_labels(labels, 2, 2, token_priority(3))
    assert pooled.tolist() == [[0, 0], [2, 0]] and pooled.dtype == labels.dtype


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_cells=100), "max_cells=100"),
    (dict(q_range=(5, 5)), "q_range"),
    (dict(kv_range=(0, 10**6)), "kv_range"),
    (dict(q_range=(0.5, 10)), r"q_range must be \(start, stop\) with 0 <= start < stop <= 80, got \(0.5, 10\)"),
    (dict(head=7), "head must be < H=2, got 7"),
    (dict(head=2), "head must be < H=2, got 2"),
    (dict(batch=1), "batch must be < B=1, got 1"),
    (dict(batch=-1), "batch must be >= 0"),
], ids=["too-big", "empty-q-range", "kv-range", "float-q-range", "head", "head-H", "batch-B", "batch"])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        token_view(make_program("causal"), **kwargs)


def test_max_cells_is_the_most_cells_drawn():
    """80 queries x 80 token rows: 6,400 cells are drawn at max_cells=6,400 and refused at 6,399."""
    assert token_view(make_program("causal"), max_cells=6400).labels.numel() == 6400
    with pytest.raises(ValueError, match="= 6400 cells exceeds max_cells=6399"):
        token_view(make_program("causal"), max_cells=6399)


def test_coloured_terminal_cells_carry_their_regions_rgb():
    """With colours each character is wrapped in a 24-bit ANSI foreground of its region's palette colour."""
    program = make_program("sinks")
    view = token_view(program, q_range=(10, 11), kv_range=(0, 11))  # sinks 0..2, window tokens 3..10 (12 wide)
    line = token_text(view, width=1000, height=1000, color_output=True).splitlines()[1]
    rgb = {n: ";".join(str(round(255 * c)) for c in to_rgb(PALETTE[n])) for n in ("sink", "window")}
    cell = "\x1b[38;2;{}m{}\x1b[0m"
    assert line == cell.format(rgb["sink"], "S") * 3 + cell.format(rgb["window"], "w") * 8


class _Chunk(TokenWindow):
    name = "chunk"


class _Carry(Causal):
    name = "carry"


def test_new_region_names_get_a_glyph_and_a_colour_of_their_own():
    """A new method's region names (here "chunk" and "carry", which had both been drawn "c") each get a glyph and
    a colour no other label of the view has, in the terminal view, its legend and the figure."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 40, 8, generator=g) for _ in range(3))
    program = build_program(q, k, v, (Sinks(2), _Chunk(6), _Carry()), scale=0.5, block_size=16)
    view = token_view(program)
    assert view.names == ("masked", "sink", "chunk", "carry")  # the known names first, then program order
    styles = label_styles(view.names)
    assert [styles[n][0] for n in view.names] == [".", "S", "c", "C"]
    assert len({colour for _, colour in styles.values()}) == 4
    legend, *rows = token_text(view, width=1000, height=1000).splitlines()
    counts = view.counts()
    for n in view.names:
        assert "".join(rows).count(styles[n][0]) == counts[n] > 0, n
        assert f"{styles[n][0]}={n} ({counts[n]:,})" in legend
    drawn = np.asarray([im for ax in token_figure(view).axes for im in ax.get_images()][0].get_array())
    for n in view.names:
        rgb = np.array([round(255 * c) for c in to_rgb(styles[n][1])], dtype=drawn.dtype)
        assert (drawn == rgb).all(-1).sum() == counts[n], n
