"""Static-shape OVQ routing (recurrences/ovq/routing_static.py) gives the loop's routes bit for bit."""
import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings, strategies as st
from torch._dynamo.utils import counters

from recurrences.ovq import GROWTHS, SEEDINGS, DictionarySchedule, dictionary_sizes, ovq_absorb, route_ovq
from recurrences.ovq.routing_static import StaticOVQRouter, dictionary_means, route_ovq_static
from tests.helpers import count_router_builds, rel_err


def _keys(seed, B, H, T, D, n_distinct, dtype):
    """Unit keys ``[B, H, T, D]``; with ``n_distinct`` drawn from that many vectors (exact ties everywhere)."""
    g = torch.Generator().manual_seed(seed)
    if n_distinct:
        k = torch.randn(n_distinct, D, generator=g, dtype=torch.float64)[torch.randint(n_distinct, (B, H, T), generator=g)]
    else:
        k = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    return F.normalize(k, dim=-1).to(dtype)


def _check_equal(seed, B, H, T, L, D, N, growth, seeding, normalize, n_distinct, dtype):
    k = _keys(seed, B, H, T, D, n_distinct, dtype)
    kw = dict(seeding=seeding, seed=seed, normalize_centroids=normalize)
    loop = route_ovq(k, schedule=DictionarySchedule(L, N, growth), impl="loop", **kw)
    static = route_ovq_static(k, chunk_size=L, sizes=dictionary_sizes(-(-T // L), L, N, growth), compile=False, **kw)
    assert static.dtype == loop.dtype and static.shape == loop.shape
    assert torch.equal(static, loop)


def _absorbed(router, routes):
    """The dictionary (sums, counts, shaped as the router's) that the loop's absorb builds from the
    router's chunk keys and the given routes ``[B, H, T]``."""
    sums, counts = torch.zeros_like(router.sums), torch.zeros_like(router.counts)
    L = router.chunk_size
    for c in range(router.kf.shape[0]):
        ovq_absorb(sums, counts, router.kf[c], routes[:, :, c * L:(c + 1) * L])
    return sums, counts


CONFIGS = dict(growth=st.sampled_from(GROWTHS), seeding=st.sampled_from(SEEDINGS), normalize=st.booleans(),
               dtype=st.sampled_from([torch.float32, torch.float64]))


@settings(deadline=None)
@given(seed=st.integers(0, 2**16), B=st.integers(1, 2), H=st.integers(1, 3), T=st.integers(0, 90),
       L=st.sampled_from([1, 3, 8, 16]), D=st.sampled_from([1, 2, 4, 8]), N=st.integers(1, 40), **CONFIGS)
def test_static_routes_equal_the_loop(seed, B, H, T, L, D, N, growth, seeding, normalize, dtype):
    """Any shape, generic keys: a score may round differently in the padded product (see below)
    but never by enough to reorder two of them."""
    _check_equal(seed, B, H, T, L, D, N, growth, seeding, normalize, 0, dtype)


@settings(deadline=None)
@given(seed=st.integers(0, 2**16), B=st.integers(1, 2), H=st.integers(2, 3), T=st.integers(0, 400),
       L=st.sampled_from([64, 128]), D=st.sampled_from([8, 16]), N=st.integers(12, 60),
       n_distinct=st.sampled_from([2, 5]), **CONFIGS)
def test_static_routes_equal_the_loop_on_exact_ties(seed, B, H, T, L, D, N, growth, seeding, normalize, n_distinct,
                                                     dtype):
    """Keys drawn from 2 or 5 vectors: exact ties between slots and between tokens' best scores.
    Ties survive only where the padded product rounds as the loop's does. On the CPU (MKL) that is
    every chunk that reads ``N_c >= 12`` rows (with ``L >= 8`` tokens and ``D >= 4``): for fewer,
    ATen's naive bmm or MKL's small-matrix kernels give some columns other roundings than the padded
    product's (:func:`test_the_padded_product_rounds_as_the_exact_one_from_12_rows`), so a dictionary
    here reads at least 12 rows from its first non-empty chunk on."""
    sizes = dictionary_sizes(-(-T // L), L, N, growth)
    assume(min([n for n in sizes if n > 0], default=12) >= 12)
    _check_equal(seed, B, H, T, L, D, N, growth, seeding, normalize, n_distinct, dtype)


def test_the_padded_product_rounds_as_the_exact_one_from_12_rows():
    """What the exact-ties equality rests on, on this machine's CPU: the static step's ``[L, R]``
    product of a chunk's keys against a dictionary padded with zero rows to ``R`` gives the same
    bits on the first ``N_c`` columns as the loop's ``[L, N_c]`` product when ``N_c >= 12`` (below
    12 it did not for any ``N_c`` here: MKL on AVX-512)."""
    g = torch.Generator().manual_seed(0)
    differ = set()
    for D in (8, 16, 64):
        for L in (16, 64, 128):
            a = torch.randn(2, L, D, generator=g)
            for n in range(1, 40):
                b = torch.randn(2, n, D, generator=g)
                for R in (r for r in (16, 64, 128) if r >= n):
                    padded = torch.zeros(2, R, D)
                    padded[:, :n] = b
                    if not torch.equal((a @ padded.transpose(-1, -2))[..., :n], a @ b.transpose(-1, -2)):
                        differ.add(n)
    assert max(differ, default=0) < 12, sorted(differ)


@pytest.mark.parametrize("seeding", SEEDINGS)
@pytest.mark.parametrize("normalize", [False, True])
def test_compiled_step_compiles_once_and_keeps_the_loop_dictionary_bit_for_bit(seeding, normalize):
    B, H, T, D, L, N = 2, 3, 300, 8, 16, 40  # full growth: the dictionary saturates at chunk 3 (n_new = 0 after)
    k = _keys(1, B, H, T, D, 0, torch.float32)
    k[:, :, 100:140] = k[:, :, 20:60]       # duplicated keys: tied similarities and tied best slots
    kw = dict(seeding=seeding, seed=5, normalize_centroids=normalize)
    router = StaticOVQRouter(tuple(k.shape), chunk_size=L, sizes=dictionary_sizes(-(-T // L), L, N, "full"), **kw)
    schedule = DictionarySchedule(L, N, "full")
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(router(k), route_ovq(k, schedule=schedule, impl="loop", **kw))
        flipped = route_ovq(k.flip(2), schedule=schedule, impl="loop", **kw)
        assert torch.equal(router(k.flip(2)), flipped)  # the buffers are reset between calls
    assert counters["stats"]["unique_graphs"] == 1  # one graph for all 2 x 17 static chunk steps
    # the dictionary the compiled steps built is the loop's absorb of the loop's routes, bit for bit
    sums, counts = _absorbed(router, flipped)
    assert torch.equal(router.sums, sums) and torch.equal(router.counts, counts)
    # the read form the steps kept, refreshed on the rows each one wrote, is every row's derived afresh
    assert torch.equal(router.means, dictionary_means(sums, counts, normalize))


@pytest.mark.parametrize("B, H, normalize", [(1, 1, False), (2, 3, True)], ids=["one-head", "six-heads-unit"])
def test_the_fused_absorb_keeps_the_loops_routes_and_its_sums_to_rounding(monkeypatch, B, H, normalize):
    """The compiled step with the absorb traced and fused (``FUSED_ABSORB``, what CUDA compiles; on
    the CPU here): the loop's routes and counts, its sums to fp32 rounding (the fused adds are atomic,
    in no fixed order: one head's tokens split over threads round otherwise), and the kept read form
    every row's derived afresh from the sums the steps built, bit for bit; values absorbed too (a
    static decode cache's boundary) to rounding. One graph for every chunk."""
    from recurrences.ovq import routing_static

    monkeypatch.setitem(routing_static.FUSED_ABSORB, "cpu", True)
    opaque, absorb_in_place = [], routing_static.absorb_in_place  # calls of the opaque op, traced or eager
    monkeypatch.setattr(routing_static, "absorb_in_place", lambda *args: (opaque.append(1), absorb_in_place(*args)))
    T, D, L, N = 1024, 16, 128, 256
    k = _keys(7, B, H, T, D, 0, torch.float32)
    schedule = DictionarySchedule(L, N)
    router = StaticOVQRouter(tuple(k.shape), chunk_size=L, sizes=schedule.sizes(T // L), normalize_centroids=normalize)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        routes = router(k)
    assert counters["stats"]["unique_graphs"] == 1
    assert torch.equal(routes, route_ovq(k, schedule=schedule, normalize_centroids=normalize, impl="loop"))
    sums, counts = _absorbed(router, routes)
    assert torch.equal(router.counts, counts)
    assert rel_err(router.sums, sums) < 1e-6
    assert torch.equal(router.means, dictionary_means(router.sums, router.counts, normalize))
    # the values of a chunk, absorbed by the fused step and by the eager one from the same dictionary
    kc, vc = router.kf[-1], torch.randn(B, H, L, 8, generator=torch.Generator().manual_seed(1))
    bounds = torch.tensor(schedule.sizes(T // L)[-2:])
    fused, eager = ([t.clone() for t in (sums, counts, torch.zeros(*sums.shape[:3], 8))] for _ in range(2))
    with torch.no_grad():  # as the router and a decode boundary run it; a step with values is a graph of its own
        got = routing_static.compiled_static_step(kc, fused[0], fused[1], bounds, None, normalize_centroids=normalize,
                                                  value_sums=fused[2], vc=vc)
    want = routing_static.ovq_static_step(kc, eager[0], eager[1], bounds, None, normalize_centroids=normalize,
                                          value_sums=eager[2], vc=vc)
    assert opaque == [1]  # the eager step's: the compiled ones traced the fused absorb
    assert torch.equal(got, want) and torch.equal(fused[1], eager[1])
    assert rel_err(fused[0], eager[0]) < 1e-6 and rel_err(fused[2], eager[2]) < 1e-6


@pytest.mark.parametrize("normalize", [False, True])
def test_a_dictionary_that_fills_its_bucket_reads_no_spare(normalize):
    """``N = 32`` is its own bucket: the buffers hold 32 rows and the spare (33), the compiled step reads
    all 32 (once full, every one live), and routes and dictionary equal the loop's."""
    B, H, T, D, L, N = 2, 2, 160, 8, 16, 32
    k = _keys(4, B, H, T, D, 0, torch.float32)
    sizes = dictionary_sizes(T // L, L, N, "full")
    assert max(sizes) == N
    router = StaticOVQRouter(tuple(k.shape), chunk_size=L, sizes=sizes, normalize_centroids=normalize)
    assert router.sums.shape[2] == N + 1 and router.counts.shape[2] == N + 1
    loop = route_ovq(k, schedule=DictionarySchedule(L, N, "full"), normalize_centroids=normalize, impl="loop")
    assert torch.equal(router(k), loop)
    sums, counts = _absorbed(router, loop)
    assert torch.equal(router.sums, sums) and torch.equal(router.counts, counts)
    assert counts[:, :, N].sum() == 0  # the spare collected nothing


@pytest.mark.parametrize("T", [40, 47], ids=["whole-chunks", "open-tail"])
def test_the_last_chunks_founders_may_open_the_next_bucket(T):
    """The buffers hold the dictionary the last complete chunk leaves, not the one it reads: with full
    growth and ``L = 8``, chunk 4 reads 32 rows (one bucket) and founds rows 32..39 (the next), so the
    router holds 64 rows and the spare; a chunk left incomplete after it is not routed. Routes equal the
    loop's."""
    B, H, D, L, N = 1, 2, 8, 8, 64
    k = _keys(5, B, H, T, D, 0, torch.float32)
    sizes = dictionary_sizes(-(-T // L), L, N, "full")
    assert sizes[T // L - 1] == 32 and sizes[T // L] == 40
    router = StaticOVQRouter(tuple(k.shape), chunk_size=L, sizes=sizes, compile=False)
    assert router.sums.shape[2] == 64 + 1
    assert torch.equal(router(k), route_ovq(k, schedule=DictionarySchedule(L, N, "full"), impl="loop"))


def test_route_ovq_impl_static_and_the_op_option():
    from ovqflex.ops.ovq import OVQOptions, ovq_attention

    k = _keys(2, 1, 2, 100, 16, 0, torch.float32)
    schedule = DictionarySchedule(16, 24)
    assert torch.equal(route_ovq(k, schedule=schedule, impl="static"), route_ovq(k, schedule=schedule, impl="loop"))
    assert torch.equal(route_ovq(k, schedule=schedule), route_ovq(k, schedule=schedule, impl="loop"))
    with pytest.raises(ValueError, match="impl must be one of"):
        route_ovq(k, schedule=schedule, impl="graph")
    assert OVQOptions().routing == "auto"  # the loop on the CPU: the same routes as below
    q, v, beta = torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16), torch.full((2,), 4.0)
    out, state = ovq_attention(q, k, v, beta, chunk_size=16, max_centroids=24, backend="blocked", return_state=True,
                               routing="loop")
    out_s, state_s = ovq_attention(q, k, v, beta, chunk_size=16, max_centroids=24, backend="blocked",
                                   return_state=True, routing="static")
    assert torch.equal(state_s.routes, state.routes) and torch.equal(out_s, out)


def test_cuda_graph_needs_cuda():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        StaticOVQRouter((1, 1, 32, 4), chunk_size=16, sizes=[0, 8, 12], device="cpu", cuda_graph=True)


def test_cached_routers_and_one_compiled_step_for_every_length_in_a_bucket(monkeypatch):
    """``route_ovq(impl="static")`` builds one router per input shape and options and reuses it; the
    dictionary buffer is padded to a power of two, so lengths whose dictionaries fall in one bucket
    (plateau, N = 64: 52 and 57 rows at T = 300 and 600, a 64-row buffer and the spare after it) share
    one compiled step."""
    from recurrences import compiling
    from recurrences.ovq import routing_static

    made = count_router_builds(monkeypatch, routing_static, "StaticOVQRouter")
    L, N = 16, 64
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T in (300, 600, 300):
            k = _keys(T, 2, 2, T, 8, 0, torch.float32)
            kw = dict(schedule=DictionarySchedule(L, N), seeding="spread")
            assert torch.equal(route_ovq(k, impl="static", **kw), route_ovq(k, impl="loop", **kw))
    assert made == [(2, 2, 300, 8), (2, 2, 600, 8)]  # T = 300 again: the cached router
    assert counters["stats"]["unique_graphs"] == 1
    assert [r.sums.shape[2] for r in compiling._ROUTERS.values()] == [65, 65]
    compiling.clear_static_routers()


def test_a_cached_router_is_built_for_its_own_seed_and_normalization(monkeypatch):
    """The router cache keys every option the routes depend on: one input shape routed with another
    random-seeding seed, or with and without ``normalize_centroids``, gets a router of its own and the
    loop's routes (which differ between the options)."""
    from recurrences import compiling
    from recurrences.ovq import routing_static

    made = count_router_builds(monkeypatch, routing_static, "StaticOVQRouter")
    L, N, T = 8, 24, 64
    k = _keys(6, 1, 2, T, 8, 0, torch.float32)
    sizes = dictionary_sizes(T // L, L, N, "plateau")
    options = [dict(seeding="random", seed=0), dict(seeding="random", seed=1),
               dict(seeding="spread", normalize_centroids=False), dict(seeding="spread", normalize_centroids=True)]
    loops = [route_ovq(k, schedule=DictionarySchedule(L, N), impl="loop", **kw) for kw in options]
    assert not torch.equal(loops[0], loops[1]) and not torch.equal(loops[2], loops[3])
    for kw, loop in zip(options, loops):
        assert torch.equal(route_ovq_static(k, chunk_size=L, sizes=sizes, compile=False, **kw), loop), kw
    assert len(made) == len(options)
    compiling.clear_static_routers()


def test_static_routing_inside_a_compiled_op_equals_the_loop(monkeypatch):
    """What ``routing="auto"`` runs on CUDA, on the CPU: the OVQ op compiled with ``fullgraph=True``
    calls the routing custom op, whose static router compiles its own step at run time; outputs,
    routes and gradients equal the eager op with the loop, and later calls reuse the one router."""
    from recurrences.ovq import routing_static
    from ovqflex.ops.ovq import ovq_attention

    made = count_router_builds(monkeypatch, routing_static, "StaticOVQRouter")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 96, 16, generator=g) for _ in range(3))
    beta = torch.full((2,), 4.0)
    kw = dict(chunk_size=16, max_centroids=24, backend="blocked", return_state=True)

    def op(q, k, v, routing):
        return ovq_attention(q, k, v, beta, routing=routing, **kw)

    compiled = torch.compile(functools.partial(op, routing="static"), fullgraph=True)
    for call in range(2):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, state = compiled(*leaves)
        grads = torch.autograd.grad(out.square().sum(), leaves)
        ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        ref, ref_state = op(*ref_leaves, routing="loop")
        ref_grads = torch.autograd.grad(ref.square().sum(), ref_leaves)
        assert torch.equal(state.routes, ref_state.routes)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert made == [(1, 2, 96, 16)]
