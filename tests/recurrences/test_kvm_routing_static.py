"""Static-shape KVM routing (recurrences/kvm/routing_static.py) gives the loop's routes bit for bit."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch._dynamo.utils import counters

from recurrences.kvm import KVMBudget, KVMSchedule, kvm_absorb, kvm_state_sizes, route_kvm
from recurrences.kvm.routing_static import StaticKVMRouter, route_kvm_static
from tests.helpers import count_router_builds, rel_err

BUDGETS = {  # power-law growth (uncapped, or capped at a few chunks), saturation, the fixed default (one chunk)
    "fixed": KVMBudget(),
    "fixed-min": KVMBudget("fixed", state_min_len=40, max_state_chunks=3),
    "power_law": KVMBudget("power_law", growth_factor=4.0, growth_exponent=0.5, max_state_chunks=None),
    "power_law-capped": KVMBudget("power_law", growth_factor=4.0, growth_exponent=0.5, max_state_chunks=3),
    "power_law-round": KVMBudget("power_law", growth_factor=6.0, growth_exponent=0.6, round_down=8,
                                 state_min_len=20, max_state_chunks=4),
    "saturation": KVMBudget("saturation", saturation_n=48, max_state_chunks=None),
}


def _inputs(seed, B, H, T, D, n_distinct, gated, dtype):
    """Memory keys ``[B, H, T, D]`` (``LN`` of random keys; with ``n_distinct``, of that many vectors:
    exact ties everywhere), gates ``[B, H, T]`` (ones without ``gated``), ``LN_s`` weight and bias ``[D]``."""
    g = torch.Generator().manual_seed(seed)
    if n_distinct:
        pick = torch.randint(n_distinct, (B, H, T), generator=g)
        k = torch.randn(n_distinct, D, generator=g, dtype=torch.float64)[pick]
    else:
        k = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    kbar = F.layer_norm(k, (D,)).to(dtype)
    gate = (1.0 + F.elu(torch.randn(B, H, T, generator=g))).to(dtype) if gated else torch.ones(B, H, T, dtype=dtype)
    w, b = 1.0 + 0.2 * torch.randn(D, generator=g), 0.2 * torch.randn(D, generator=g)
    return kbar, gate, w.to(dtype), b.to(dtype)


def _check_equal(seed, B, H, n_chunks, C, D, Nb, budget, sink_len, gated, n_distinct, dtype):
    T = n_chunks * C + seed % C  # a ragged last chunk when seed % C > 0
    kbar, gate, w, b = _inputs(seed, B, H, T, D, n_distinct, gated, dtype)
    schedule = KVMSchedule(C, Nb, BUDGETS[budget])
    routes, founder = route_kvm(kbar, gate, w, b, schedule=schedule, sink_len=sink_len, impl="loop")
    s_routes, s_founder = route_kvm_static(kbar, gate, w, b, chunk_size=C, n_bswa_chunks=Nb,
                                           sizes=kvm_state_sizes(T, C, Nb, BUDGETS[budget]), sink_len=sink_len,
                                           compile=False)
    assert s_routes.dtype == routes.dtype and s_founder.dtype == founder.dtype and s_routes.shape == routes.shape
    assert torch.equal(s_routes, routes) and torch.equal(s_founder, founder)


def _absorbed(router, gate, routes, founder, sizes, C, Nb):
    """The state ``[B, H, R, D]`` (the router's rows, spare excluded) that the loop's absorb builds
    from the router's keys and the given routes: chunk 0 founds, then every overflow chunk."""
    state = torch.zeros_like(router.state[:, :, :-1])
    state[:, :, :C] = router.kf[0]
    for c in range(Nb + 1, len(sizes)):
        sl = slice((c - Nb) * C, (c - Nb + 1) * C)
        kvm_absorb(state, router.kf[c - Nb], gate[:, :, sl], routes[:, :, sl], founder[:, :, sl],
                   sizes[c] - sizes[c - 1])
    return state


CONFIGS = dict(B=st.integers(1, 2), H=st.integers(1, 3), Nb=st.integers(1, 3), budget=st.sampled_from(sorted(BUDGETS)),
               sink_len=st.sampled_from([0, 1]), gated=st.booleans(), dtype=st.sampled_from([torch.float32,
                                                                                              torch.float64]))


@settings(deadline=None)
@given(seed=st.integers(0, 2**16), n_chunks=st.integers(0, 14), C=st.sampled_from([16, 32]),
       D=st.sampled_from([1, 2, 4, 8, 16]), **CONFIGS)
def test_static_routes_equal_the_loop(seed, B, H, n_chunks, C, D, Nb, budget, sink_len, gated, dtype):
    """Any shape (the front only, T <= Nb * C, included), generic keys; D = 1 makes every ``LN_s`` row
    the bias: all scores tie, every decision is a tie rule."""
    _check_equal(seed, B, H, n_chunks, C, D, Nb, budget, sink_len, gated, 0, dtype)


@settings(deadline=None)
@given(seed=st.integers(0, 2**16), n_chunks=st.integers(4, 14), C=st.sampled_from([16, 32]),
       D=st.sampled_from([8, 16]), n_distinct=st.sampled_from([2, 5]), **CONFIGS)
def test_static_routes_equal_the_loop_on_exact_ties(seed, B, H, n_chunks, C, D, Nb, budget, sink_len, gated,
                                                     n_distinct, dtype):
    """Keys drawn from 2 or 5 vectors: exact ties between rows (argmax's first index) and between
    tokens' append scores (the stable sort)."""
    _check_equal(seed, B, H, n_chunks, C, D, Nb, budget, sink_len, gated, n_distinct, dtype)


def row_kernels_on_stacks(device="cpu") -> list[str]:
    """The eager row kernels routing reads (KVM's ``LN_s``, OVQ's unit means) applied to a stack of
    chunks ``[n, B, H, C, D]`` and to each chunk alone: the names of those whose stacked result is not
    each chunk's own, bit for bit (the static routers normalize all chunks' keys, or all state rows, in
    one launch and rely on a row's result not depending on the others)."""
    from recurrences.kvm.routing_static import _ln_rows
    from recurrences.ovq.routing_static import _eager_unit_rows

    g = torch.Generator().manual_seed(11)
    differ = []
    for D in (64, 20):  # a vectorized width and one that is not
        x = (3 * torch.randn(9, 1, 4, 128, D, generator=g) + 0.5).to(device)
        w, b = (1 + 0.2 * torch.randn(D, generator=g)).to(device), (0.2 * torch.randn(D, generator=g)).to(device)
        for name, fn in (("ln_rows", lambda t: _ln_rows(t, w, b, 1e-5)), ("unit_rows", _eager_unit_rows)):
            stacked = fn(x)
            if not all(torch.equal(stacked[u], fn(x[u])) for u in range(x.shape[0])):
                differ.append(f"{name}, D={D}")
    return differ


def test_a_stack_of_rows_normalizes_as_each_chunk_alone():
    assert row_kernels_on_stacks() == []


def test_the_steps_products_round_as_the_loops_from_16_rows():
    """What the exact-ties equality rests on, on this machine's CPU: the static step's logits come
    from a ``[C, R]`` product against the padded state and, for the founders' rows, a ``[C, C]``
    product against every token's row, where the loop's are a ``[C, m]`` product and the same ``[C,
    C]`` one, and the reference's a ``[C, m + n_app]`` product with the founders' rows after the
    state's (``n_app`` of them, maybe fewer than 12). With ``C >= 16`` rows, a column has the same
    bits in every product of ``>= 12`` columns that holds it, wherever it sits there."""
    g = torch.Generator().manual_seed(0)
    for D in (4, 8, 16, 64):
        for C in (16, 32, 128):
            keys, pool = torch.randn(2, C, D, generator=g), torch.randn(2, 300, D, generator=g)
            every = keys @ pool.transpose(-1, -2)  # [2, C, 300]: each column's bits in one wide product
            for start in (0, 1, 4, 11, 16, 100):
                for width in (12, 13, 16, 17, 33, 128, 184):
                    cols = slice(start, start + width)
                    assert torch.equal(keys @ pool[:, cols].transpose(-1, -2), every[..., cols]), (D, C, start, width)


@pytest.mark.parametrize("sink_len", [0, 1])
def test_compiled_step_compiles_once_and_keeps_the_loop_state_bit_for_bit(sink_len):
    B, H, D, C, Nb = 2, 3, 16, 16, 2
    T = 17 * C + 5
    kbar, gate, w, b = _inputs(1, B, H, T, D, 0, True, torch.float32)
    kbar[:, :, 100:140] = kbar[:, :, 20:60]  # duplicated keys: tied scores and tied rows
    sizes = kvm_state_sizes(T, C, Nb, BUDGETS["power_law-capped"])  # grows by 3..11 rows a chunk, then stops (48)
    assert len(set(b - a for a, b in zip(sizes[Nb:], sizes[Nb + 1:]))) > 2
    router = StaticKVMRouter(tuple(kbar.shape), chunk_size=C, n_bswa_chunks=Nb, sizes=sizes, sink_len=sink_len)
    kw = dict(schedule=KVMSchedule(C, Nb, BUDGETS["power_law-capped"]), sink_len=sink_len, impl="loop")
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert all(map(torch.equal, router(kbar, gate, w, b), route_kvm(kbar, gate, w, b, **kw)))
        flipped = route_kvm(kbar.flip(2), gate, w, b, **kw)
        assert all(map(torch.equal, router(kbar.flip(2), gate, w, b), flipped))  # the buffers are reset
    assert counters["stats"]["unique_graphs"] == 1  # one graph for all 2 x 14 overflow chunk steps
    # the state the compiled steps built is the loop's absorb of the loop's routes, bit for bit
    routes, founder = flipped
    assert torch.equal(router.state[:, :, :-1], _absorbed(router, gate, routes, founder, sizes, C, Nb))
    # LN_s of the rows, kept by the steps and refreshed on the rows each one wrote, is every row's afresh
    assert torch.equal(router.rows[:, :, :-1], F.layer_norm(router.state[:, :, :-1], (D,), w, b))


@pytest.mark.parametrize("B, H, sink_len", [(1, 1, 0), (2, 3, 1)], ids=["one-head", "six-heads-sink"])
def test_the_fused_absorb_keeps_the_loops_routes_and_its_state_to_rounding(monkeypatch, B, H, sink_len):
    """The compiled step with the absorb traced and fused (``FUSED_ABSORB``, what CUDA compiles; on the
    CPU here): the loop's routes and founders, its state to fp32 rounding (the fused merge adds are
    atomic, in no fixed order), and the kept ``LN_s`` rows every row's afresh from the state the steps
    built, bit for bit; the opaque op is not called. One graph for every overflow chunk."""
    from recurrences.kvm import routing_static

    monkeypatch.setitem(routing_static.FUSED_ABSORB, "cpu", True)
    opaque, absorb = [], routing_static.kvm_absorb_static  # calls of the opaque op, traced or eager
    monkeypatch.setattr(routing_static, "kvm_absorb_static", lambda *args: (opaque.append(1), absorb(*args)))
    D, C, Nb = 16, 16, 2
    T = 17 * C + 5
    kbar, gate, w, b = _inputs(4, B, H, T, D, 0, True, torch.float32)
    kbar[:, :, 100:140] = kbar[:, :, 20:60]  # duplicated keys: tied scores and tied rows
    budget = BUDGETS["power_law"]
    sizes = kvm_state_sizes(T, C, Nb, budget)
    router = StaticKVMRouter(tuple(kbar.shape), chunk_size=C, n_bswa_chunks=Nb, sizes=sizes, sink_len=sink_len)
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        routes, founder = router(kbar, gate, w, b)
    assert counters["stats"]["unique_graphs"] == 1 and opaque == []
    loop = route_kvm(kbar, gate, w, b, schedule=KVMSchedule(C, Nb, budget), sink_len=sink_len, impl="loop")
    assert torch.equal(routes, loop[0]) and torch.equal(founder, loop[1])
    state = router.state[:, :, :-1]
    assert rel_err(state, _absorbed(router, gate, routes, founder, sizes, C, Nb)) < 1e-6
    assert torch.equal(router.rows[:, :, :-1], F.layer_norm(state, (D,), w, b))


@pytest.mark.parametrize("sink_len", [0, 1])
def test_a_state_that_fills_its_bucket_reads_no_spare(sink_len):
    """A fixed state of 32 rows is its own bucket: the buffer holds 32 rows and the spare (33), the
    compiled step reads all 32 (every one live once the state is full), and routes, founders and state
    equal the loop's."""
    B, H, D, C, Nb = 2, 2, 8, 16, 1
    T = 12 * C
    budget = KVMBudget("fixed", state_min_len=32, max_state_chunks=2)
    kbar, gate, w, b = _inputs(6, B, H, T, D, 0, True, torch.float32)
    sizes = kvm_state_sizes(T, C, Nb, budget)
    assert max(sizes) == 32
    router = StaticKVMRouter(tuple(kbar.shape), chunk_size=C, n_bswa_chunks=Nb, sizes=sizes, sink_len=sink_len)
    assert router.state.shape[2] == 33
    routes, founder = route_kvm(kbar, gate, w, b, schedule=KVMSchedule(C, Nb, budget), sink_len=sink_len,
                                impl="loop")
    s_routes, s_founder = router(kbar, gate, w, b)
    assert torch.equal(s_routes, routes) and torch.equal(s_founder, founder)
    assert bool((routes < 32).all()) and bool((routes == 31).any())  # the last row joined, never the spare
    assert torch.equal(router.state[:, :, :-1], _absorbed(router, gate, routes, founder, sizes, C, Nb))


def _opposed_inputs(seed: int, T: int, D: int, C: int):
    """Memory keys ``[1, 1, T, D]`` whose first chunk lies near one direction and every later token near its
    opposite: each later token's best score against the rows chunk 0 founded is below 0, the score an
    empty row (``LN_s(0) = 0``, bias 0) would give. Unit gates, ``LN_s`` weight 1 and bias 0."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(D, generator=g, dtype=torch.float64)
    sign = torch.where(torch.arange(T) < C, 1.0, -1.0).to(torch.float64)
    kbar = F.layer_norm(sign[:, None] * u + 0.3 * torch.randn(T, D, generator=g, dtype=torch.float64), (D,))
    return kbar.float()[None, None], torch.ones(1, 1, T), torch.ones(D), torch.zeros(D)


def test_founders_are_the_tokens_least_like_the_live_rows_when_every_score_is_negative():
    """An overflow chunk turned away from every row: its append scores (each token's best over the ``m``
    live rows, all negative) decide the founders, the loop's lowest first; a dead row (zero state,
    ``LN_s`` 0) never takes part, or every score would be 0 and the founders the first tokens."""
    C, D, Nb = 16, 8, 1
    T = 4 * C
    budget = BUDGETS["power_law"]
    kbar, gate, w, b = _opposed_inputs(7, T, D, C)
    scores = (kbar[0, 0, C:2 * C] @ F.layer_norm(kbar[0, 0, :C], (D,), w, b).T).amax(-1)  # chunk 1 against chunk 0
    assert bool((scores < 0).all())
    routes, founder = route_kvm(kbar, gate, w, b, schedule=KVMSchedule(C, Nb, budget), sink_len=0, impl="loop")
    n_app = int(founder[0, 0, C:2 * C].sum())
    assert 0 < n_app < C and not bool(founder[0, 0, C:C + n_app].all())  # not simply the first tokens
    s_routes, s_founder = route_kvm_static(kbar, gate, w, b, chunk_size=C, n_bswa_chunks=Nb,
                                           sizes=kvm_state_sizes(T, C, Nb, budget), sink_len=0, compile=False)
    assert torch.equal(s_routes, routes) and torch.equal(s_founder, founder)


def test_a_founders_non_finite_row_takes_the_later_tokens_as_the_loops_argmax_does():
    """The merge's argmax lets NaN win (``torch.argmax``): a token whose key is ``-inf`` in one component
    scores ``-inf`` against rows that are all positive there (bias 10), so it founds first, and its new
    row's ``LN_s`` is NaN; every other token of its chunk then joins that row, in the loop and the static
    step alike (the step's own-rows maximum is NaN while its state maximum is finite)."""
    C, D, Nb = 16, 4, 1
    T = 4 * C
    budget = BUDGETS["power_law"]
    kbar, gate, w, b = _inputs(8, 1, 1, T, D, 0, False, torch.float32)
    b = torch.tensor([10.0, 0.0, 0.0, 0.0])
    bad = C + 5
    kbar[0, 0, bad] = torch.tensor([float("-inf"), 0.0, 0.0, 0.0])
    routes, founder = route_kvm(kbar, gate, w, b, schedule=KVMSchedule(C, Nb, budget), sink_len=0, impl="loop")
    joiners = ~founder[0, 0, C:2 * C]
    assert founder[0, 0, bad] and bool(joiners.any())
    assert bool((routes[0, 0, C:2 * C][joiners] == routes[0, 0, bad]).all())
    s_routes, s_founder = route_kvm_static(kbar, gate, w, b, chunk_size=C, n_bswa_chunks=Nb,
                                           sizes=kvm_state_sizes(T, C, Nb, budget), sink_len=0, compile=False)
    assert torch.equal(s_routes, routes) and torch.equal(s_founder, founder)


def test_route_kvm_impl_static_and_the_op_option():
    from ovqflex.ops.kvm import KVMOptions, kvm_attention

    assert KVMOptions().routing == "auto"  # the loop on the CPU
    kbar, gate, w, b = _inputs(2, 1, 2, 100, 16, 0, True, torch.float32)
    kw = dict(schedule=KVMSchedule(16, 1), sink_len=1)
    assert all(map(torch.equal, route_kvm(kbar, gate, w, b, impl="static", **kw),
                           route_kvm(kbar, gate, w, b, impl="loop", **kw)))
    g = torch.Generator().manual_seed(3)
    B, H, T, D = 2, 2, 150, 16
    q, k, v = (torch.randn(B, H, T, D, generator=g, requires_grad=True) for _ in range(3))
    params = dict(gate=1.0 + F.elu(torch.randn(B, H, T, generator=g)),
                  ln_s_weight=1.0 + 0.2 * torch.randn(D, generator=g), ln_s_bias=0.2 * torch.randn(D, generator=g),
                  tau_state=0.5 + torch.rand(H, generator=g))
    leaves = [q, k, v] + [p.requires_grad_() for p in params.values()]
    opts = dict(chunk_size=16, n_bswa_chunks=2, budget="power_law", growth_factor=4.0, max_state_chunks=None)
    results = []
    for routing in ("loop", "static"):
        out, state = kvm_attention(q, k, v, backend="blocked", return_state=True, routing=routing, **params, **opts)
        results.append((out, state, torch.autograd.grad(out.square().sum(), leaves)))
    (out, state, grads), (out_s, state_s, grads_s) = results
    assert torch.equal(state_s.routes, state.routes) and torch.equal(state_s.founder, state.founder)
    assert torch.equal(out_s, out) and all(map(torch.equal, grads_s, grads))


def test_bad_routing_is_refused_by_name():
    from ovqflex.ops.kvm import KVMOptions

    with pytest.raises(ValueError, match=r"routing must be one of \['auto', 'loop', 'static'\], got 'graph'"):
        KVMOptions(routing="graph")
    kbar, gate, w, b = _inputs(0, 1, 1, 48, 16, 0, True, torch.float32)
    with pytest.raises(ValueError, match="impl must be one of"):
        route_kvm(kbar, gate, w, b, schedule=KVMSchedule(16, 1), sink_len=1, impl="graph")


def test_cuda_graph_needs_cuda():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        StaticKVMRouter((1, 1, 48, 4), chunk_size=16, n_bswa_chunks=1, sizes=[0, 16, 16], sink_len=1, device="cpu",
                        cuda_graph=True)


def test_sizes_for_more_chunks_than_the_input_holds_are_refused():
    with pytest.raises(ValueError, match=r"sizes must list at most ceil\(T / chunk_size\) = 3 chunks, got 4"):
        StaticKVMRouter((1, 1, 48, 4), chunk_size=16, n_bswa_chunks=1, sizes=[0, 16, 22, 27], sink_len=1)


def test_a_cached_router_is_built_for_its_own_sink_rows_and_ln_eps(monkeypatch):
    """The router cache keys every option the routes depend on: one input shape routed with and without
    a protected sink row, or with another ``LN_s`` epsilon, gets a router of its own and the loop's routes
    (which differ between the options)."""
    from recurrences import compiling
    from recurrences.kvm import routing_static

    made = count_router_builds(monkeypatch, routing_static, "StaticKVMRouter")
    C, Nb, T, D = 16, 1, 160, 4
    budget = BUDGETS["power_law"]
    kbar, gate, w, b = _inputs(9, 1, 2, T, D, 0, True, torch.float32)
    kbar = kbar * 1e-2  # keys this small: LN_s of a state row depends on its epsilon
    options = [dict(sink_len=0), dict(sink_len=1), dict(sink_len=1, ln_eps=1e-5), dict(sink_len=1, ln_eps=1e-2)]
    loops = [route_kvm(kbar, gate, w, b, schedule=KVMSchedule(C, Nb, budget), impl="loop", **kw) for kw in options]
    assert not torch.equal(loops[0][0], loops[1][0]) and not torch.equal(loops[2][0], loops[3][0])
    for kw, loop in zip(options, loops):
        static = route_kvm_static(kbar, gate, w, b, chunk_size=C, n_bswa_chunks=Nb,
                                  sizes=kvm_state_sizes(T, C, Nb, budget), compile=False, **kw)
        assert all(map(torch.equal, static, loop)), kw
    assert len(made) == 3  # sink_len=1 with the default ln_eps is the second router again
    compiling.clear_static_routers()


def test_cached_routers_and_one_compiled_step_for_every_length_in_a_bucket(monkeypatch):
    """``route_kvm(impl="static")`` builds one router per input shape and options and reuses it; the
    state buffer is padded to a power of two, so lengths whose states fall in one bucket (power law
    4·sqrt(ctx), C = 16: 71 and 89 rows at T = 330 and 500, a 128-row buffer and the spare after it)
    share one compiled step."""
    from recurrences import compiling
    from recurrences.kvm import routing_static

    made = count_router_builds(monkeypatch, routing_static, "StaticKVMRouter")
    C, Nb, rows = 16, 2, []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T in (330, 500, 330):
            kbar, gate, w, b = _inputs(T, 2, 2, T, 16, 0, True, torch.float32)
            schedule = KVMSchedule(C, Nb, KVMBudget("power_law", growth_factor=4.0, max_state_chunks=None))
            rows.append(schedule.rows(-(-T // C)))
            kw = dict(schedule=schedule, sink_len=1)
            assert all(map(torch.equal, route_kvm(kbar, gate, w, b, impl="static", **kw),
                           route_kvm(kbar, gate, w, b, impl="loop", **kw)))
    assert made == [(2, 2, 330, 16), (2, 2, 500, 16)]  # T = 330 again: the cached router
    assert counters["stats"]["unique_graphs"] == 1
    assert rows[0] != rows[1] and [r.state.shape[2] for r in compiling._ROUTERS.values()] == [129, 129]
    compiling.clear_static_routers()
