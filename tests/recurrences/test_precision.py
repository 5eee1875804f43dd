"""The dtype rule at op boundaries (``recurrences.precision``): compute dtype with and without
autocast, casting, fp32 routing keys."""
import pytest
import torch
import torch.nn.functional as F

from recurrences.kvm import routing_memory_keys
from recurrences.precision import compute_dtype, one_plus_elu, rounded, routing_keys, to_compute_dtype, widened

f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64


def _t(dtype):
    return torch.randn(2, 3, dtype=dtype)


@pytest.mark.parametrize("dtypes, plain, autocast", [
    ((f32, f32, f32), f32, bf16),
    ((bf16, bf16, bf16), bf16, bf16),
    ((f32, f32, bf16), f32, bf16),     # CUDA autocast: normalized q, k in fp32, projected v in bf16
    ((bf16, f32, None), f32, bf16),    # None (an absent gate) takes no part
    ((f32, f64, f32), f64, f64),       # autocast never touches float64
], ids=["fp32", "bf16", "qk-fp32-v-bf16", "with-none", "fp64"])
def test_compute_dtype(dtypes, plain, autocast):
    xs = [None if d is None else _t(d) for d in dtypes]
    assert compute_dtype(*xs) == plain
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(*xs) == autocast
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert compute_dtype(*xs) == plain


def test_to_compute_dtype_casts_all_and_keeps_none_and_same_objects():
    q, k, v = _t(f32), _t(f32), _t(bf16)
    out = to_compute_dtype(q, k, v, None)
    assert [x.dtype for x in out[:3]] == [f32] * 3 and out[3] is None
    assert out[0] is q and torch.equal(out[2], v.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = to_compute_dtype(q, k, v)
    assert [x.dtype for x in out] == [bf16] * 3 and out[2] is v


def test_compute_dtype_traces_under_compile_with_autocast():
    def f(a, b):
        a, b = to_compute_dtype(a, b)
        return a + b

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    a, b = _t(f32), _t(bf16)
    assert compiled(a, b).dtype == f32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compiled(a, b).dtype == bf16


@pytest.mark.parametrize("dtype", [f32, bf16, f64], ids=["fp32", "bf16", "fp64"])
def test_routing_keys_are_fp32_unit_copies(dtype):
    k = torch.randn(2, 3, 5, 8, dtype=dtype, requires_grad=True)
    r = routing_keys(k)
    assert r.dtype == f32 and not r.requires_grad
    assert torch.equal(r, F.normalize(k.detach().float(), dim=-1))
    assert torch.allclose(r.norm(dim=-1), torch.ones(2, 3, 5))


def routing_copies(x, dtype, ln_w, ln_b):
    """Keys computed in the graph (fp32 math rounded to ``dtype``) and the routing copies of them (KVM's
    with ``LN_s`` parameters ``ln_w, ln_b [D]``: inputs, as a layer's parameters are).

    The keys' fp32 math is exact up to its one rounding (``2x`` is exact, so ``2x + 0.5`` rounds once
    whether or not a compiler contracts it into a fused multiply-add): compiled and eager code hold the
    same fp32 values before the cast, and only a dropped cast can make their copies differ. With
    ``x * 1.37 + 0.1`` a contracted FMA moved a few fp32 values across an fp16 rounding boundary (one
    fp16 ulp in the cuda tier on an H100, torch 2.11)."""
    k = (x * 2 + 0.5).to(dtype)
    return routing_keys(k), routing_memory_keys(k, 4, ln_w, ln_b)


def ln_s_params(D: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``LN_s`` weight and bias ``[D]`` for :func:`routing_copies`."""
    return torch.linspace(0.5, 1.5, D, device=device), torch.linspace(-0.1, 0.1, D, device=device)


@pytest.mark.parametrize("dtype", [bf16, torch.float16, f32], ids=["bf16", "fp16", "fp32"])
def test_compiled_routing_copies_are_the_eager_bits(dtype):
    """Compiled, each routing copy is one opaque call (``ovqflex::unit_keys``, ``ovqflex::ln_s_keys``:
    :func:`~recurrences.compiling.eager_kernels`) and holds the eager copy's bits, so a compiled op
    routes as the eager op does. Inductor's own fused ``F.normalize`` and ``LN_s`` of fp32 keys differed
    from ATen's in about a fifth and a third of the entries (by up to 6e-8 and 2e-6)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(2, 4, 256, 64, generator=torch.Generator().manual_seed(0))
    args = (x, dtype, *ln_s_params(64))
    torch.compile(routing_copies, backend=capture, fullgraph=True)(*args)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert [t for t in targets if "ovqflex" in t] == ["ovqflex.unit_keys.default", "ovqflex.ln_s_keys.default"]
    got = torch.compile(routing_copies, fullgraph=True, dynamic=False)(*args)
    for g, want in zip(got, routing_copies(*args)):
        assert g.dtype == f32 and torch.equal(g, want)


def widened_chain(x, dtype):
    """A layer's elementwise chain in fp32, rounded once to ``dtype``, then read in fp32 (as a norm
    under autocast reads it)."""
    return rounded(1.0 + F.elu(widened(x.to(dtype)) * 1.37), dtype).float() * 2


@pytest.mark.parametrize("dtype, barriers", [(bf16, 1), (torch.float16, 1), (f32, 0)], ids=["bf16", "fp16", "fp32"])
def test_rounded_chains_pass_a_real_buffer_when_compiled(dtype, barriers):
    """:func:`rounded` is ``x.to(dtype)``; compiled, a bf16/fp16 result passes ``ovqflex::realize`` (its
    reader cannot skip the rounding), an fp32 one none; :func:`widened` keeps fp32 and fp64 as they are."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    got = torch.compile(widened_chain, backend=capture, fullgraph=True)(x, dtype)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("ovqflex.realize" in t for t in targets) == barriers
    assert torch.equal(got, widened_chain(x, dtype))
    assert torch.equal(rounded(x, dtype), x.to(dtype))
    assert widened(x.to(dtype)).dtype == f32 and widened(x.double()).dtype == torch.float64


def test_routing_copy_ops_pass_opcheck_on_strided_keys():
    """The routing-copy custom ops' schemas, fakes and (absent) autograd agree with their kernels
    (``torch.library.opcheck``), on keys with a layer's ``[B, T, H, D] -> [B, H, T, D]`` strides."""
    k = torch.randn(2, 64, 3, 8, generator=torch.Generator().manual_seed(0)).transpose(1, 2)
    torch.library.opcheck(torch.ops.ovqflex.unit_keys.default, (k,))
    torch.library.opcheck(torch.ops.ovqflex.ln_s_keys.default, (k, 2, *ln_s_params(8), 1e-5))


def test_one_plus_elu_keeps_its_relative_precision_and_elus_gradient():
    """``1 + elu(x)`` is ``exp(x)`` for ``x <= 0``: computed so, every value is within an ulp or two of the
    float64 truth, where ``F.elu(x) + 1`` loses ``exp(x)`` to the cancellation (0 below -17 in fp32). The
    gradient is elu's: ``exp(x)``, and 1 at 0 and above."""
    x = torch.cat([torch.linspace(-80, 10, 2001), torch.zeros(1)]).requires_grad_()
    x64 = x.detach().double()  # the same values
    exact = torch.where(x64 > 0, 1 + x64, torch.exp(x64))
    y = one_plus_elu(x)
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert y.dtype == torch.float32 and ((y.double() - exact) / exact).abs().max() < 3e-7
    assert ((grad.double() - torch.where(x64 >= 0, 1.0, torch.exp(x64))) / exact).abs().max() < 3e-7
    naive = F.elu(x.detach()) + 1
    assert ((naive.double() - exact) / exact).abs().max() == 1  # the regime: elu + 1 rounds to 0 there
    assert one_plus_elu(x64).dtype == torch.float64 and torch.allclose(one_plus_elu(x64), exact, rtol=1e-15, atol=0)
