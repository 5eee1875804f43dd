"""cuda tier: every op through flex on CUDA, forward and backward, against its sequential
reference (run on the same device and inputs, fp32) in both state layouts, with identical routes (up
to near-ties, docs/design.md §9);
in bf16 likewise, within bf16 tolerances; whole ops compiled under no_grad."""
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import ovqflex
from recurrences.reference import (delta_rule_reference, kvm_attention_reference, linear_attention_reference,
                                   ovq_attention_reference, vla_reference, vq_attention_reference)
from tests.cuda.cuda_cases import CUDA_TIER, DEVICE, FWD_TOL_CUDA, GRAD_TOL_CUDA, TRAIN_BACKEND, seeded
from tests.helpers import FWD_TOL, GRAD_TOL, assert_close, grad_floor, reference_on_routes
from tests.ovqflex.ops.test_dtypes import busy_rows
from tests.recurrences.test_kvm_routing_static import row_kernels_on_stacks
from tests.recurrences.test_precision import ln_s_params, routing_copies
from tests.recurrences.test_versioned import bf16_state_sums_round_about_once

pytestmark = CUDA_TIER

B, H, T, D = 2, 2, 300, 32


def _inputs(seed: int) -> dict:
    g = seeded(seed)
    q, k, v, u = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    return dict(q=q, k=k, v=v, u=u, gate=1 + F.elu(torch.randn(B, H, T, generator=g)),
                beta_t=torch.rand(B, H, T, generator=g), beta=D**0.5 * (0.5 + torch.rand(H, generator=g)),
                codebook=torch.randn(H, 24, D, generator=g), ln_s_weight=1 + 0.2 * torch.randn(D, generator=g),
                ln_s_bias=0.2 * torch.randn(D, generator=g), tau_state=0.5 + torch.rand(H, generator=g),
                tau_bswa=0.5 + torch.rand(H, generator=g))


def _on(t: dict, names, dtype=torch.float32, grad=()) -> dict:
    return {n: t[n].to(device=DEVICE, dtype=dtype).requires_grad_(n in grad) for n in names}


def compare(fused, reference, t: dict, names, grad, seed):
    """``fused(inputs) -> (out, decisions)`` and ``reference(inputs, **forced) -> result`` (with ``.out``) on
    the same fp32 inputs on DEVICE: the discrete decisions (``{"routes": ...}``, KVM's with ``"founder"``,
    VQ's ``"codes"``; ``{}``: none) are the reference's, up to near-ties (``reference_on_routes``), the
    forward and every gradient within the bounds the GPU measurements met."""
    x = _on(t, names, grad=grad)
    out, decided = fused(x)
    ref = reference_on_routes(lambda **forced: reference(x, **forced), **decided).out
    w = torch.randn(ref.shape, generator=seeded(seed + 1)).to(DEVICE)
    leaves = [x[n] for n in grad]
    grads = torch.autograd.grad((out * w).sum(), leaves, retain_graph=True)
    ref_grads = torch.autograd.grad((ref * w).sum(), leaves)
    assert_close(out.cpu(), ref.cpu(), FWD_TOL_CUDA, "forward")
    floor = grad_floor(ref_grads)
    for n, a, b in zip(grad, grads, ref_grads):
        assert_close(a.cpu(), b.cpu(), GRAD_TOL_CUDA, f"d{n}", floor=floor)


LAYOUTS = ["snapshot", "versioned"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("growth", ["plateau", "full"])
def test_ovq_flex_equals_reference(layout, growth):
    kw = dict(chunk_size=64, max_centroids=96, growth=growth)

    def fused(x):
        out, state = ovqflex.ovq_attention(x["q"], x["k"], x["v"], x["beta"], backend=TRAIN_BACKEND,
                                           state_layout=layout, checkpoint_every=2, return_state=True, **kw)
        return out, {"routes": state.routes}

    def reference(r, **forced):
        return ovq_attention_reference(r["q"], r["k"], r["v"], r["beta"], **kw, **forced)

    compare(fused, reference, _inputs(1), "q k v beta".split(), ("q", "k", "v", "beta"), seed=1)


KVM_NAMES = "q k v gate ln_s_weight ln_s_bias tau_state tau_bswa".split()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("budget", ["fixed-capped", "power_law"])
def test_kvm_flex_equals_reference(layout, budget):
    kw = dict(chunk_size=32, n_bswa_chunks=2, sink_len=1, **(
        dict(budget="fixed", max_state_chunks=2) if budget == "fixed-capped" else
        dict(budget="power_law", growth_factor=4.0, max_state_chunks=None)))

    def fused(x):
        params = {n: x[n] for n in KVM_NAMES[3:]}
        out, state = ovqflex.kvm_attention(x["q"], x["k"], x["v"], backend=TRAIN_BACKEND, state_layout=layout,
                                           return_state=True, checkpoint_every=2, **params, **kw)
        return out, {"routes": state.routes, "founder": state.founder}

    def reference(r, **forced):
        return kvm_attention_reference(r["q"], r["k"], r["v"], **{n: r[n] for n in KVM_NAMES[3:]}, **kw, **forced)

    t = _inputs(2)
    t["q"], t["k"] = F.layer_norm(t["q"], (D,)), F.layer_norm(t["k"], (D,))  # the op takes normalized q, k
    compare(fused, reference, t, KVM_NAMES, tuple(KVM_NAMES), seed=2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vq_flex_equals_reference(layout):
    def fused(x):
        out, aux = ovqflex.vq_attention(x["q"], x["k"], x["v"], x["codebook"], x["beta"], chunk_size=32,
                                        backend=TRAIN_BACKEND, state_layout=layout, checkpoint_every=2)
        return out, {"codes": aux["codes"]}

    def reference(r, **forced):
        return vq_attention_reference(r["q"], r["k"], r["v"], r["codebook"], r["beta"], chunk_size=32, **forced)

    # keys: a state-read token gets its code's mean key gradient (ovqflex.ops.vq), not the quadratic form's
    compare(fused, reference, _inputs(3), "q k v codebook beta".split(), ("q", "v", "beta"), seed=3)


def _plain(x, backend, kw):
    """``causal_attention`` without window arguments, ``sliding_window_attention`` with them."""
    op = ovqflex.sliding_window_attention if kw else ovqflex.causal_attention
    return op(x["q"], x["k"], x["v"], backend=backend, **kw)


@pytest.mark.parametrize("kw", [dict(window=50, n_sinks=4), dict(block_window=2, chunk_size=64), dict()],
                         ids=["swa-sinks", "bswa", "causal"])
def test_plain_flex_equals_dense(kw):
    compare(lambda x: (_plain(x, TRAIN_BACKEND, kw), {}), lambda r: SimpleNamespace(out=_plain(r, "dense", kw)),
            _inputs(4), "q k v".split(), ("q", "k", "v"), seed=4)


@pytest.mark.parametrize("name", ["linear", "delta", "vla"])
def test_linear_recurrences_equal_reference(name):
    """DeltaNet and VLA in more than 16 chunks (19 and 30), so on CUDA they run the blocked scan
    (``recurrences.delta.delta_chunks``)."""
    t = _inputs(5)
    t["k_unit"] = F.normalize(t["k"], dim=-1)
    ops = {"linear": (lambda x: ovqflex.linear_attention(x["q"], x["k"], x["v"]),
                      lambda r: linear_attention_reference(r["q"], r["k"], r["v"]), "q k v"),
           "delta": (lambda x: ovqflex.delta_rule(x["q"], x["k_unit"], x["v"], x["beta_t"], chunk_size=16),
                     lambda r: delta_rule_reference(r["q"], r["k_unit"], r["v"], r["beta_t"]), "q k_unit v beta_t"),
           "vla": (lambda x: ovqflex.vla_attention(x["q"], x["k"], x["v"], x["u"], chunk_size=10),
                   lambda r: vla_reference(r["q"], r["k"], r["v"], r["u"]), "q k v u")}
    op, ref, names = ops[name]
    names = names.split()
    compare(lambda x: (op(x), {}), ref, t, names, tuple(names), seed=5)


def _bf16_close(out, ref, leaves, seed):
    w = torch.randn(out.shape, generator=seeded(seed)).to(out)
    grads = torch.autograd.grad((out * w).float().sum(), leaves, retain_graph=True)
    ref_grads = torch.autograd.grad((ref * w).float().sum(), leaves)
    assert_close(out.float().cpu(), ref.float().cpu(), FWD_TOL[torch.bfloat16], "bf16 forward")
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        assert_close(a.cpu(), b.cpu(), GRAD_TOL[torch.bfloat16], f"bf16 grad of leaf {i}", floor=0.1)


@pytest.mark.parametrize("method", ["ovq", "kvm", "vq"])
def test_bf16_fused_routes_like_the_reference(method):
    """The dtype rule: in bf16, on the same inputs, the fused op (flex on CUDA) takes the same
    discrete decisions as the reference loop (up to near-ties), and its outputs and gradients are
    within bf16 tolerances of it (the reference computes in fp32 from the bf16 inputs)."""
    t = _inputs(6)
    x = {n: v.to(DEVICE) for n, v in t.items()}
    leaves = [x[n].requires_grad_() for n in ("q", "k", "v")]
    q, k, v = (a.bfloat16() for a in leaves)
    if method == "ovq":
        kw = dict(chunk_size=64, max_centroids=96)
        out, state = ovqflex.ovq_attention(q, k, v, x["beta"], backend=TRAIN_BACKEND, return_state=True, **kw)
        ref = reference_on_routes(lambda **forced: ovq_attention_reference(q, k, v, x["beta"], **kw, **forced),
                                  routes=state.routes)
    elif method == "kvm":
        q, k = F.layer_norm(q, (D,)), F.layer_norm(k, (D,))
        params = {n: x[n] for n in KVM_NAMES[4:]} | {"gate": x["gate"].bfloat16()}
        kw = dict(chunk_size=32, budget="power_law", growth_factor=4.0, max_state_chunks=None)
        out, state = ovqflex.kvm_attention(q, k, v, backend=TRAIN_BACKEND, return_state=True, **params, **kw)
        ref = reference_on_routes(lambda **forced: kvm_attention_reference(q, k, v, **params, **kw, **forced),
                                  routes=state.routes, founder=state.founder)
    else:
        out, aux = ovqflex.vq_attention(q, k, v, x["codebook"], x["beta"], chunk_size=32, backend=TRAIN_BACKEND)
        ref = reference_on_routes(
            lambda **forced: vq_attention_reference(q, k, v, x["codebook"], x["beta"], chunk_size=32, **forced),
            codes=aux["codes"])
        leaves = [leaves[0], leaves[2]]  # keys: the code's mean gradient by design (see above)
    assert out.dtype == torch.bfloat16
    _bf16_close(out, ref.out, leaves, seed=6)


# method -> the op on bf16 q, k, v and the fp32 parameters of _inputs
AUTOCAST_OPS = {
    "ovq": lambda q, k, v, x: ovqflex.ovq_attention(q, k, v, x["beta"], chunk_size=64, max_centroids=96,
                                                    backend=TRAIN_BACKEND),
    "kvm": lambda q, k, v, x: ovqflex.kvm_attention(q, k, v, x["gate"].bfloat16(), **{n: x[n] for n in KVM_NAMES[4:]},
                                                    chunk_size=32, budget="power_law", growth_factor=4.0,
                                                    max_state_chunks=None, backend=TRAIN_BACKEND),
    "vq": lambda q, k, v, x: ovqflex.vq_attention(q, k, v, x["codebook"], x["beta"], chunk_size=32,
                                                  backend=TRAIN_BACKEND)[0],
}


@pytest.mark.parametrize("method", list(AUTOCAST_OPS))
def test_bf16_op_under_autocast_computes_as_without_it(method):
    """On bf16 inputs the OVQ, KVM and VQ ops give the same bits, output and gradients, under bf16 autocast as
    without it. CUDA's autocast runs ``layer_norm`` and the norms in fp32 (the CPU's keeps their input's dtype):
    KVM's ``LN_s`` had made the memory keys and the key sums fp32 in a bf16 CUDA layer, and OVQ's and VQ's unit
    queries and keys were fp32 before their rounding; both run with autocast off now (docs/precision.md). On
    the CPU the same check runs with CUDA's autocast rule followed (``tests/ovqflex/ops/test_dtypes.py``)."""
    x = {n: t.to(DEVICE) for n, t in _inputs(7).items()}
    q, k = (F.layer_norm(x[n], (D,)).bfloat16() for n in ("q", "k"))
    runs = []
    for autocast in (False, True):
        leaves = [t.detach().requires_grad_() for t in (q, k, x["v"].bfloat16())]
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=autocast):
            out = AUTOCAST_OPS[method](*leaves, x)
        w = torch.randn(out.shape, generator=seeded(8)).to(DEVICE)
        runs.append((out, torch.autograd.grad((out.float() * w).sum(), leaves)))
    (plain, grads), (under, grads_under) = runs
    assert under.dtype == plain.dtype == torch.bfloat16
    assert torch.equal(under, plain)
    for n, a, b in zip("qkv", grads, grads_under):
        assert torch.equal(a, b), f"d{n}"


ROUTING_T = 4096


@pytest.mark.parametrize("method", ["ovq", "kvm"])
def test_auto_routing_replays_a_cached_cuda_graph_with_the_loops_routes(method):
    """The ops' default ``routing="auto"`` on CUDA: the static router, compiled and replayed from one
    CUDA graph, built once per input shape (:func:`recurrences.compiling.static_router`). Its routes
    equal the chunk loop's in fp32 at T = 4k (OVQ N = 512 plateau, KVM power law uncapped), on two
    different inputs (the second call replays the same graph on new keys). A CPU dry run, where
    ``"auto"`` is the loop, checks ``"static"`` (a cached router without a graph) instead."""
    from recurrences import compiling
    from recurrences.kvm import KVMBudget, KVMSchedule, route_kvm
    from recurrences.ovq import DictionarySchedule, route_ovq

    compiling.clear_static_routers()
    impl = "auto" if DEVICE.type == "cuda" else "static"
    g = seeded(8)
    for call in range(2):
        k = F.normalize(torch.randn(1, 4, ROUTING_T, 64, generator=g), dim=-1).to(DEVICE)
        if method == "ovq":
            kw = dict(schedule=DictionarySchedule(128, 512))
            routes, loop = route_ovq(k, impl=impl, **kw), route_ovq(k, impl="loop", **kw)
        else:
            kw = dict(schedule=KVMSchedule(128, 2, KVMBudget("power_law", max_state_chunks=None)), sink_len=1)
            gate, w, b = 1 + torch.rand(1, 4, ROUTING_T, generator=g), torch.ones(64), torch.zeros(64)
            args = (F.layer_norm(k, (64,)), gate.to(DEVICE), w.to(DEVICE), b.to(DEVICE))
            routes, loop = route_kvm(*args, impl=impl, **kw), route_kvm(*args, impl="loop", **kw)
            assert torch.equal(routes[1], loop[1]), f"founders differ from the loop's (call {call})"
            routes, loop = routes[0], loop[0]
        assert torch.equal(routes, loop), f"routes differ from the loop's on {(routes != loop).sum()} tokens"
    routers = list(compiling._ROUTERS.values())
    assert len(routers) == 1, "the second call must reuse the first call's router"
    assert (routers[0].graph is not None) == (DEVICE.type == "cuda")
    compiling.clear_static_routers()


NO_GRAD_T = 4096


WHOLE_OPS = ["ovq", "ovq-versioned", "kvm", "vq", "swa"]


def _whole_op(method: str, seed: int, T: int = NO_GRAD_T) -> tuple[dict, Callable]:
    """Inputs ``[1, 2, T, 64]`` on DEVICE (default T: NO_GRAD_T) and ``op(backend, inputs) -> out`` of one
    whole op with the GPU profile's options (OVQ N = 2048, KVM power law, VQ 256 codes, a window with sinks);
    OVQ's and KVM's ``op`` pass keyword arguments on (``return_state=True``)."""
    g = seeded(seed)
    t = {n: torch.randn(1, 2, T, 64, generator=g).to(DEVICE) for n in "qkv"}
    if method.startswith("ovq"):
        t["beta"] = torch.full((2,), 8.0, device=DEVICE)
        layout = "versioned" if method == "ovq-versioned" else "auto"  # versioned: split scans (2.11 inductor)

        def op(backend, t, **kw):
            return ovqflex.ovq_attention(**t, backend=backend, chunk_size=128, max_centroids=2048,
                                         state_layout=layout, **kw)
    elif method == "kvm":
        t["q"], t["k"] = F.layer_norm(t["q"], (64,)), F.layer_norm(t["k"], (64,))
        t.update(ln_s_weight=torch.ones(64, device=DEVICE), ln_s_bias=torch.zeros(64, device=DEVICE))

        def op(backend, t, **kw):
            return ovqflex.kvm_attention(**t, backend=backend, chunk_size=128, budget="power_law",
                                         max_state_chunks=None, **kw)
    elif method == "vq":
        t.update(codebook=torch.randn(2, 256, 64, generator=g).to(DEVICE), beta=torch.full((2,), 8.0, device=DEVICE))

        def op(backend, t):
            return ovqflex.vq_attention(**t, backend=backend, chunk_size=128)[0]
    else:
        def op(backend, t):
            return ovqflex.sliding_window_attention(**t, backend=backend, window=512, n_sinks=4)
    return t, op


@pytest.mark.parametrize("method", WHOLE_OPS)
def test_whole_op_compiled_under_no_grad(method):
    """``torch.compile(lambda t: op(**t, backend="flex"), fullgraph=True, dynamic=False)`` under
    no_grad at T = 4k (the failing call of the CUDA issue) equals the eager blocked op."""
    t, op = _whole_op(method, 7)
    routed = method in ("ovq", "ovq-versioned", "kvm")
    kw = dict(return_state=True) if routed else {}
    compiled = torch.compile(lambda t: op("flex", t, **kw), fullgraph=True, dynamic=False)
    with torch.no_grad():
        out = compiled(t)
        ref = op("blocked", t, **kw)
    if routed:  # the routes first: the compiled op routes on the eager op's keys, bit for bit
        (out, state), (ref, ref_state) = out, ref
        same = (state.routes == ref_state.routes).double().mean().item()
        assert same == 1.0, f"compiled {method} routes {same:.4%} of the tokens as the eager op does"
    assert_close(out.cpu(), ref.cpu(), FWD_TOL_CUDA, f"compiled {method} at T={NO_GRAD_T}")


@pytest.mark.parametrize("grad", [False, pytest.param(True, marks=pytest.mark.skipif(
    DEVICE.type != "cuda", reason="CPU flex has no backward"))], ids=["forward", "forward-backward"])
@pytest.mark.parametrize("method", ["ovq", "vq", "swa"])
def test_flex_output_merges_heads_as_a_view(method, grad):
    """The layers merge heads with ``o.transpose(1, 2).reshape(B, T, H d)``; programs write their queries
    token-major (masks/program.py) and torch lays flex's output out like its query, so on the device that is
    a view of flex's output: no copy, and in training no second copy kept for the output projection. 300
    tokens: the queries are padded, which writes them token-major from the contiguous ones given."""
    t, op = _whole_op(method, 9, T=300)
    t["q"].requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = op("flex", t)
    merged = out.transpose(1, 2).reshape(1, 300, -1)
    assert merged.data_ptr() == out.data_ptr() and merged._base is not None, f"a copy: out strides {out.stride()}"


@pytest.mark.parametrize("method", ["ovq", "vq"])
def test_whole_op_compiled_with_dynamic_shapes_and_keyword_options_under_no_grad(method):
    """``torch.compile(lambda *x: op(*x, backend="flex", **kw), dynamic=True, fullgraph=True)`` under no_grad
    at T = 2,000 equals the eager blocked op. ``dynamic=True`` makes ``kw``'s numbers symbolic; the op takes
    them plain (``recurrences.compiling.plain_options``). On the CPU this once failed to build its C++ kernel
    (``recurrences.compiling.patch_inductor_cpu_flex_split_names``); on CUDA it is Triton's flex kernel with
    a symbolic length."""
    g = seeded(13)
    x = [torch.randn(1, 2, 2000, 64, generator=g).to(DEVICE) for _ in "qkv"]
    if method == "ovq":
        x.append(torch.full((2,), 8.0, device=DEVICE))
        kw = dict(chunk_size=128, max_centroids=512)
        op = ovqflex.ovq_attention
    else:
        x += [torch.randn(2, 256, 64, generator=g).to(DEVICE), torch.full((2,), 8.0, device=DEVICE)]
        kw = dict(chunk_size=128)

        def op(*x, **kw):
            return ovqflex.vq_attention(*x, **kw)[0]
    compiled = torch.compile(lambda *x: op(*x, backend="flex", **kw), dynamic=True, fullgraph=True)
    with torch.no_grad():
        out = compiled(*x)
        ref = op(*x, backend="blocked", **kw)
    assert_close(out.cpu(), ref.cpu(), FWD_TOL_CUDA, f"compiled {method} with dynamic shapes")


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "forward-backward"])
@pytest.mark.parametrize("method", WHOLE_OPS)
def test_eager_op_makes_no_host_sync_after_its_first_call(method, grad):
    """The eager op (flex) waits for the device nowhere once its first call has built what it keeps (the
    routers and their CUDA graphs, the compiled flex kernel, the regions' parameter tensors): its second
    call, forward or forward and backward, runs under ``torch.cuda.set_sync_debug_mode("error")``, so a
    copy from the host or a value read back raises. A sync stalls the host's launches until everything
    queued before it has run. (A CPU dry run calls the op twice without the check.)"""
    t, op = _whole_op(method, 11, T=1000)
    if grad:
        t = {n: x.requires_grad_() if n in "qkv" else x for n, x in t.items()}

    def call():
        with torch.set_grad_enabled(grad):
            out = op(TRAIN_BACKEND if grad else "flex", t)  # flex on CUDA (blocked in a CPU dry run)
            if grad:
                out.sum().backward()

    call()
    if DEVICE.type != "cuda":
        call()
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_state_sums_are_rounded_about_once_on_the_device(layout):
    """The state sums' dtype rule on DEVICE: CUDA's ``index_add_`` and scan add bf16 in bf16, rounding
    every add, so there each cell's tokens are summed in fp32 first and the scans run in fp32
    (``recurrences.segments.NARROW_ADDS``, ``recurrences.scan.NARROW_SCANS``; emulated on the CPU by
    tests/recurrences/test_versioned.py::test_narrow_adds_as_on_cuda_are_summed_in_fp32)."""
    bf16_state_sums_round_about_once(layout, DEVICE)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", ["ovq", "kvm", "vq"])
def test_fp16_state_sums_past_fp16s_range_stay_finite_on_the_device(method, layout):
    """tests/ovqflex/ops/test_dtypes.py's busy rows through flex on the device: the fp16 op keeps its state sums
    in fp32 (CUDA's fp16 atomics had added them in fp16 besides) and equals the fp32 op to fp16's tolerance."""
    got, want = (busy_rows(method, layout, dtype, DEVICE, "flex") for dtype in (torch.float16, torch.float32))
    assert got.dtype == torch.float16 and bool(got.isfinite().all())
    assert_close(got.float().cpu(), want.cpu(), FWD_TOL[torch.float16], f"{method} {layout} fp16")


def test_long_scan_with_broadcast_input_compiles():
    """A cumsum longer than one Triton block over ``x + bias`` (pytorch/pytorch#180221: inductor's
    split-scan code generation fails on it in torch 2.11) compiles through ``recurrences.scan.
    cumsum``, which the versioned sums, the linear recurrences and VLA use; values equal eager."""
    from recurrences.scan import cumsum

    g = seeded(9)
    x, b = torch.randn(1, 4096, 64, generator=g).to(DEVICE), torch.randn(64, generator=g).to(DEVICE)
    out = torch.compile(lambda x, b: cumsum(x + b, 1), fullgraph=True, dynamic=False)(x, b)
    assert_close(out.cpu(), (x + b).cumsum(1).cpu(), FWD_TOL_CUDA, "compiled long cumsum")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_compiled_routing_copies_are_the_eager_bits(dtype):
    """Compiled on the device, the routing copies (opaque custom ops:
    ``recurrences.compiling.eager_kernels``) hold the eager copies' bits: a compiled op routes as
    the eager op does. Inductor's fused copies once differed by fp32 reduction order (up to 2e-6 for
    KVM's ``LN_s`` keys, enough to flip a near-tie route) and, in torch 2.11 on CUDA, dropped an fp32 ->
    bf16 -> fp32 round trip (pytorch/pytorch#179561: ~1e-3)."""
    torch._dynamo.reset()
    x = torch.randn(2, 4, 300, 64, generator=seeded(3)).to(DEVICE)
    args = (x, dtype, *ln_s_params(64, DEVICE))
    got = torch.compile(routing_copies, fullgraph=True)(*args)
    for g, want in zip(got, routing_copies(*args)):
        assert torch.equal(g, want)


def test_a_stack_of_rows_normalizes_as_each_chunk_alone_on_the_device():
    """On the device, the eager row kernels the static routers run on a stack of chunks (every chunk's
    ``LN_s`` keys in one launch; the state's rows) give each chunk's own bits
    (``tests/recurrences/test_kvm_routing_static.py::row_kernels_on_stacks``)."""
    assert row_kernels_on_stacks(DEVICE) == []


def test_references_take_forced_decisions_and_measure_their_gaps_on_the_device():
    """The near-tie rule's second path (``tests/helpers.py::reference_on_routes``), which the tier's
    comparisons take only when the fused op meets a tie, on the device: OVQ forced onto a tie and onto
    a mistake (``tests/test_helpers.py``: gaps 0 and 1, the tie accepted, the mistake refused), and the
    gaps of KVM's and VQ's forced decisions equal the CPU's."""
    from tests.recurrences.test_ovq_reference import BY_HAND_KEYS, BY_HAND_ROUTES as OWN

    k = torch.tensor(BY_HAND_KEYS, device=DEVICE).view(1, 1, 12, 3)
    q = torch.randn(1, 1, 12, 3, generator=seeded(0)).to(DEVICE)
    run = lambda **forced: ovq_attention_reference(q, k, k.flip(-1), torch.ones(1, device=DEVICE), chunk_size=4,  # noqa
                                                   max_centroids=5, growth="full", **forced)
    tie = torch.tensor([{2: 3, 3: 2}.get(r, r) for r in OWN], device=DEVICE).view(1, 1, 12)
    assert (reference_on_routes(run, routes=tie).gaps == 0).all()
    mistake = torch.tensor(OWN[:4] + [2] + OWN[5:], device=DEVICE).view(1, 1, 12)
    with pytest.raises(AssertionError, match=r"falls 1\.000e\+00 short"):
        reference_on_routes(run, routes=mistake)

    t = _inputs(7)
    t["q"], t["k"] = F.layer_norm(t["q"], (D,)), F.layer_norm(t["k"], (D,))
    kw = dict(chunk_size=32, budget="power_law", growth_factor=4.0, max_state_chunks=None)

    def kvm(device, **forced):
        x = {n: t[n].to(device) for n in KVM_NAMES}
        return kvm_attention_reference(x["q"], x["k"], x["v"], **{n: x[n] for n in KVM_NAMES[3:]}, **kw,
                                       **{n: f.to(device) for n, f in forced.items()})

    own = kvm("cpu")
    routes = own.routes.clone()
    merged = ((own.routes[0, 0] >= 0) & ~own.founder[0, 0]).nonzero()[-1, 0]  # head 0's last merge: another row
    routes[0, 0, merged] += -1 if routes[0, 0, merged] > 1 else 1  # (row 0 is the sink)
    forced = dict(routes=routes, founder=own.founder)
    cpu, dev = kvm("cpu", **forced).gaps, kvm(DEVICE, **forced).gaps.cpu()
    assert cpu[0, 0, merged] > 0 and (cpu != 0).sum() == 1
    torch.testing.assert_close(dev, cpu, rtol=1e-4, atol=1e-6)

    codebook = torch.randn(H, 8, D, generator=seeded(8))
    codes = (vq_attention_reference(t["q"], t["k"], t["v"], codebook, t["beta"]).codes + 1) % 8
    cpu = vq_attention_reference(t["q"], t["k"], t["v"], codebook, t["beta"], codes=codes).gaps
    dev = vq_attention_reference(*(t[n].to(DEVICE) for n in "qkv"), codebook.to(DEVICE), t["beta"].to(DEVICE),
                                 codes=codes.to(DEVICE)).gaps.cpu()
    torch.testing.assert_close(dev, cpu, rtol=1e-4, atol=1e-6)
