"""The per-query inspector lists exactly the rows the query sees, with their bias and temperature."""
import pytest
import torch

from masks.viz import inspect_query, segment_rows
from masks.viz.inspect_query import Segment, _describe

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


def test_a_batch_row_is_inspected_with_its_own_state_bias():
    """Batch rows share the regions but not the state's counts: in row 1 the first 8 rows of each bank are
    empty (bias -inf, masked), in row 0 every row holds 2 tokens (bias ln 2)."""
    from masks.program import build_program
    from masks.regions import OwnChunk, StateBank

    g = torch.Generator().manual_seed(2)
    B, H, T, chunk, rows = 2, 1, 64, 32, 16
    q, k, v = (torch.randn(B, H, T, 8, generator=g) for _ in range(3))
    counts = torch.full((B, H, 2, rows), 2.0)
    counts[1, :, :, :8] = 0
    bias = torch.where(counts > 0, counts.log(), float("-inf")).flatten(2)
    sk, sv = (torch.randn(B, H, 2 * rows, 8, generator=g) for _ in range(2))
    program = build_program(q, k, v, (StateBank(rows, chunk, torch.tensor([0, rows])), OwnChunk(chunk)), scale=1.0,
                            state_k=sk, state_v=sv, state_bias=bias, block_size=16)
    runs = {b: [(s.region, s.lo, s.hi, s.bias_min, s.bias_max) for s in inspect_query(program, 40, batch=b)]
            for b in (0, 1)}  # query 40: chunk 1, reading bank 1 (state rows 16..31) and tokens 32..40
    ln2 = pytest.approx(0.6931, abs=1e-4)
    assert runs[0] == [("state", 16, 32, ln2, ln2), ("window", 64, 73, 0.0, 0.0)]
    assert runs[1] == [("state", 24, 32, ln2, ln2), ("window", 64, 73, 0.0, 0.0)]


def test_query_and_segment_table_formats():
    with pytest.raises(ValueError, match="query must be >= 0, got -1"):
        inspect_query(make_program("causal"), -1)
    seg = Segment("state", 16, 32, "state rows 16..31", -1.23456, 2.5, 3.0, 1.5)
    assert segment_rows([seg]) == [{"region": "state", "kv rows": "16..31", "n": 16, "what": "state rows 16..31",
                                    "bias min": "-1.235", "bias max": "2.500", "temperature": "3",
                                    "logit scale": "1.5"}]
    assert segment_rows([Segment("window", 0, 4, "tokens 0..3", None, None, 1.0, 0.125)])[0]["bias min"] == "-"


def test_a_batch_row_reads_as_the_program_of_that_row_alone():
    """OVQ's versioned layout: which state rows are live depends on the row's routes, so the regions differ by
    batch row (row 1's keys nearly one, as ``make_program("versioned")``'s head 1)."""
    from ovqflex.ops.ovq import ovq_program

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 1, 128, 8, generator=g) for _ in range(3))
    k[1] = k[1, :, :1] + 0.01 * k[1]

    def program(rows):
        return ovq_program(q[rows], k[rows], v[rows], torch.ones(1), chunk_size=16, max_centroids=64,
                           state_layout="versioned", block_size=16)[0]

    both = program(slice(0, 2))
    for i in (40, 100, 127):
        got = [inspect_query(both, i, batch=b) for b in (0, 1)]
        assert got == [inspect_query(program(slice(b, b + 1)), i) for b in (0, 1)], i
    assert got[0] != got[1]
