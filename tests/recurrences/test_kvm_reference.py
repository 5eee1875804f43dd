"""The KVM reference's ``gaps``: how far forced routes fall short of the loop's own decisions, the
measure of the near-tie rule (docs/design.md §4.3, §9). The loop itself is tested against the fused
op in tests/ovqflex/ops/test_kvm.py."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from recurrences.reference import kvm_attention_reference

C, D = 4, 8


def _inputs(T, seed=0, gated=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, T, D, generator=g) for _ in range(3))
    gate = 0.5 + torch.rand(1, 2, T, generator=g) if gated else None
    return q, k, v, gate


def _run(T, forced=None, seed=0, gated=False, **kw):
    """The reference on ``_inputs(T)``; ``forced``: a result whose routes and founders it takes."""
    q, k, v, gate = _inputs(T, seed, gated)
    kw = dict(chunk_size=C, n_bswa_chunks=1, sink_len=0, rope_dims=0, ln_s_weight=torch.ones(D),
              ln_s_bias=torch.zeros(D)) | kw
    if forced is not None:
        kw |= dict(routes=forced.routes, founder=forced.founder)
    return kvm_attention_reference(q, k, v, gate, **kw), k


@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
@pytest.mark.parametrize("kw", [dict(budget="fixed"), dict(budget="power_law", growth_factor=2.0, max_state_chunks=None,
                                                          sink_len=1),
                                dict(budget="saturation", saturation_n=12, max_state_chunks=None, n_bswa_chunks=2)],
                         ids=["fixed", "power_law-sink", "saturation-Nb2"])
def test_gaps_are_zero_on_the_loops_own_routes(kw, gated):
    own, _ = _run(30, gated=gated, **kw)
    forced, _ = _run(30, forced=own, gated=gated, **kw)
    assert (own.gaps == 0).all() and (forced.gaps == 0).all()
    assert torch.equal(forced.out, own.out)


def _first_block_sims(k, n_rows):
    """Similarities of the first overflow block's tokens (4..7) with the state rows then: the first
    C tokens and any appended ones, each one token's LN'd key (LN_s with weight 1, bias 0), [2, 4, n]."""
    kbar = F.layer_norm(k[0], (D,))
    rows = F.layer_norm(kbar[:, :n_rows], (D,))
    scale = kbar[:, C:2 * C].norm(dim=-1).amax(-1) * rows.norm(dim=-1).amax(-1)
    return kbar[:, C:2 * C] @ rows.transpose(-1, -2), scale


def test_gaps_of_a_merge():
    """A fixed budget of C rows: the first overflow block merges all its tokens into the C rows its
    first tokens made. Token 4 forced into its second-best row falls short by best - second
    similarity, in units of the block's largest possible similarity."""
    own, k = _run(12, budget="fixed")
    sims, scale = _first_block_sims(k, C)
    routes = own.routes.clone()
    second = sims[:, 0].argsort(-1, descending=True)[:, 1]
    routes[0, :, C] = second
    gaps = _run(12, forced=SimpleNamespace(routes=routes, founder=own.founder), budget="fixed")[0].gaps[0]
    top2 = sims[:, 0].sort(-1, descending=True).values[:, :2]
    torch.testing.assert_close(gaps[:, C], (top2[:, 0] - top2[:, 1]) / scale)
    assert (gaps[:, C] > 0).all() and (gaps[:, :C] == 0).all() and (gaps[:, C + 1:2 * C] == 0).all()


def test_gaps_of_an_append():
    """A budget of C + 2 rows: the first overflow block appends its 2 tokens least like the state (lowest
    best similarity) and merges the others. Forced to append its most state-like token instead of the
    least, that token's gap is its best similarity minus the one its rank has in the loop."""
    kw = dict(budget="fixed", state_min_len=C + 2, max_state_chunks=None)
    own, k = _run(12, **kw)
    sims, scale = _first_block_sims(k, C)
    score = sims.amax(-1)                                                   # [2, 4]
    block = own.routes[0, :, C:2 * C]
    assert ((block >= C).sum(-1) == 2).all()  # two appends per head
    order = score.argsort(-1)
    lowest, highest, second = order[:, 0], order[:, -1], order[:, 1]
    forced_set = torch.stack([second, highest], -1).sort(-1).values         # appended in temporal order
    routes, founder = own.routes.clone(), own.founder.clone()
    for h in range(2):
        rows = dict(zip(forced_set[h].tolist(), (C, C + 1)))
        founder[0, h, C:2 * C] = False
        for t in range(C):
            if t in rows:
                routes[0, h, C + t], founder[0, h, C + t] = rows[t], True
            elif t == lowest[h]:  # no longer appended: merged into its most similar first row
                routes[0, h, C + t] = sims[h, t].argmax()
    gaps = _run(12, forced=SimpleNamespace(routes=routes, founder=founder), **kw)[0].gaps[0]
    for h in range(2):
        own_sorted = score[h].sort().values[:2]
        # the forced set's ranks: second (rank 0, the loop's rank-0 score is the lowest's), highest (rank 1)
        want = {second[h].item(): (score[h, second[h]] - own_sorted[0]).abs() / scale[h],
                highest[h].item(): (score[h, highest[h]] - own_sorted[1]).abs() / scale[h]}
        for t, g in want.items():
            torch.testing.assert_close(gaps[h, C + t], g)
        assert gaps[h, C + highest[h]] > 0.01


def test_forced_decisions_are_checked():
    own, _ = _run(12, budget="fixed", state_min_len=C + 2, max_state_chunks=None)
    kw = dict(budget="fixed", state_min_len=C + 2, max_state_chunks=None)
    with pytest.raises(ValueError, match="routes and founder force the decisions together.*routes alone"):
        q, k, v, gate = _inputs(12)
        kvm_attention_reference(q, k, v, chunk_size=C, n_bswa_chunks=1, ln_s_weight=torch.ones(D),
                                ln_s_bias=torch.zeros(D), routes=own.routes, **kw)
    with pytest.raises(ValueError, match=r"founder must be a torch.bool tensor of shape \[B, H, T\]"):
        _run(12, forced=SimpleNamespace(routes=own.routes, founder=own.founder.long()), **kw)
    founder = own.founder.clone()
    founder[0, 0, C:2 * C] = False
    with pytest.raises(ValueError, match=r"founder: block \[4, 8\) must append exactly 2 tokens"):
        _run(12, forced=SimpleNamespace(routes=own.routes, founder=founder), **kw)
    routes = own.routes.clone()
    first = own.founder[0, 0, C:2 * C].nonzero()[0, 0] + C
    routes[0, 0, first] = C + 1  # the block's first founder must take row C
    with pytest.raises(ValueError, match=r"routes: the founders of block \[4, 8\) must have rows 4\.\. in temporal"):
        _run(12, forced=SimpleNamespace(routes=routes, founder=own.founder), **kw)


@settings(max_examples=30)
@given(st.integers(1, 3), st.sampled_from([4, 8]), st.integers(0, 2), st.booleans(),
       st.sampled_from(["fixed", "power_law", "saturation"]), st.integers(0, 2**16))
def test_forced_onto_its_own_decisions_the_loop_has_no_gaps(n_bswa, chunk, sink_len, gated, budget, seed):
    """Whatever the options, the loop forced onto its own routes and founders reproduces its run
    exactly and finds every decision its own (gaps 0): the near-tie rule never refuses the loop itself."""
    kw = dict(chunk_size=chunk, n_bswa_chunks=n_bswa, sink_len=sink_len, budget=budget, max_state_chunks=None,
              growth_factor=2.0, saturation_n=24, rope_dims=D // 2)
    own, _ = _run(9 * chunk + 3, seed=seed, gated=gated, **kw)
    forced, _ = _run(9 * chunk + 3, forced=own, seed=seed, gated=gated, **kw)
    assert (forced.gaps == 0).all() and torch.equal(forced.out, own.out) and torch.equal(forced.routes, own.routes)
