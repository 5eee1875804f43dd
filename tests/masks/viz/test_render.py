"""render(): the files it writes are what they claim to be, and say what the program holds."""
import html
import json
import xml.etree.ElementTree as ET

import matplotlib.image as mpimg
import pytest
import torch

from masks.viz import VizOptions, program_stats, render, token_view

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
                                           (dict(term_width=0), "term_width must be >= 1, got 0")],
                         ids=["view", "no-format", "query", "term-height", "term-width"])
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VizOptions(**kwargs)


@pytest.mark.parametrize("query", [80, 99], ids=["q_len", "past-q_len"])
def test_query_past_the_end_is_refused(query):
    with pytest.raises(ValueError, match=f"queries must be < q_len=80, got {query}"):
        render(make_program("swa"), VizOptions(formats=("term",), queries=(query,)))
