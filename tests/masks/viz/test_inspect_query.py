"""The per-query inspector lists exactly the rows the query sees, with their bias and temperature."""
import pytest
import torch

from masks.viz import inspect_query, segment_rows
from masks.viz.inspect_query import _describe

from tests.masks.viz.viz_cases import dense_truth, make_program


@pytest.mark.parametrize("i", [0, 33, 79], ids=lambda i: f"q{i}")
def test_segments_cover_the_dense_row(program, i):
    names, truth = dense_truth(program, head=1)
    temps = {"state": torch.tensor([2.0, 3.0]), "window": 0.5}
    segs = inspect_query(program, i, head=1, temperatures=temps)
    drawn = torch.zeros(truth.shape[1], dtype=torch.long)
    for s in segs:
        assert s.lo < s.hi <= truth.shape[1]
        drawn[s.lo:s.hi] = names.index(s.region)
        expected_t = {"state": 3.0, "window": 0.5}.get(s.region, 1.0)
        assert s.temperature == expected_t and s.logit_scale == expected_t * program.scale
        if program.bias is not None:
            b = program.bias[0, 1, s.lo:s.hi]
            assert s.bias_min == pytest.approx(float(b.min())) and s.bias_max == pytest.approx(float(b.max()))
    assert torch.equal(drawn, truth[i])
    assert [r["n"] for r in segment_rows(segs)] == [s.hi - s.lo for s in segs]


def test_token_rows_are_named_by_token_index():
    program = make_program("bank", T=96)
    segs = inspect_query(program, 70)  # chunk 2 (of 32 tokens) reads bank 2: rows 48..71, 20 live
    assert [(s.region, s.what) for s in segs] == [("state", "state rows 48..67"), ("window", "tokens 64..70")]


def test_a_run_of_state_and_token_rows_names_both():
    """(No built-in region labels state and token rows alike, so a run spans them only in a new method's
    program.)"""
    assert _describe(5, 20, 16) == "state rows 5..15 + tokens 0..3"
    assert _describe(5, 16, 16) == "state rows 5..15" and _describe(16, 20, 16) == "tokens 0..3"


def test_query_out_of_range():
    with pytest.raises(ValueError, match="query must be < q_len=80, got 80"):
        inspect_query(make_program("causal"), 80)
