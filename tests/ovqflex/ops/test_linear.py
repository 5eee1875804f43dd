"""Non-softmax recurrent ops (``ovqflex.linear_attention``, ``delta_rule``, ``vla_attention``):
input validation (docs/design.md §2), causality and batch independence (§9.3-4)."""
import pytest
import torch
import torch.nn.functional as F

import ovqflex
from recurrences.reference import linear_attention_reference, vla_reference
from tests.helpers import FWD_TOL, assert_close
from tests.recurrences.recurrent_cases import one_thread  # noqa: F401


def _args(name, B=2, H=2, T=37, D=6, dtype=torch.float32):
    q, k, v, u = (torch.randn(B, H, T, D, dtype=dtype) for _ in range(4))
    if name == "linear":
        return (q, k, v), {}
    if name == "delta":
        return (q, F.normalize(k, dim=-1), v, torch.rand(B, H, T, dtype=dtype)), {"chunk_size": 16}
    return (q, k, v, u), {"chunk_size": 10}


OPS = {"linear": ovqflex.linear_attention, "delta": ovqflex.delta_rule, "vla": ovqflex.vla_attention}


@pytest.mark.parametrize("name", list(OPS))
def test_causal_and_batch_independent(name):
    args, kw = _args(name)
    args = [a.clone().requires_grad_() for a in args]
    out = OPS[name](*args, **kw)
    assert out.shape == (2, 2, 37, 6) and out.dtype == torch.float32
    t = 20
    grads = torch.autograd.grad(out[:, :, t].sum(), args)
    for i, g in enumerate(grads):
        assert g[:, :, t + 1:].abs().max() == 0, f"input {i} at j > {t} reaches output {t}"
        assert g[:, :, :t + 1].abs().max() > 0
    # batch independence: the first row alone gives the same output
    alone = OPS[name](*[a[:1] for a in args], **kw)
    assert torch.allclose(alone, out[:1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", list(OPS))
def test_bf16_in_bf16_out(name):
    args, kw = _args(name)
    out = OPS[name](*[a.bfloat16() for a in args], **kw)
    ref = OPS[name](*[a.bfloat16().float() for a in args], **kw)
    assert out.dtype == torch.bfloat16 and torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2)


def _bad(name, change):
    args, kw = _args(name)
    return change(list(args), kw)


BAD = [
    ("linear", lambda a, kw: ([a[0][0], *a[1:]], kw), ValueError, r"q must have 4 dims, got shape \(2, 37, 6\)"),
    ("linear", lambda a, kw: ([a[0], a[1][..., :5], a[2]], kw), ValueError, "q and k must share the head dim D"),
    ("linear", lambda a, kw: (a, {"chunk_size": 0}), ValueError, "chunk_size must be >= 1, got 0"),
    ("linear", lambda a, kw: (a, {"eps": 0.0}), ValueError, "eps must be a finite number > 0, got 0.0"),
    ("delta", lambda a, kw: ([*a[:3], a[3][..., :-1]], kw), ValueError,
     r"beta must have shape \(2, 2, 37\), got \(2, 2, 36\)"),
    ("delta", lambda a, kw: ([*a[:3], a[3].long()], kw), TypeError, "beta must be a floating tensor"),
    ("delta", lambda a, kw: ([*a[:3], "0.5"], kw), TypeError, "beta must be a torch.Tensor, got str"),
    ("vla", lambda a, kw: ([*a[:3], a[3][..., :4]], kw), ValueError,
     r"u must have shape \(2, 2, 37, 6\), got \(2, 2, 37, 4\)"),
    ("vla", lambda a, kw: (a, {"chunk_size": 7}), ValueError, "chunk_size must divide refresh_every=20"),
    ("vla", lambda a, kw: (a, {"lambda0": -1.0}), ValueError, "lambda0 must be a finite number > 0, got -1.0"),
    ("vla", lambda a, kw: (a, {"refresh_every": 2.5}), TypeError, "refresh_every must be an int, got float 2.5"),
]


@pytest.mark.parametrize("name,change,exc,match", BAD,
                         ids=["linear-rank", "linear-head-dim", "linear-chunk0", "linear-eps0",
                              "delta-beta-shape", "delta-beta-int", "delta-beta-str",
                              "vla-u-shape", "vla-chunk", "vla-lambda0", "vla-refresh-float"])
def test_bad_inputs_refused(name, change, exc, match):
    args, kw = _bad(name, change)
    with pytest.raises(exc, match=match):
        OPS[name](*args, **kw)


def _state(name):
    """The op's final state after the first 20 tokens (what a decode cache carries)."""
    args, kw = _args(name)
    _, state = OPS[name](*[a[:, :, :20] for a in args], output_final_state=True, **kw)
    return state


BAD_STATES = [
    ("linear", lambda s: (s.S, s.z), TypeError, "initial_state must be a LinearState, got tuple"),
    ("linear", lambda s: s._replace(z=s.z[..., :5]), ValueError,
     r"initial_state.z must have shape \(2, 2, 6\), got \(2, 2, 5\)"),
    ("linear", lambda s: s._replace(S=s.S.long()), TypeError, "initial_state.S must be a floating tensor"),
    ("delta", lambda s: s.transpose(0, 1)[:1], ValueError,
     r"initial_state must have shape \(2, 2, 6, 6\), got \(1, 2, 6, 6\)"),
    ("vla", lambda s: s._replace(A=s.A[..., :3]), ValueError,
     r"initial_state.A must have shape \(2, 2, 6, 6\), got \(2, 2, 6, 3\)"),
    ("vla", lambda s: s._replace(position=-3), ValueError, "initial_state.position must be >= 0, got -3"),
]


@pytest.mark.parametrize("name,change,exc,match", BAD_STATES,
                         ids=["linear-tuple", "linear-z-shape", "linear-S-int", "delta-S-shape", "vla-A-shape",
                              "vla-position"])
def test_bad_initial_state_refused(name, change, exc, match):
    args, kw = _args(name)
    with pytest.raises(exc, match=match):
        OPS[name](*[a[:, :, 20:] for a in args], initial_state=change(_state(name)), **kw)


@pytest.mark.parametrize("name", list(OPS))
def test_continuation_equals_one_pass(name):
    args, kw = _args(name)
    full = OPS[name](*args, **kw)
    first, state = OPS[name](*[a[:, :, :20] for a in args], output_final_state=True, **kw)
    rest = OPS[name](*[a[:, :, 20:] for a in args], initial_state=state, **kw)
    assert torch.allclose(torch.cat([first, rest], 2), full, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", list(OPS))
def test_no_tokens_leave_the_state_as_it_was(name):
    """A call with no tokens (an empty prefill or chunk of a stream) returns an empty output and the state it
    was given; from a sequence start, the start state (zeros; VLA's ``A = I / lambda0``). Had failed in all
    three: zero chunks left nothing to stack or cumsum."""
    args, kw = _args(name)
    none = [a[:, :, :0] for a in args]
    _, state = OPS[name](*[a[:, :, :20] for a in args], output_final_state=True, **kw)
    out, after = OPS[name](*none, initial_state=state, output_final_state=True, **kw)
    assert out.shape == (2, 2, 0, 6)
    as_tuple = (lambda s: s if isinstance(s, tuple) else (s,))
    for was, now in zip(as_tuple(state), as_tuple(after)):
        assert torch.equal(torch.as_tensor(now), torch.as_tensor(was))
    _, start = OPS[name](*none, output_final_state=True, **kw)
    start = as_tuple(start)
    assert all(not x.any() for x in start if isinstance(x, torch.Tensor) and x is not getattr(start, "A", None))
    if name == "vla":
        assert torch.equal(start.A, torch.eye(6).expand(2, 2, 6, 6) / 0.1) and start.position == 0
    rest = OPS[name](*[a[:, :, 20:] for a in args], initial_state=after, **kw)
    assert torch.equal(rest, OPS[name](*[a[:, :, 20:] for a in args], initial_state=state, **kw))


REFERENCES = {"linear": lambda q, k, v, u: linear_attention_reference(q, k, v).out,
              "vla": lambda q, k, v, u: vla_reference(q, k, v, u).out}


@pytest.mark.parametrize("name", list(REFERENCES))
def test_far_negative_features_equal_the_reference(name):
    """Queries and keys drawn from ``N(-8, 2)``, where ``φ = elu + 1`` is mostly ``exp(x)`` of -6 to -12: the fp32
    op equals the float64 loop to the fp32 tolerance. (With ``φ`` written ``elu(x) + 1`` its cancellation gave
    1.4e-5 for linear attention, and 3.7e-4 with ``N(-12, 2)``; recurrences/precision.py::one_plus_elu.)"""
    g = torch.Generator().manual_seed(0)
    q, k, v, u = (torch.randn(1, 2, 64, 8, generator=g) for _ in range(4))
    q, k = 2 * q - 8, 2 * k - 8
    args = (q, k, v, u) if name == "vla" else (q, k, v)
    want = REFERENCES[name](*(x.double() for x in (q, k, v, u)))
    assert_close(OPS[name](*args), want, FWD_TOL[torch.float32], f"{name} fp32")


@pytest.mark.parametrize("name", list(REFERENCES))
def test_the_floors_are_the_references(name):
    """Where the read-out's denominator falls below ``eps`` (queries of -40 from token 10: ``φ(q) = 4e-18``) it is
    floored at ``eps``, and VLA also floors the norms of its unit keys, penalty directions and write directions
    (keys and directions of norm about 1e-10 at tokens 5 to 14): float64 op == float64 loop."""
    g = torch.Generator().manual_seed(1)
    q, k, v, u = (torch.randn(1, 2, 30, 6, generator=g, dtype=torch.float64) for _ in range(4))
    q[:, :, 10:] = -40.0
    if name == "vla":
        k[:, :, 5:15] *= 1e-10
        u[:, :, 8:12] *= 1e-10
    want = REFERENCES[name](q, k, v, u)
    assert want[:, :, 10:].abs().max() < 1e-6 < want[:, :, :10].abs().max()  # the regime: floored read-outs
    got = OPS[name](*((q, k, v, u) if name == "vla" else (q, k, v)), chunk_size=10)
    for part in (slice(0, 10), slice(10, None)):  # each to its own scale
        assert_close(got[:, :, part], want[:, :, part], FWD_TOL[torch.float64], f"{name} fp64 {part}", floor=1e-30)
