"""Hand-checkable tests of the sequential OVQ-attention reference (the fused path's oracle)."""
import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from recurrences.reference import ovq_attention_reference, ovq_schedule


def _inputs(B=2, H=2, T=23, D=8, Dv=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    v = torch.randn(B, H, T, Dv or D, generator=g, dtype=dtype)
    beta = torch.linspace(1.0, 4.0, H, dtype=dtype)
    return q, k, v, beta


def _brute_force(q, k, v, beta, routes, chunk_size, normalize_centroids=False):
    """Quadratic form from the routes alone: the dictionary before chunk c is the plain mean
    of the unit keys / values of the tokens t < cL routed to each slot, bias log(histogram)."""
    B, H, T, _ = q.shape
    qh, kh = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    out = torch.empty(B, H, T, v.shape[-1], dtype=q.dtype)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                c0 = (t // chunk_size) * chunk_size
                rows, vals, bias = [], [], []
                past = routes[b, h, :c0]
                for slot in sorted(set(past[past >= 0].tolist())):
                    sel = past == slot
                    mk = kh[b, h, :c0][sel].mean(0)
                    rows.append(F.normalize(mk, dim=-1) if normalize_centroids else mk)
                    vals.append(v[b, h, :c0][sel].mean(0))
                    bias.append(math.log(int(sel.sum())))
                for j in range(c0, t + 1):
                    rows.append(kh[b, h, j]); vals.append(v[b, h, j]); bias.append(0.0)
                s = beta[h] * (torch.stack(rows) @ qh[b, h, t]) + torch.tensor(bias, dtype=q.dtype)
                out[b, h, t] = s.softmax(0) @ torch.stack(vals)
    return out


def test_schedules_by_hand():
    # plateau N=4, L=8: t = 0, 8, 16, 24, 32 -> 0, 32//12, 64//20, 96//28, 128//36
    assert ovq_schedule(4, 8, 4, "plateau") == [0, 2, 3, 3, 3]
    # plateau N=6, L=4: t = 4..20 -> 24//10, 48//14, 72//18, 96//22, 120//26
    assert ovq_schedule(5, 4, 6, "plateau") == [0, 2, 3, 4, 4, 4]
    assert ovq_schedule(6, 4, 1, "plateau") == [0] * 7          # t/(t+1) < 1 forever
    assert ovq_schedule(4, 2, 5, "full") == [0, 2, 4, 5, 5]
    assert ovq_schedule(4, 4, 8, "linear") == [0, 1, 2, 3, 4]    # horizon 32: ceil(32/32)=1
    assert ovq_schedule(4, 4, 8, "linear", 8) == [0, 4, 8, 8, 8]  # ceil(32/8)=4
    assert ovq_schedule(3, 4, 8, "linear", 1) == [0, 4, 8, 8]    # capped at L per chunk
    assert ovq_schedule(4, 4, 10, "linear", 12) == [0, 4, 8, 10, 10]  # ceil(40/12)=4


def _keys(rows):
    return torch.tensor(rows, dtype=torch.float64).view(1, 1, len(rows), -1)


E1, E2, E3 = [1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]
# keys worked by hand (chunks of 4, max_centroids 5, full growth), and the loop's routes on them
BY_HAND_KEYS = [E1, E2, [-1.0, 0, 0], [0, -1.0, 0],       # chunk 0: all four become seeds
                E1, E3, [1.0, 1.0, 0], E2,                # chunk 1: one new centroid
                [2.0, 0, 0], [0, 0, -3.0], E2, E3]        # chunk 2: N reached, all merge
BY_HAND_ROUTES = [0, 2, 1, 3, 0, 4, 0, 2, 0, 0, 2, 4]


def test_first_seeding_and_new_centroids_by_hand():
    k = _keys(BY_HAND_KEYS)
    q = torch.randn(1, 1, 12, 3, dtype=torch.float64)
    v = torch.randn(1, 1, 12, 2, dtype=torch.float64)
    res = ovq_attention_reference(q, k, v, torch.ones(1, dtype=torch.float64),
                                  chunk_size=4, max_centroids=5, growth="full")
    assert res.sizes == [0, 4, 5, 5]
    # chunk 0: slot 0 = token 0; others by ascending sim to token 0 (-1, then 0, 0 -> lower index)
    # chunk 1: best sims [1, 0, .707 (tie slots 0 and 2 -> slot 0), 1]; lowest (token 5) -> slot 4
    # chunk 2: e1 -> 0, -e3 (tie at 0 across slots 0..3 -> lowest slot 0), e2 -> 2, e3 -> 4
    assert res.routes[0, 0].tolist() == BY_HAND_ROUTES
    assert res.counts[0, 0].tolist() == [5.0, 1.0, 3.0, 1.0, 2.0]


def test_first_seeding_least_similar_to_token0_and_merge_into_seed():
    k = _keys([[1.0, 0], [0.9, 0.1], [-1.0, 0], [0.8, 0.3],   # seeds: token 0, token 2 (least similar)
               [0.0, 1.0], [-0.7, 0.1], [1.0, 1.0], [5.0, 0]])
    q = torch.randn(1, 1, 8, 2, dtype=torch.float64)
    res = ovq_attention_reference(q, k, k.clone(), torch.ones(1, dtype=torch.float64),
                                  chunk_size=4, max_centroids=2, growth="full")
    assert res.sizes == [0, 2, 2]
    # chunk 1 merges into the nearest of the two running means (no ties here)
    r = res.routes[0, 0].tolist()
    assert r[:4] == [0, 0, 1, 0]
    kh = F.normalize(k[0, 0], dim=-1)
    means = torch.stack([kh[[0, 1, 3]].mean(0), kh[2]])
    expected = (kh[4:] @ means.T).argmax(-1).tolist()
    assert r[4:] == expected


@pytest.mark.parametrize("normalize_centroids", [False, True])
@pytest.mark.parametrize("growth,seeding", [("plateau", "spread"), ("linear", "random"), ("full", "spread")])
def test_outputs_and_dictionary_are_segment_means(growth, seeding, normalize_centroids):
    q, k, v, beta = _inputs(T=23, Dv=5)
    res = ovq_attention_reference(q, k, v, beta, chunk_size=4, max_centroids=6, growth=growth,
                                  seeding=seeding, normalize_centroids=normalize_centroids)
    assert res.out.shape == (2, 2, 23, 5) and res.out.dtype == torch.float64
    assert (res.routes[..., 20:] == -1).all() and (res.routes[..., :20] >= 0).all()
    kh = F.normalize(k, dim=-1)
    for b in range(2):
        for h in range(2):
            hist = torch.bincount(res.routes[b, h, :20], minlength=6).float()
            assert torch.equal(res.counts[b, h], hist)
            assert int((hist > 0).sum()) == res.sizes[-1]
            for s in range(res.sizes[-1]):
                sel = res.routes[b, h] == s
                torch.testing.assert_close(res.keys[b, h, s], kh[b, h][sel].mean(0))
                torch.testing.assert_close(res.values[b, h, s], v[b, h][sel].mean(0))
    torch.testing.assert_close(res.out, _brute_force(q, k, v, beta, res.routes, 4, normalize_centroids))


def test_new_slot_ids_follow_schedule():
    q, k, v, beta = _inputs(T=32)
    res = ovq_attention_reference(q, k, v, beta, chunk_size=4, max_centroids=8)
    for c in range(8):
        lo, hi = res.sizes[c], res.sizes[c + 1]
        r = res.routes[..., 4 * c: 4 * c + 4]
        assert (r < hi).all()
        if c > 0:  # after the first chunk each new slot holds exactly its one seed token
            for s in range(lo, hi):
                assert ((r == s).sum(-1) == 1).all()


def test_causality_gradients():
    q, k, v, beta = _inputs(B=1, H=2, T=14)
    for x in (q, k, v, beta):
        x.requires_grad_(True)
    res = ovq_attention_reference(q, k, v, beta, chunk_size=4, max_centroids=4)
    for i in (0, 3, 5, 9, 13):
        gq, gk, gv = torch.autograd.grad(res.out[:, :, i].sum(), (q, k, v), retain_graph=True)
        for g in (gq, gk, gv):
            assert torch.count_nonzero(g[:, :, i + 1:]) == 0
        assert gv[:, :, i].abs().max() > 0
        if i % 4:  # a chunk's first token attends to nothing else in its chunk: no key gradient
            assert gk[:, :, i].abs().max() > 0
    # earlier chunks reach later outputs only through the dictionary, which they do
    gk, gv, gb = torch.autograd.grad(res.out[:, :, 12:].sum(), (k, v, beta))
    assert gk[:, :, :4].abs().max() > 0 and gv[:, :, :4].abs().max() > 0 and gb.abs().min() > 0


def test_gradcheck_with_forced_routes():
    q, k, v, beta = _inputs(B=1, H=2, T=9, D=3, Dv=2)
    routes = ovq_attention_reference(q, k, v, beta, chunk_size=3, max_centroids=3).routes
    xs = tuple(x.clone().requires_grad_(True) for x in (q, k, v, beta))
    for nc in (False, True):
        fn = lambda *a: ovq_attention_reference(*a, chunk_size=3, max_centroids=3, routes=routes,
                                                normalize_centroids=nc).out
        assert torch.autograd.gradcheck(fn, xs)


@pytest.mark.parametrize("seeding", ["spread", "random"])
def test_forced_routes_reproduce(seeding):
    q, k, v, beta = _inputs(T=22, dtype=torch.float32)
    xs = [x.clone().requires_grad_(True) for x in (q, k, v, beta)]
    ys = [x.clone().requires_grad_(True) for x in (q, k, v, beta)]
    kw = dict(chunk_size=4, max_centroids=5, seeding=seeding, seed=3)
    a = ovq_attention_reference(*xs, **kw)
    b = ovq_attention_reference(*ys, routes=a.routes, **kw)
    assert torch.equal(a.routes, b.routes) and torch.equal(a.counts, b.counts) and a.sizes == b.sizes
    torch.testing.assert_close(a.out, b.out, rtol=0, atol=0)
    a.out.square().sum().backward()
    b.out.square().sum().backward()
    for x, y in zip(xs, ys):
        torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)


def test_random_seeding_deterministic_and_prefix_consistent():
    q, k, v, beta = _inputs(T=24, dtype=torch.float32)
    kw = dict(chunk_size=4, max_centroids=6, seeding="random")
    a = ovq_attention_reference(q, k, v, beta, seed=7, **kw)
    b = ovq_attention_reference(q, k, v, beta, seed=7, **kw)
    assert torch.equal(a.routes, b.routes) and torch.equal(a.out, b.out)
    others = [ovq_attention_reference(q, k, v, beta, seed=s, **kw).routes for s in range(4)]
    assert any(not torch.equal(a.routes, r) for r in others)
    p = ovq_attention_reference(q[:, :, :14], k[:, :, :14], v[:, :, :14], beta, seed=7, **kw)
    assert torch.equal(p.routes[..., :12], a.routes[..., :12]) and (p.routes[..., 12:] == -1).all()
    torch.testing.assert_close(p.out, a.out[:, :, :14])
    # first chunk: the seeds are the n_new tokens with the lowest u of chunk 0's draw
    u = torch.rand((2, 2, 4), generator=torch.Generator().manual_seed(7))
    n_new = a.sizes[1]
    seeds = torch.argsort(u, dim=-1, stable=True)[..., :n_new]
    assert torch.equal(a.routes[..., :4].gather(2, seeds), torch.arange(n_new).expand(2, 2, n_new))


def test_unrouted_tokens():
    q, k, v, beta = _inputs(T=10)
    res = ovq_attention_reference(q, k, v, beta, chunk_size=4, max_centroids=1)  # plateau N=1 stays 0
    assert (res.routes == -1).all() and res.sizes == [0, 0, 0, 0] and (res.counts == 0).all()
    # with an empty dictionary every chunk is plain causal attention inside the chunk
    torch.testing.assert_close(res.out, _brute_force(q, k, v, beta, res.routes, 4))
    res = ovq_attention_reference(q, k, v, beta, chunk_size=4, max_centroids=3, growth="full")
    assert res.sizes == [0, 3, 3, 3]  # the partial final chunk adds nothing
    assert (res.routes[..., 8:] == -1).all() and (res.routes[..., :8] >= 0).all()
    assert res.counts.sum(-1).eq(8).all()


def test_float32_and_bf16_inputs():
    q, k, v, beta = _inputs(T=12, dtype=torch.float32)
    a = ovq_attention_reference(q, k, v, beta, chunk_size=4, max_centroids=4)
    assert a.out.dtype == torch.float32
    b = ovq_attention_reference(q.bfloat16(), k.bfloat16(), v.bfloat16(), beta,
                                chunk_size=4, max_centroids=4)
    assert b.out.dtype == torch.bfloat16 and b.counts.dtype == torch.float32


def _bad(**over):
    q, k, v, beta = _inputs(T=8, dtype=torch.float32)
    args = dict(q=q, k=k, v=v, beta=beta)
    kw = dict(chunk_size=4, max_centroids=4)
    for key, val in over.items():
        (args if key in args else kw)[key] = val
    return ovq_attention_reference(args["q"], args["k"], args["v"], args["beta"], **kw)


@pytest.mark.parametrize("over,exc,message", [
    (dict(chunk_size=0), ValueError, "chunk_size must be a positive int, got 0"),
    (dict(chunk_size=2.0), ValueError, "chunk_size must be a positive int, got 2.0"),
    (dict(max_centroids=0), ValueError, "max_centroids must be an int >= 1, got 0"),
    (dict(growth="cubic"), ValueError, "growth must be one of ('plateau', 'full', 'linear'), got 'cubic'"),
    (dict(growth="linear", growth_horizon=0), ValueError, "growth_horizon must be a positive int or None, got 0"),
    (dict(seeding="kmeans++"), ValueError, "seeding must be one of ('spread', 'random'), got 'kmeans++'"),
    (dict(q=torch.randn(2, 8, 8)), ValueError, "q must have rank 4 [B, H, T, D], got shape (2, 8, 8)"),
    (dict(k=torch.randn(2, 2, 8, 6)), ValueError, "k must have q's head dim D=8, got 6"),
    (dict(v=torch.randn(2, 2, 7, 8)), ValueError, "v must match q in [B, H, T]=(2, 2, 8), got (2, 2, 7, 8)"),
    (dict(v=torch.randn(2, 2, 8, 8, dtype=torch.float64)), TypeError,
     "v must have q's dtype/device (torch.float32, cpu), got (torch.float64, cpu)"),
    (dict(beta=torch.ones(3)), ValueError, "beta must have shape [H]=(2,), got (3,)"),
    (dict(q=torch.ones(2, 2, 8, 8, dtype=torch.long)), TypeError,
     "q must be a floating-point torch.Tensor, got Tensor of dtype torch.int64"),
    (dict(routes=torch.zeros(2, 2, 8, dtype=torch.int32)), TypeError,
     "routes must be an int64 torch.Tensor, got torch.int32"),
    (dict(routes=torch.zeros(2, 2, 7, dtype=torch.long)), ValueError,
     "routes must have shape [B, H, T]=(2, 2, 8), got (2, 2, 7)"),
    (dict(routes=torch.zeros(2, 2, 8, dtype=torch.long)), ValueError,
     "routes: chunk 0 must create every new slot 0..1"),  # new slot 1 never created
])
def test_bad_arguments(over, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        _bad(**over)


def test_forced_routes_validation():
    q, k, v, beta = _inputs(B=1, H=1, T=10)
    kw = dict(chunk_size=4, max_centroids=3, growth="full")   # sizes 0 -> 3 -> 3
    good = ovq_attention_reference(q, k, v, beta, **kw).routes
    for t, val, msg in ((1, 3, r"chunk 0 must use slot ids in \[0, 3\), got values in \[0, 3\]"),  # id >= N_{c+1}
                        (5, -1, r"chunk 1 must use slot ids in \[0, 3\), got values in \[-1, 2\]"),  # -1 in routed
                        (9, 0, "chunk 2 is not routed, its routes must all be -1"),  # partial
                        (2, -2, r"chunk 0 must use slot ids in \[0, 3\), got values in \[-2, 2\]")):  # negative
        bad = good.clone()
        bad[0, 0, t] = val
        with pytest.raises(ValueError, match=f"routes: {msg}"):
            ovq_attention_reference(q, k, v, beta, routes=bad, **kw)


# --- gaps: how far forced routes fall short of the loop's own decisions (the near-tie rule, docs/design.md §4.2)

@pytest.mark.parametrize("normalize_centroids", [False, True], ids=["means", "unit-means"])
@pytest.mark.parametrize("growth,seeding", [("plateau", "spread"), ("linear", "random"), ("full", "spread"),
                                            ("full", "random")])
def test_gaps_are_zero_on_the_loops_own_routes(growth, seeding, normalize_centroids):
    q, k, v, beta = _inputs(T=27, dtype=torch.float32)
    kw = dict(chunk_size=4, max_centroids=7, growth=growth, seeding=seeding, seed=2,
              normalize_centroids=normalize_centroids)
    own = ovq_attention_reference(q, k, v, beta, **kw)
    forced = ovq_attention_reference(q, k, v, beta, routes=own.routes, **kw)
    assert (own.gaps == 0).all() and (forced.gaps == 0).all()


@settings(max_examples=40)
@given(st.integers(1, 60), st.integers(1, 6), st.integers(1, 12), st.sampled_from(["plateau", "linear", "full"]),
       st.sampled_from(["spread", "random"]), st.booleans(), st.integers(0, 2**16))
def test_forced_onto_its_own_routes_the_loop_has_no_gaps(T, L, N, growth, seeding, normalize_centroids, seed):
    """Whatever the options, the loop forced onto its own routes reproduces its run exactly and finds
    every decision its own (gaps 0): the near-tie rule never refuses the loop itself."""
    q, k, v, beta = _inputs(B=1, T=T, D=4, dtype=torch.float32, seed=seed)
    kw = dict(chunk_size=L, max_centroids=N, growth=growth, seeding=seeding, seed=seed % 7,
              normalize_centroids=normalize_centroids)
    own = ovq_attention_reference(q, k, v, beta, **kw)
    forced = ovq_attention_reference(q, k, v, beta, routes=own.routes, **kw)
    assert (forced.gaps == 0).all() and torch.equal(forced.out, own.out)


def _by_hand(routes, rows=None, chunk_size=4, max_centroids=5):
    """The chunks of test_first_seeding_and_new_centroids_by_hand (unit keys e1, e2, -e1, -e2 seed the
    dictionary; chunk 1 makes one new centroid) forced onto ``routes``: their gaps [12]."""
    k = _keys(rows or BY_HAND_KEYS)
    q = torch.zeros_like(k)
    res = ovq_attention_reference(q, k, q, torch.ones(1, dtype=torch.float64), chunk_size=chunk_size,
                                  max_centroids=max_centroids, growth="full",
                                  routes=torch.tensor(routes).view(1, 1, -1))
    return res.gaps[0, 0]


OWN = BY_HAND_ROUTES


def test_gaps_of_a_merge():
    """Chunk 1 reads the unit dictionary e1, -e1, e2, -e2. (e1 + e2)/sqrt(2) is equally near e1 (slot
    0, the loop's pick) and e2 (slot 2): routed to either, its gap is 0. e1 (token 4) routed to e2's
    slot 2 falls a whole 1 - 0 short."""
    assert (_by_hand(OWN) == 0).all()
    tie = _by_hand(OWN[:6] + [2] + OWN[7:])
    assert (tie[:8] == 0).all()  # (later chunks read another history, on which OWN is not the loop's)
    wrong = _by_hand(OWN[:4] + [2] + OWN[5:])
    assert wrong[4] == 1.0 and (wrong[:4] == 0).all() and (wrong[5:8] == 0).all()


def test_gaps_of_a_founder():
    """Chunk 1's new centroid goes to its token least like the dictionary: e3 (token 5, best
    similarity 0), not e2 (token 7, similarity 1 to slot 2). With e2 forced to found slot 4 (and e3
    merged into slot 0, where its similarity 0 ties every slot), e2's gap is |1 - 0|."""
    gaps = _by_hand(OWN[:4] + [0, 0, 0, 4] + OWN[8:])
    assert gaps[4:8].tolist() == [0.0, 0.0, 0.0, 1.0] and (gaps[:4] == 0).all()


def test_gaps_of_the_first_seeding():
    """Chunk 0 seeds its 4 slots with token 0 first, then in ascending similarity to it: -e1 (-1),
    then e2 and -e2 (0 each, the lower index first). Swapping e2's and -e2's slots is an exact tie
    (gap 0); swapping e2's and -e1's puts keys 0 and -1 a whole 1 off their ranks."""
    assert (_by_hand([0, 3, 1, 2] + OWN[4:])[:4] == 0).all()
    assert _by_hand([0, 1, 2, 3] + OWN[4:])[:4].tolist() == [0.0, 1.0, 1.0, 0.0]
    # with fewer slots than tokens the others merge into the seed nearest them: (0.9, 0.1) goes to
    # token 0's e1, and routed to -e1's slot falls 2 cos((0.9, 0.1), e1) short
    rows = [[1.0, 0], [0.9, 0.1], [-1.0, 0], [0.8, 0.3]]
    gaps = _by_hand([0, 1, 1, 0], rows=rows, max_centroids=2)
    assert gaps[0] == 0 and gaps[2] == 0 and gaps[3] == 0
    torch.testing.assert_close(gaps[1], 2 * F.normalize(torch.tensor(rows[1]), dim=0)[0].to(gaps.dtype))
