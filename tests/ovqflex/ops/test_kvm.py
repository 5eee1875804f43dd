"""KVM attention: fused program == the paper's chunk loop (docs/design.md §4.3, §9)."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import event, given, settings
from hypothesis import strategies as st

import ovqflex
from ovqflex.ops import kvm_program
from recurrences.reference import kvm_attention_reference
from tests.helpers import (FWD_TOL, GRAD_TOL, OLD_TORCH, assert_close, default_floats, dynamo_restarts,
                           float64_leaves, grad_floor, reference_on_routes)

BUDGETS = {
    "fixed": dict(budget="fixed"),
    "fixed-min": dict(budget="fixed", state_min_len=40, max_state_chunks=3),
    "power_law": dict(budget="power_law", growth_factor=4.0, growth_exponent=0.5, max_state_chunks=None),
    "power_law-round": dict(budget="power_law", growth_factor=6.0, growth_exponent=0.6, round_down=8,
                            state_min_len=20, max_state_chunks=4),
    "saturation": dict(budget="saturation", saturation_n=48, max_state_chunks=None),
    "saturation-round": dict(budget="saturation", saturation_n=200, round_down=4, max_state_chunks=2),
}


@st.composite
def kvm_cases(draw):
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    D = draw(st.sampled_from([16, 32]))
    C = draw(st.sampled_from([16, 32]))
    Nb = draw(st.integers(1, 3))
    if draw(st.sampled_from(["state", "state", "state", "front"])) == "front":  # T <= Nb*C: no state yet
        T = draw(st.integers(1, Nb * C))
    else:  # the state is read by 1..16 chunks, the last one whole or ragged
        T = (Nb + draw(st.integers(0, 15))) * C + draw(st.sampled_from([C, C, 1, 7, C // 2 + 3]))
    kw = dict(chunk_size=C, n_bswa_chunks=Nb, sink_len=draw(st.integers(0, 2)),
              rope_dims=draw(st.sampled_from([0, D // 2, D])), use_vlens=draw(st.booleans()),
              **BUDGETS[draw(st.sampled_from(sorted(BUDGETS)))])
    return B, H, D, T, kw, draw(st.booleans()), draw(st.integers(0, 2**16))


def inputs(B, H, D, T, seed, gated=True, requires_grad=True):
    """q, k, v ``[B, H, T, D]``, gate ``[B, H, T]`` and the readout parameters, all leaves."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    params = dict(gate=1.0 + F.elu(torch.randn(B, H, T, generator=g)) if gated else None,
                  ln_s_weight=1.0 + 0.2 * torch.randn(D, generator=g), ln_s_bias=0.2 * torch.randn(D, generator=g),
                  tau_state=0.5 + torch.rand(H, generator=g), tau_bswa=0.5 + torch.rand(H, generator=g))
    leaves = [q, k, v] + [p for p in params.values() if p is not None]
    for x in leaves:
        x.requires_grad_(requires_grad)
    return q, k, v, params, leaves


def params_of(params: dict, tensors) -> dict:
    """``params`` (as :func:`inputs` gives them) with its tensors replaced by ``tensors``, in the order of the
    leaves after q, k, v (e.g. their float64 copies)."""
    names = [name for name, p in params.items() if p is not None]
    return {**params, **dict(zip(names, tensors, strict=True))}


@settings(max_examples=100)
@given(kvm_cases())
def test_fused_equals_reference(case):
    B, H, D, T, kw, gated, seed = case
    C, Nb = kw["chunk_size"], kw["n_bswa_chunks"]
    event("front only (T <= Nb*C)" if T <= Nb * C else f"state read by {-(-T // C) - Nb} chunks")
    event("T a chunk multiple" if T % C == 0 else "T not a chunk multiple")
    q, k, v, params, leaves = inputs(B, H, D, T, seed, gated)
    out, state = ovqflex.kvm_attention(q, k, v, backend="blocked", return_state=True, **params, **kw)
    # the loop in float64 on the same inputs (float64_leaves)
    wide = float64_leaves(leaves)
    wq, wk, wv, *wide_params = wide
    wide_kw = params_of(params, wide_params)
    # discrete decisions first (docs/design.md §9): the same state sizes, rows and founders as the loop,
    # up to near-ties
    ref = reference_on_routes(lambda **forced: kvm_attention_reference(wq, wk, wv, **wide_kw, **kw, **forced),
                              routes=state.routes, founder=state.founder)
    assert state.sizes == ref.sizes
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    # the state parameters are unused while T <= Nb*C: compare zeros then
    grads = torch.autograd.grad((out * w).sum(), leaves, allow_unused=True, materialize_grads=True)
    ref_grads = torch.autograd.grad((ref.out * w.double()).sum(), wide, allow_unused=True, materialize_grads=True)
    assert_close(out, ref.out, FWD_TOL[torch.float32], "forward")
    names = ["q", "k", "v"] + [n for n, p in params.items() if p is not None]
    floor = grad_floor(ref_grads)
    for name, a, b in zip(names, grads, ref_grads):
        assert_close(a, b, GRAD_TOL[torch.float32], f"d{name}", floor=floor)


def test_front_is_plain_causal_attention_with_bswa_temperature():
    q, k, v, params, _ = inputs(2, 2, 16, 90, seed=1, requires_grad=False)
    out = ovqflex.kvm_attention(q, k, v, chunk_size=32, n_bswa_chunks=3, backend="blocked", **params)
    tau = params["tau_bswa"].view(1, 2, 1, 1)
    expected = F.scaled_dot_product_attention(q, k * tau, v, is_causal=True)
    assert_close(out, expected, FWD_TOL[torch.float32], "front == causal SDPA")


def test_sinks_protected_appends_in_temporal_order_and_state_follows_budget():
    C, Nb, T = 32, 2, 32 * 24
    q, k, v, params, _ = inputs(2, 2, 16, T, seed=3, requires_grad=False)
    kw = dict(chunk_size=C, n_bswa_chunks=Nb, sink_len=2, budget="power_law", growth_factor=8.0,
              growth_exponent=0.5, max_state_chunks=None)
    _, st_ = ovqflex.kvm_attention(q, k, v, backend="blocked", return_state=True, **params, **kw)
    routes, founder, sizes = st_.routes, st_.founder, st_.sizes
    for c in range(Nb + 2, len(sizes)):  # growth below C per chunk from here: exactly the budget
        assert sizes[c] == math.floor(8 * math.sqrt(c * C)), c
    absorbed = routes >= 0
    assert int(absorbed[0, 0].sum()) == (len(sizes) - Nb) * C  # every token that left a window
    assert int(founder[0, 0].sum()) == sizes[-1]  # one founder per state row
    merged = absorbed & ~founder
    assert merged.any() and bool((routes[merged] >= 2).all()), "a sink row was a merge target"
    for b in range(2):
        for h in range(2):
            rows = routes[b, h][founder[b, h]]
            assert torch.equal(rows, torch.arange(sizes[-1])), "founders not in temporal row order"


def test_bf16_inputs_route_like_fp32():
    q, k, v, params, _ = inputs(1, 2, 32, 200, seed=5, requires_grad=False)
    kw = dict(chunk_size=16, budget="power_law", growth_factor=4.0, max_state_chunks=None, backend="blocked")
    lo = {n: p.bfloat16() if n == "gate" else p for n, p in params.items()}
    out16, s16 = ovqflex.kvm_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), return_state=True, **lo, **kw)
    back = {n: p.float() for n, p in lo.items()}
    out32, s32 = ovqflex.kvm_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(),
                                       return_state=True, **back, **kw)
    assert torch.equal(s16.routes, s32.routes) and torch.equal(s16.founder, s32.founder)
    assert out16.dtype == torch.bfloat16
    assert_close(out16.float(), out32, FWD_TOL[torch.bfloat16], "bf16 vs fp32")


@pytest.mark.parametrize("layout", ["snapshot", "versioned"])
def test_bf16_build_keeps_no_fp32_copy_of_the_token_values(layout):
    """The founder radius is an fp32 norm of each bf16 value: it reads v itself, so what autograd keeps of
    the build holds no ``[B, H, T, Dv]`` fp32 copy of v (the norm of ``v.float()`` kept one per layer)."""
    B, H, T, D = 1, 2, 160, 32
    q, k, v, params, _ = inputs(B, H, D, T, seed=3, requires_grad=False)
    q, k, v = (x.bfloat16().requires_grad_() for x in (q, k, v))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        kvm_program(q, k, v, params["gate"].bfloat16(), ln_s_weight=params["ln_s_weight"],
                    ln_s_bias=params["ln_s_bias"], chunk_size=16, state_layout=layout)
    token_rows_fp32 = [t for t in saved if t.dtype == torch.float32 and tuple(t.shape) == (B, H, T, D)]
    assert saved and not token_rows_fp32


@pytest.mark.parametrize("T, kw", [(256, dict(chunk_size=32, n_bswa_chunks=2, sink_len=1)),
                                   (200, dict(chunk_size=16, n_bswa_chunks=3, budget="power_law",
                                              growth_factor=6.0, max_state_chunks=None))],
                         ids=["fixed-32", "power-16"])
def test_flex_forward_equals_reference(T, kw):
    q, k, v, params, _ = inputs(1, 2, 32, T, seed=T, requires_grad=False)
    with torch.no_grad():
        out = ovqflex.kvm_attention(q, k, v, backend="flex", **params, **kw)
    assert_close(out, kvm_attention_reference(q, k, v, **params, **kw).out, FWD_TOL[torch.float32], "flex")


@pytest.mark.parametrize("change, match", [
    (dict(chunk_size=20), "chunk_size"), (dict(n_bswa_chunks=0), "n_bswa_chunks"), (dict(sink_len=16), "sink_len"),
    (dict(rope_dims=3), r"rope_dims must be None \(head_dim // 2\) or an even int >= 0, got 3"),
    (dict(rope_dims=18), r"rope_dims must be an even int in \[0, head_dim=16\], got 18"),
    (dict(budget="exp"), "budget"), (dict(max_state_chunks=0), "max_state_chunks"),
    (dict(ln_s_weight=torch.ones(3)), "ln_s_weight"), (dict(tau_state=torch.ones(5)), "tau_state"),
    (dict(gate=torch.ones(1, 2, 7)), "gate"),
    (dict(block_size=0), "block_size must be a power of two >= 16 \\(16, 32, 64, 128, ...\\), got 0"),
], ids=["chunk", "nb", "sinks", "rope", "rope-past-head", "budget", "cap", "ln", "tau", "gate", "block-0"])
def test_bad_arguments(change, match):
    q, k, v, params, _ = inputs(1, 2, 16, 40, seed=0, requires_grad=False)
    args = dict(chunk_size=16) | params | change
    with pytest.raises((ValueError, TypeError), match=match):
        ovqflex.kvm_attention(q, k, v, **args)


def _op_with(kw):
    """The op with these keyword options, as a closure: every closure made here shares one code object,
    whose compiled graphs dynamo keeps together and chooses among by their guards on the options."""
    return lambda *x, **p: ovqflex.kvm_attention(*x, backend="blocked", **p, **kw)


@pytest.mark.parametrize("layout, budget", [("snapshot", "power_law"), ("versioned", "fixed")])
def test_one_graph_serves_every_length_under_dynamic_shapes(layout, budget):
    """The state sizes reach a compiled graph as an opaque op's tensor and its largest state as a bucket
    (docs/design.md §3.5): compiled with dynamic shapes, one graph runs lengths 520, 730 and 1000
    (33, 46 and 63 chunks; power law 4 sqrt(ctx): 87, 104 and 124 rows, one 128-row bucket), forward
    and backward, equal to the eager op. ``dynamic=True`` makes the options' floats symbolic; the op
    specializes them with a guard (``plain_float``), so another growth factor compiles a graph of its
    own rather than being served the first one's buckets. ``aot_eager`` traces what inductor would
    compile, guards included. A fixed budget has no float option: traced once, no float of the op's own
    restarts dynamo's analysis (the power law's floats, given symbolic, restart it once: docs/design.md
    §3.5)."""
    from torch._dynamo.utils import counters

    kw = dict(chunk_size=16, n_bswa_chunks=2, state_layout=layout, **BUDGETS[budget])
    calls = [(520, kw), (730, kw), (1000, kw)]
    if budget == "power_law":
        calls.append((1000, {**kw, "growth_factor": 6.0}))
    torch._dynamo.reset()
    counters.clear()
    for T, options in calls:
        q, k, v, params, leaves = inputs(1, 2, 16, T, seed=T)
        w = torch.randn(1, 2, T, 16, generator=torch.Generator().manual_seed(T))
        with dynamo_restarts() as restarts, default_floats() as floats:
            out = torch.compile(_op_with(options), dynamic=True, backend="aot_eager", fullgraph=True)(q, k, v, **params)
        # torch 2.11 (the GPU machine's) also makes KVMOptions' float field defaults symbolic, and traces
        # again once plain_options has specialized them (2.13 reads them plain); a default_factory would
        # keep them plain but fails 2.11's dynamo when the value is given (docs/design.md §3.5)
        assert budget == "power_law" or OLD_TORCH or not restarts, f"T={T}: {restarts}"
        assert not floats, f"T={T}: {floats}"
        want = _op_with(options)(q, k, v, **params)
        assert_close(out, want, FWD_TOL[torch.float32], f"T={T} output")
        for got, ref, name in zip(torch.autograd.grad((out * w).sum(), leaves),
                                  torch.autograd.grad((want * w).sum(), leaves), "qkv gwbst"):
            assert_close(got, ref, GRAD_TOL[torch.float32], f"T={T} grad {name}")
        if options is kw:
            assert counters["stats"]["unique_graphs"] == 1, f"T={T} compiled a graph of its own"
    assert counters["stats"]["unique_graphs"] == len(calls) - 2
    assert not counters["graph_break"]
