"""Analytic block lists against the dense truth on tiny shapes (docs/design.md §3.2)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from masks.blocks import build_block_layout
from masks.regions import BlockWindow, Causal, Geometry, Sinks, StateBank, TokenWindow, blocks_touched
from masks.versioned import CheckpointBank, VersionRows
from ovqflex.compile_watch import compile_counts
from ovqflex.ops.ovq import ovq_program


def dense_tiles(regions, params, geom):
    """[nQB, nKVB] any-visible and all-visible tiles from a dense evaluation of the union."""
    q = torch.arange(geom.q_pad)[:, None]
    kv = torch.arange(geom.kv_len)[None, :]
    m = torch.zeros(geom.q_pad, geom.kv_len, dtype=torch.bool)
    for r, p in zip(regions, params):
        m |= r.contains(p, q, kv)
    t = m.view(geom.n_q_blocks, geom.block_q, geom.n_kv_blocks, geom.block_kv)
    return t.any(3).any(1), t.all(3).all(1)


def listed(num, idx, geom):
    out = torch.zeros(geom.n_q_blocks, geom.n_kv_blocks, dtype=torch.bool)
    for row in range(geom.n_q_blocks):
        out[row, idx[row, : num[row]].long()] = True
        assert len(set(idx[row, : num[row]].tolist())) == int(num[row]), "duplicate block in a row"
        assert idx[row, : num[row]].tolist() == sorted(idx[row, : num[row]].tolist()), "row not ascending"
    return out


@st.composite
def programs(draw):
    block = draw(st.sampled_from([16, 32, 64]))
    T = draw(st.integers(1, 6 * block))
    chunk = draw(st.sampled_from([16, 32, 48, 64]))
    q_pad = -(-T // block) * block
    kind = draw(st.sampled_from(["causal", "window", "bswa", "bank"]))
    regions = []
    n_state = 0
    if draw(st.booleans()):
        regions.append(Sinks(draw(st.integers(1, 40))))
    if kind == "causal":
        regions.append(Causal())
    elif kind == "window":
        regions.append(TokenWindow(draw(st.integers(1, 3 * block))))
    elif kind == "bswa":
        regions.append(BlockWindow(draw(st.integers(1, 3)), chunk))
    else:
        rows = draw(st.integers(1, 40))
        n_banks = -(-q_pad // chunk)
        live = torch.tensor(draw(st.lists(st.integers(0, rows), min_size=n_banks, max_size=n_banks)))
        n_state = -(-n_banks * rows // block) * block
        regions += [StateBank(rows, chunk, live), BlockWindow(1, chunk)]
    geom = Geometry(T, q_pad, n_state, q_pad, block, block)
    return tuple(regions), geom


@given(programs())
def test_block_lists_cover_exactly_the_visible_tiles(prog):
    regions, geom = prog
    params = tuple(r.params(geom, torch.device("cpu")) for r in regions)
    lay = build_block_layout(regions, params, geom)
    any_vis, all_vis = dense_tiles(regions, params, geom)
    partial = listed(lay.kv_num, lay.kv_idx, geom)
    full = listed(lay.full_num, lay.full_idx, geom)
    assert not (partial & full).any(), "a tile is listed as both partial and full"
    # every visible tile is listed; a full tile really is fully visible
    assert ((partial | full) >= any_vis).all()
    assert (all_vis >= full).all()
    single_interval = len(regions) == 1 and not isinstance(regions[0], StateBank)
    if single_interval:  # one interval per query: the lists are exact
        assert torch.equal(partial | full, any_vis)
        assert torch.equal(full, all_vis)


@given(programs())
def test_q_side_is_the_transpose(prog):
    regions, geom = prog
    params = tuple(r.params(geom, torch.device("cpu")) for r in regions)
    lay = build_block_layout(regions, params, geom)
    bm = lay.block_mask(lambda b, h, q, kv: q >= 0, with_q_side=True)
    kv_dense = listed(lay.kv_num, lay.kv_idx, geom)
    full_dense = listed(lay.full_num, lay.full_idx, geom)
    for num, idx, want in (
        (bm.q_num_blocks[0, 0], bm.q_indices[0, 0], kv_dense.T),
        (bm.full_q_num_blocks[0, 0], bm.full_q_indices[0, 0], full_dense.T),
    ):
        got = torch.zeros_like(want)
        for row in range(want.shape[0]):
            got[row, idx[row, : num[row]].long()] = True
        assert torch.equal(got, want)
    assert bm.kv_indices.shape[-1] == geom.n_kv_blocks  # the CPU flex kernel needs full-width storage


@given(programs())
def test_entries_merge_both_lists_once_in_the_partial_width(prog):
    """What gathering backends read: every listed block once, ascending, flagged full as listed, in a
    list no wider than the partial one (the two lists together never hold more blocks than that)."""
    regions, geom = prog
    params = tuple(r.params(geom, torch.device("cpu")) for r in regions)
    lay = build_block_layout(regions, params, geom)
    idx, valid, full = lay.entries()
    assert idx.shape == valid.shape == full.shape == lay.kv_idx.shape
    got_partial, got_full = (torch.zeros(geom.n_q_blocks, geom.n_kv_blocks, dtype=torch.bool) for _ in range(2))
    for row in range(geom.n_q_blocks):
        blocks = idx[row][valid[row]].tolist()
        assert blocks == sorted(set(blocks)), "merged row not ascending or with a duplicate"
        assert valid[row].tolist() == sorted(valid[row].tolist(), reverse=True), "a hole before a listed block"
        got_partial[row, idx[row][valid[row] & ~full[row]]] = True
        got_full[row, idx[row][full[row]]] = True
    assert not (full & ~valid).any() and (idx[~valid] == 0).all()
    assert torch.equal(got_partial, listed(lay.kv_num, lay.kv_idx, geom))
    assert torch.equal(got_full, listed(lay.full_num, lay.full_idx, geom))


def test_visible_block_count_is_linear_for_windows():
    geom = Geometry(65536, 65536, 0, 65536, 128, 128)
    params = (TokenWindow(512).params(geom, torch.device("cpu")),)
    lay = build_block_layout((TokenWindow(512),), params, geom)
    assert lay.kv_idx.shape[-1] <= 6 and int(lay.visible_blocks()) <= 6 * geom.n_q_blocks


@st.composite
def any_region_geometry(draw):
    """A region of each kind on a geometry whose state rows need not fill whole blocks (as on the larger
    blocks flex runs a program with on CUDA, ``AttentionProgram.on_blocks``)."""
    block = draw(st.sampled_from([16, 32, 64, 128]))
    chunk = draw(st.sampled_from([16, 32, 48, 64, 128, 256]))
    q_pad = draw(st.integers(1, 12)) * block
    n_chunks = -(-q_pad // chunk)
    kind = draw(st.sampled_from(["causal", "window", "bswa", "sinks", "bank", "checkpoints", "versions"]))
    n_state = draw(st.integers(0, 3 * block))
    if kind == "causal":
        region = Causal()
    elif kind == "window":
        region = TokenWindow(draw(st.integers(1, 3 * block)))
    elif kind == "bswa":
        region = BlockWindow(draw(st.integers(1, 3)), chunk)
    elif kind == "sinks":
        region = Sinks(draw(st.integers(1, 40)))
    elif kind == "bank":
        rows = draw(st.integers(1, 70))
        region = StateBank(rows, chunk, torch.full((n_chunks,), rows))
        n_state = n_chunks * rows + draw(st.integers(0, block - 1))
    else:
        rows, every, lag = draw(st.integers(1, 70)), draw(st.integers(1, 6)), draw(st.integers(0, 1))
        n_ckpt = -(-n_chunks // every)
        n_state = n_ckpt * rows + n_chunks * chunk + draw(st.integers(0, block - 1))
        none = torch.zeros(1, 1, n_state, dtype=torch.int32)
        # a growing state's checkpoints: non-decreasing sizes up to max_live (None: rows, every one full)
        max_live = draw(st.one_of(st.none(), st.integers(0, rows)))
        top = rows if max_live is None else max_live
        live = torch.tensor(sorted(draw(st.lists(st.integers(0, top), min_size=n_ckpt - 1, max_size=n_ckpt - 1)))
                            + [top])
        region = (CheckpointBank(rows, chunk, every, n_chunks, live, none, none, max_live) if kind == "checkpoints" else
                  VersionRows(chunk, every, lag, n_chunks, n_ckpt * rows, n_chunks * chunk, none, none))
    kv_len = -(-(n_state + q_pad) // block) * block
    return region, Geometry(q_pad, q_pad, n_state, kv_len - n_state, block, block)


@settings(max_examples=400)  # cheap (a few small tensor ops each); the default 20 leave kinds untried
@given(any_region_geometry())
def test_list_width_covers_the_rows_of_every_query_block(case):
    """The block lists are ``max_blocks`` wide: no query block's rows ``[lo(qs), hi(qe - 1))`` may reach
    more kv blocks (a narrower list would drop visible blocks)."""
    region, geom = case
    assert _most_blocks_reached(region, geom) <= min(region.max_blocks(geom), geom.n_kv_blocks)


def _most_blocks_reached(region, geom) -> int:
    """The most kv blocks the rows ``[lo(qs), hi(qe - 1))`` of one query block ``[qs, qe)`` reach."""
    p = region.params(geom, torch.device("cpu"))
    first = torch.arange(geom.n_q_blocks) * geom.block_q
    lo, hi = region.bounds(p, torch.stack([first, first + geom.block_q - 1]))
    bk = geom.block_kv
    return int(torch.where(hi[1] > lo[0], -(-hi[1].long() // bk) - lo[0].long() // bk, 0).max())


@pytest.mark.parametrize("block", [16, 32], ids=["block16", "block32"])
def test_list_width_of_every_token_window_and_state_offset(block):
    """Every window up to three blocks (and block windows of chunks 16 to 64) after every number of state rows
    up to two blocks: the sampled geometries above rarely pair a window that is a multiple of the block with
    state rows one past a block's start, where the window's rows of a query block reach one block further."""
    for n_state in range(2 * block):
        kv_tokens = -(-(n_state + 8 * block) // block) * block - n_state
        geom = Geometry(8 * block, 8 * block, n_state, kv_tokens, block, block)
        regions = [TokenWindow(w) for w in range(1, 3 * block + 1)]
        regions += [BlockWindow(width, chunk) for width in (1, 2, 3) for chunk in (16, 32, 48, 64)]
        for region in regions:
            assert _most_blocks_reached(region, geom) <= region.max_blocks(geom), (region, n_state)


@pytest.mark.parametrize("span, base, step, want", [
    (32, 0, 32, 1), (33, 0, 32, 2), (32, 16, 32, 2), (32, 0, 16, 2), (16, 16, 16, 1), (1, 31, 0, 1),
    (2, 31, 0, 2), (40, 0, 1, 3), (34, 0, 1, 3), (64, 0, 0, 2), (64, 1, 2, 3),
], ids=lambda x: str(x))
def test_blocks_touched_by_an_interval(span, base, step, want):
    """Counted by hand on blocks of 32 rows: an aligned start reaches ceil(span / 32) blocks, a start
    that can fall inside a block one more where the span's end then crosses a block boundary."""
    assert blocks_touched(span, base, step, 32) == want


def test_blocks_touched_from_a_symbolic_start_counts_any_offset():
    """Under ``torch.compile`` with a dynamic length the start row can be a symbol (state rows counted from
    it): nothing provable about its offset in a block, so an interval of 32 rows is counted as the two blocks
    of 32 it reaches from a start anywhere inside one, in one graph for every length. (Counted from the
    symbol's value, the count was 1 at lengths that are multiples of 32, under a guard that compiled a second
    graph for them.)"""
    counted = torch.compile(lambda x: torch.zeros(blocks_touched(32, x.shape[0], 0, 32)) + x.sum(), dynamic=True,
                            fullgraph=True)
    before = compile_counts()
    for n in (5, 7, 33, 64, 96):
        assert counted(torch.zeros(n)).shape == (2,), n
    assert (compile_counts() - before).graphs == 1


def test_tiny_preset_lists_are_as_wide_as_what_they_hold():
    """The blocked backend (how a CPU trains) gathers every query block's list at its full width: with
    the tiny preset's 16-token chunks on 32-row blocks, the OVQ lists were 7 and 15 blocks wide at 64
    and 128 tokens for at most 5 listed (so 3x the gathered rows at 128); their width is now within two
    blocks of the most any query block lists."""
    torch.manual_seed(0)
    for T in (64, 128):
        q, k, v = (torch.randn(2, 2, T, 16) for _ in range(3))
        program, _, _ = ovq_program(q, k, v, torch.ones(2), chunk_size=16, max_centroids=2048, block_size=32)
        lay = program.layout
        most = int((lay.kv_num + lay.full_num).max())
        assert lay.kv_idx.shape[-1] <= most + 2, (T, lay.kv_idx.shape[-1], most)
