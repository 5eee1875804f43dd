"""VQ-attention: linear form (one attention program) == quadratic form (docs/design.md §4.4, §9.5)."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ovqflex
from recurrences.reference import vq_attention_reference
from tests.helpers import (FWD_TOL, GRAD_TOL, assert_close, default_floats, dynamo_restarts, float64_leaves,
                           grad_floor, reference_on_routes)


@st.composite
def vq_cases(draw):
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    D = draw(st.sampled_from([16, 32]))
    C = draw(st.sampled_from([16, 32, 64]))
    T = draw(st.one_of(st.integers(1, 2 * C), st.integers(2 * C, 512)))
    N = draw(st.sampled_from([1, 3, 16, 64]))
    kw = dict(chunk_size=C, estimator=draw(st.sampled_from(["ste", "diveq"])))
    return B, H, D, T, N, kw, draw(st.booleans()), draw(st.integers(0, 2**16))


def inputs(B, H, D, T, N, seed, requires_grad=True, on_codes=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    codebook = torch.randn(H, N, D, generator=g)
    if on_codes:  # every key exactly a (unit) code: tokens of one code share the normalize Jacobian
        idx = torch.randint(0, N, (B, H, T), generator=g)
        k = F.normalize(codebook, dim=-1)[torch.arange(H).view(1, H, 1), idx]
    beta = D**0.5 * (0.5 + torch.rand(H, generator=g))
    local = torch.randn(H, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, codebook, beta, local)]


def _case_id(case):
    B, H, D, T, N, kw, local, _ = case
    return f"B{B}H{H}D{D}T{T}N{N}C{kw['chunk_size']}-{kw['estimator']}{'-local' if local else ''}"


@settings(max_examples=100)
@given(vq_cases())
def test_linear_form_equals_quadratic_form(case):
    """Forward (<= 1e-5) and the gradients of q, v, beta, local bias and (DiVeQ) codebook
    (<= 1e-4) equal the quadratic form's, run in float64 on the same inputs (``float64_leaves``); keys that
    no query reads through the state (the last two chunks) get their exact key gradient."""
    B, H, D, T, N, kw, local, seed = case
    q, k, v, cb, beta, lb = inputs(B, H, D, T, N, seed)
    lb = lb if local else None
    out, aux = ovqflex.vq_attention(q, k, v, cb, beta, local_bias=lb, backend="blocked", **kw)
    wide = float64_leaves([q, k, v, cb, beta, lb])
    # codes first (docs/design.md §9): the reference's, up to near-ties
    ref = reference_on_routes(lambda **forced: vq_attention_reference(*wide[:5], local_bias=wide[5], **kw, **forced),
                              codes=aux["codes"])
    assert_close(out, ref.out, FWD_TOL[torch.float32], f"{_case_id(case)} forward")
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    names, which = ["q", "k", "v", "beta"], [0, 1, 2, 4]
    if local:
        names, which = names + ["local_bias"], which + [5]
    if kw["estimator"] == "diveq":
        names, which = names + ["codebook"], which + [3]
    mine = [q, k, v, cb, beta, lb]
    grads = dict(zip(names, torch.autograd.grad((out * w).sum(), [mine[i] for i in which])))
    ref_grads = dict(zip(names, torch.autograd.grad((ref.out * w.double()).sum(), [wide[i] for i in which])))
    floor = grad_floor(ref_grads.values())
    for name in names:
        if name in ("k", "codebook"):
            continue
        assert_close(grads[name], ref_grads[name], GRAD_TOL[torch.float32], f"{_case_id(case)} d{name}", floor=floor)
    C = kw["chunk_size"]
    never_in_state = max(0, (-(-T // C) - 2) * C)  # tokens of the last two chunks
    assert_close(grads["k"][:, :, never_in_state:], ref_grads["k"][:, :, never_in_state:],
                 GRAD_TOL[torch.float32], f"{_case_id(case)} dk (window-only tokens)", floor=floor)
    if kw["estimator"] == "diveq" and T <= 2 * C:  # no state: codebook gradient exact too
        assert_close(grads["codebook"], ref_grads["codebook"], GRAD_TOL[torch.float32], "dcodebook", floor=floor)


@pytest.mark.parametrize("T, C, N", [(300, 32, 8), (512, 64, 16), (200, 16, 3)], ids=["T300C32N8", "T512C64N16",
                                                                                      "T200C16N3"])
def test_key_gradient_per_code_sums_equal_quadratic_form(T, C, N):
    """Straight-through key gradients: a token read through the state gets its code's mean
    gradient, so per-code sums of dk equal the quadratic form's (keys on codes, so all tokens
    of a code share the normalization Jacobian), while per-token gradients do differ."""
    q, k, v, cb, beta, lb = inputs(2, 2, 16, T, N, seed=T, on_codes=True)
    out, aux = ovqflex.vq_attention(q, k, v, cb, beta, chunk_size=C, local_bias=lb, backend="blocked")
    ref = reference_on_routes(
        lambda **forced: vq_attention_reference(q, k, v, cb, beta, chunk_size=C, local_bias=lb, **forced),
        codes=aux["codes"])
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    dk = torch.autograd.grad((out * w).sum(), k)[0]
    dk_ref = torch.autograd.grad((ref.out * w).sum(), k)[0]
    onehot = F.one_hot(ref.codes, N).to(dk.dtype)
    per_code = torch.einsum("bhtn,bhtd->bhnd", onehot, dk)
    per_code_ref = torch.einsum("bhtn,bhtd->bhnd", onehot, dk_ref)
    assert_close(per_code, per_code_ref, GRAD_TOL[torch.float32], "per-code sums of dk")
    assert dk.abs().sum() > 0
    assert (dk - dk_ref).abs().max() > 1e-3, "per-token dk would be exact: update the documented gradient rule"


@pytest.mark.parametrize("T, C, N, local", [(300, 32, 8, True), (256, 64, 64, False), (100, 16, 5, True)],
                         ids=["T300-local", "T256", "T100-local"])
def test_flex_and_dense_forward_equal_quadratic_form(T, C, N, local):
    q, k, v, cb, beta, lb = inputs(1, 2, 32, T, N, seed=T, requires_grad=False)
    lb = lb if local else None
    ref = vq_attention_reference(q, k, v, cb, beta, chunk_size=C, local_bias=lb).out
    with torch.no_grad():
        for backend in ("flex", "dense"):
            out, _ = ovqflex.vq_attention(q, k, v, cb, beta, chunk_size=C, local_bias=lb, backend=backend)
            assert_close(out, ref, FWD_TOL[torch.float32], backend)


def test_op_aux_metrics_and_commitment_gradient():
    q, k, v, cb, beta, _ = inputs(1, 2, 16, 64, 4, seed=5)
    out, aux = ovqflex.vq_attention(q, k, v, cb, beta, chunk_size=16, backend="blocked")
    assert set(aux) == {"codes", "commitment", "usage", "perplexity", "unused_codes", "rel_quant_error"}
    assert 0 < aux["usage"] <= 1 and 1 <= aux["perplexity"] <= 4
    assert torch.allclose(aux["commitment"], aux["rel_quant_error"])  # unit keys: same quantity
    dk, dcb = torch.autograd.grad(aux["commitment"], (k, cb), allow_unused=True)
    assert dk.abs().sum() > 0 and dcb is None  # commits keys to codes, never moves the codebook


@pytest.mark.parametrize("kw, match", [
    (dict(codebook=torch.randn(3, 4, 16)), "codebook"), (dict(codebook=torch.randn(2, 4, 8)), "codebook"),
    (dict(beta=torch.ones(3)), "beta"), (dict(chunk_size=20), "chunk_size"), (dict(estimator="gumbel"), "estimator"),
    (dict(local_bias=torch.ones(1)), "local_bias"), (dict(code_bias=torch.ones(2, 3)), "code_bias"),
    (dict(block_size=0), "block_size must be a power of two >= 16 \\(16, 32, 64, 128, ...\\), got 0"),
    (dict(codebook=torch.randn(2, 0, 16)), r"codebook must have shape \[H, N, D\]=\[2, N>=1, 16\], got \(2, 0, 16\)"),
    (dict(codebook=torch.ones(2, 4, 16, dtype=torch.int64)),
     "codebook must be a floating tensor on cpu, got torch.int64"),
], ids=["codebook-H", "codebook-D", "beta", "chunk", "estimator", "local_bias", "code_bias", "block-0", "codebook-N0",
        "codebook-int"])
def test_bad_arguments(kw, match):
    q, k, v, cb, beta, _ = inputs(1, 2, 16, 40, 4, seed=0, requires_grad=False)
    args = dict(codebook=cb, beta=beta) | kw
    with pytest.raises((ValueError, TypeError), match=match):
        ovqflex.vq_attention(q, k, v, args.pop("codebook"), args.pop("beta"), **args)


def test_reference_builds_every_tensor_on_the_inputs_device():
    """The quadratic-form reference makes its index and mask tensors on q's device (it runs on
    CUDA inputs in the cuda tier); on the meta device a CPU-made tensor would raise."""
    q, k, v = (torch.randn(1, 2, 40, 8, device="meta") for _ in range(3))
    cb, beta = torch.randn(2, 5, 8, device="meta"), torch.ones(2, device="meta")
    for lb in (None, torch.zeros(2, device="meta")):
        res = vq_attention_reference(q, k, v, cb, beta, chunk_size=8, local_bias=lb)
        assert res.out.device.type == "meta" and res.out.shape == (1, 2, 40, 8)


@pytest.mark.slow
def test_compiled_flex_under_dynamic_shapes_with_keyword_options_equals_the_eager_op():
    """``torch.compile(lambda *x: vq_attention(*x, backend="flex", **kw), dynamic=True)`` under no_grad, at
    two lengths on one side of the block-count guards (one graph): equal to the eager op. ``dynamic=True``
    makes ``kw``'s numbers symbolic (the op takes them plain: ``recurrences.compiling.plain_options``).
    This failed to build its C++ kernel before ``recurrences.compiling.patch_inductor_cpu_flex_split_names``
    (the symbolic options' extra sizes met torch's text replace of the split sizes' names). Traced once:
    no float of the op's own restarts dynamo's analysis (docs/design.md §3.5). Slow (~32 s cold): the
    default run checks the same with the OVQ op (tests/ovqflex/ops/test_ovq.py) and the mend itself
    (tests/recurrences/test_compiling.py)."""
    from torch._dynamo.utils import counters

    kw = dict(backend="flex", chunk_size=16)

    def op(*x):  # q, k, v, codebook, beta
        return ovqflex.vq_attention(*x, **kw)[0]

    xs = {T: inputs(1, 2, 16, T, 32, seed=T, requires_grad=False)[:5] for T in (200, 250)}
    with torch.no_grad(), dynamo_restarts() as restarts, default_floats() as floats:
        want = {T: op(*x) for T, x in xs.items()}  # (eager flex compiles its kernel: counted before)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(op, dynamic=True, fullgraph=True)
        for T, x in xs.items():
            assert_close(compiled(*x), want[T], FWD_TOL[torch.float32], f"T={T}")
    assert counters["stats"]["unique_graphs"] == 1
    assert not restarts, restarts
    assert not floats, floats
