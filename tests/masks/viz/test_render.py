"""render(): the files it writes are what they claim to be, and say what the program holds."""
import html
import json
import xml.etree.ElementTree as ET

import matplotlib.image as mpimg
import pytest
import torch

from masks.viz import VizOptions, inspect_query, program_stats, render, segment_rows, token_view
from masks.viz.html import html_page
from ovqflex.ops.ovq import ovq_program

from tests.masks.viz.viz_cases import dense_truth, make_program


def test_writes_png_svg_html_json_and_terminal(tmp_path):
    program = make_program("bank")
    opts = VizOptions(formats=("png", "svg", "html", "term"), queries=(40,), title="bank test", chunk=32)
    res = render(program, opts, tmp_path, stem="bank")
    names = sorted(p.name for p in res.files)
    assert names == ["bank-block.png", "bank-block.svg", "bank-stats.json", "bank-token.png", "bank-token.svg",
                     "bank.html"]
    for png in ("bank-token.png", "bank-block.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert mpimg.imread(tmp_path / png).ndim == 3
    for svg in ("bank-token.svg", "bank-block.svg"):
        assert ET.parse(tmp_path / svg).getroot().tag.endswith("svg")
    page = (tmp_path / "bank.html").read_text()
    counts = token_view(program).counts()
    for name, n in counts.items():
        assert f"<td>{name}</td><td>{n:,}</td>" in page
    assert page.count("<svg") == 2 and "Query 40" in page
    assert "src=" not in page and "<link" not in page and "<script" not in page  # self-contained
    stats = json.loads((tmp_path / "bank-stats.json").read_text())
    assert stats["visible_pairs"] == program_stats(program).visible_pairs
    assert stats["state_rows_per_chunk"] == [0, 12, 24]
    assert res.text.startswith("bank test") and "block view" in res.text


def test_the_drawn_head_is_the_one_asked_for():
    """``render`` (what ``ovqflex viz --head`` runs) draws the head it is given, the versioned layout's per-head
    liveness included."""
    program = make_program("versioned")
    res = render(program, VizOptions(formats=("term",), head=1))
    assert torch.equal(res.token.labels.long(), dense_truth(program, 1)[1])
    assert not torch.equal(res.token.labels.long(), dense_truth(program, 0)[1])


def test_token_view_skipped_when_too_large(tmp_path):
    res = render(make_program("causal"), VizOptions(formats=("term",), max_token_cells=100), None)
    assert res.token is None and res.block is not None and res.files == []
    assert "token view skipped" in res.notes[0] and res.notes[0] in res.text
    render(make_program("causal"), VizOptions(formats=("html",), max_token_cells=100), tmp_path, stem="causal")
    assert html.escape(res.notes[0]) in (tmp_path / "causal.html").read_text()  # why the page has no token view


@pytest.mark.parametrize("kwargs, match", [(dict(views=("pixels",)), "views must be"),
                                           (dict(formats=()), "formats must be"),
                                           (dict(queries=(-1,)), "queries must be >= 0"),
                                           (dict(term_height=0), "term_height must be >= 1, got 0"),
                                           (dict(term_width=0), "term_width must be >= 1, got 0"),
                                           (dict(max_token_cells=0), "max_token_cells must be >= 1, got 0")],
                         ids=["view", "no-format", "query", "term-height", "term-width", "max-cells"])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VizOptions(**kwargs)


@pytest.mark.parametrize("query", [80, 99], ids=["q_len", "past-q_len"])
def test_query_past_the_end_is_refused(query):
    with pytest.raises(ValueError, match=f"queries must be < q_len=80, got {query}"):
        render(make_program("swa"), VizOptions(formats=("term",), queries=(query,)))


def _routed_program():
    """OVQ's versioned program over B = 2, 2 heads, 128 tokens, whose batch row 1, head 1 routes otherwise
    than the other three (its keys nearly one): each (row, head) has its own token view and query tables."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 128, 8, generator=g) for _ in range(3))
    k[1, 1] = k[1, 1, :1] + 0.01 * k[1, 1]
    return ovq_program(q, k, v, torch.ones(2), chunk_size=16, max_centroids=64, state_layout="versioned",
                       block_size=16)[0]


def _html_row(row: dict) -> str:
    return "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row.values()) + "</tr>"


def test_the_page_draws_the_row_head_and_temperatures_asked_for_with_the_options(tmp_path):
    """``batch``, ``head`` and ``temperatures`` reach the token view and the query tables (returned and on the
    page); ``meta`` the page's
    program table and the stats file; the legend lists the regions' and the blocks' counts; the title is
    escaped, the figures are inline SVG without an XML prolog; only the formats asked for are written."""
    program = _routed_program()
    temps = {"state": 2.0}
    opts = VizOptions(formats=("svg", "html"), batch=1, head=1, queries=(100, 120), temperatures=temps,
                      meta={"method": "ovq", "T": 128}, title="ovq <versioned> & co")
    res = render(program, opts, tmp_path, stem="p")
    assert sorted(p.name for p in res.files) == ["p-block.svg", "p-stats.json", "p-token.svg", "p.html"]
    assert torch.equal(res.token.labels, token_view(program, batch=1, head=1).labels)
    page = (tmp_path / "p.html").read_text()
    assert [q for q, _ in res.inspections] == [100, 120]
    for q, rows in res.inspections:
        assert rows == segment_rows(inspect_query(program, q, batch=1, head=1, temperatures=temps))
        assert all(_html_row(r) in page for r in rows), q
        for other in (dict(batch=0, head=1, temperatures=temps), dict(batch=1, head=0, temperatures=temps),
                      dict(batch=1, head=1)):
            assert not all(_html_row(r) in page for r in segment_rows(inspect_query(program, q, **other))), other
    assert "<tr><td>method</td><td>ovq</td></tr><tr><td>T</td><td>128</td></tr>" in page
    assert json.loads((tmp_path / "p-stats.json").read_text())["meta"] == {"method": "ovq", "T": "128"}
    assert "<th>colour</th><th>region</th><th>cells drawn</th>" in page
    for name, n in {**res.token.counts(), **{f"{k} block": n for k, n in res.block.counts().items()}}.items():
        assert f"<td>{name}</td><td>{n:,}</td>" in page, name
    assert "<title>ovq &lt;versioned&gt; &amp; co</title>" in page and "<h1>ovq &lt;versioned&gt; &amp; co</h1>" in page
    assert page.count("<svg") == 2 and "<?xml" not in page
    render(program, VizOptions(formats=("png",)), tmp_path / "png", stem="p")
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == ["p-block.png", "p-stats.json", "p-token.png"]


def test_a_query_that_sees_no_rows_says_so():
    page = html_page("t", meta=[], legend=[], stats=[], figures=[], inspections=[(5, [])])
    assert "<h2>Query 5</h2>\n<p>sees no rows</p>" in page


def test_the_token_view_is_drawn_up_to_max_token_cells_state_rows_included():
    """The token view has ``q_len * (n_state + q_len)`` cells (320 state rows here): drawn at exactly
    ``max_token_cells``, skipped one below."""
    program = _routed_program()
    cells = 128 * (320 + 128)
    assert program.geom.n_state == 320
    assert render(program, VizOptions(formats=("term",), max_token_cells=cells)).token is not None
    res = render(program, VizOptions(formats=("term",), max_token_cells=cells - 1))
    assert res.token is None and res.notes == [f"token view skipped: {cells:,} cells > max_token_cells={cells - 1:,}"]


def test_the_terminal_text_has_the_size_and_colours_asked_for():
    program = make_program("causal")
    plain = render(program, VizOptions(formats=("term",), views=("token",), term_width=40, term_height=10)).text
    lines = plain.splitlines()
    assert lines[1] == "token view (rows: queries, columns: kv rows)" and len(lines) == 3 + 10
    assert max(len(line) for line in lines[3:]) == 40 and "\x1b[" not in plain
    coloured = render(program, VizOptions(formats=("term",), views=("token",), term_height=10, color=True)).text
    assert coloured.count("\x1b[38;2;") > 10 and len(coloured.splitlines()) == len(lines)
