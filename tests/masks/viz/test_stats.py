"""Statistics from interval bounds equal dense counts."""
import torch
from hypothesis import given
from hypothesis import strategies as st

from masks.versioned import CheckpointBank
from masks.viz import program_stats, token_view, visible_per_query

from tests.masks.viz.viz_cases import dense_truth, make_program


def _dense_visible(program):
    """The cells some region admits, densely; a region with a per-row predicate (the versioned layout's
    liveness) over its whole interval, as the statistics count it (an upper bound of what its queries see)."""
    g = program.geom
    q = torch.arange(g.q_len)[:, None]
    kv = torch.arange(g.kv_len)[None, :]
    m = torch.zeros(g.q_len, g.kv_len, dtype=torch.bool)
    state = torch.zeros_like(m)
    for r, p in zip(program.regions, program.params):
        lo, hi = r.bounds(p, q)
        hit = (r.contains(p, q, kv) if r.exact else (kv >= lo) & (kv < hi)).expand_as(m)
        m |= hit
        if r.name == "state":
            state |= hit
    return m, state


def test_visible_keys_per_query(program):
    m, state = _dense_visible(program)
    assert torch.equal(visible_per_query(program), m.sum(1))
    s = program_stats(program, chunk=16)
    assert s.visible_pairs == int(m.sum())
    assert (s.keys_per_query_min, s.keys_per_query_max) == (int(m.sum(1).min()), int(m.sum(1).max()))
    assert abs(s.keys_per_query_mean - m.sum(1).double().mean().item()) < 1e-9
    assert abs(s.sparsity - (1 - m.sum().item() / m.numel())) < 1e-12
    T = program.geom.q_len
    assert abs(s.density_vs_causal - m.sum().item() / (T * (T + 1) / 2)) < 1e-12
    assert s.state_rows_per_chunk == state.sum(1)[::16].tolist()
    g = program.geom
    assert s.kv_bytes == 2 * program.k.shape[0] * program.k.shape[1] * g.kv_len * 8 * 4
    versioned = any(isinstance(r, CheckpointBank) for r in program.regions)
    assert s.upper_bound == versioned
    assert ("live or not" in dict(s.summary())["visible (query, row) pairs"]) == versioned


def test_full_causal_density_is_one_and_kv_bytes_count_k_and_v_at_their_widths():
    from masks.program import build_program
    from masks.regions import Causal

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 40, 8, generator=g) for _ in range(2))
    program = build_program(q, k, torch.randn(1, 2, 40, 4, generator=g), (Causal(),), scale=1.0, block_size=16)
    s = program_stats(program)
    rows = 1 * 2 * program.geom.kv_len
    assert s.density_vs_causal == 1.0 and s.kv_bytes == rows * 8 * 4 + rows * 4 * 4


def test_state_rows_per_chunk_of_the_bank():
    """Bank of chunk c holds min(12 c, 24) rows (viz_cases), read by the 32 queries of chunk c."""
    s = program_stats(make_program("bank", T=128), chunk=32)
    assert s.state_rows_per_chunk == [0, 12, 24, 24]


def test_token_view_visible_cells_match_stats_when_no_row_is_empty():
    program = make_program("sinks")
    names, truth = dense_truth(program)
    assert int((token_view(program).labels > 0).sum()) == program_stats(program).visible_pairs == int((truth > 0).sum())


@given(st.lists(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=5), min_size=1,
                max_size=6))
def test_union_length_counts_each_covered_row_once(queries):
    """Per query, the length of the union of its intervals ``[lo, hi)`` (any order, overlapping, nested or
    empty) is the number of rows some interval covers (a program may list its regions in any order)."""
    from masks.viz.stats import _union_length

    n = max(len(q) for q in queries)
    padded = [q + [(0, 0)] * (n - len(q)) for q in queries]  # empty intervals: cover nothing
    intervals = [(torch.tensor([q[j][0] for q in padded]), torch.tensor([q[j][1] for q in padded])) for j in range(n)]
    want = [len({r for lo, hi in q for r in range(lo, hi)}) for q in queries]
    assert _union_length(intervals).tolist() == want
