"""Shared by the non-softmax recurrence tests: hypothesis shapes and a fast == reference check."""
import pytest
import torch
from hypothesis import strategies as st

from tests.helpers import FWD_TOL, GRAD_TOL, assert_close, grad_floor


@pytest.fixture(autouse=True)
def one_thread():
    """Token loops are thousands of tiny ops: on a shared 2-core machine, intra-op threads
    spin-wait against other processes (T = 1,000 VLA loop: 0.3 s on one thread, 25 s on two
    under load). Import this fixture into a test module to run its tests on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@st.composite
def shapes(draw, max_len: int = 70):
    """(B, H, T, Dk, Dv, seed) with lengths that are rarely chunk multiples. ``Dk >= 2``: with
    one key dim a normalised read-out does not depend on q at all (dq is exactly 0, and
    comparing rounding noise against 0 measures nothing)."""
    return (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, max_len)),
            draw(st.integers(2, 12)), draw(st.integers(1, 12)), draw(st.integers(0, 2**16)))


def randn(seed: int, dtype, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype).requires_grad_() for s in shapes]


def assert_fast_matches_reference(fast, reference, inputs, what: str) -> None:
    """``fast(*inputs)`` and ``reference(*inputs)`` (both -> out) agree in the forward and
    in the gradients of every input under one random cotangent, at the dtype's tolerances.

    The reference loop runs in float64 on the same values, i.e. it gives the exact answer
    for the given inputs, and the tolerance bounds the fast form's own rounding. That rounding
    is relative to the computation's scale, not to each result: a gradient that is analytically
    zero (dq and dk of a normalised read-out over one token, whose output is its value whatever
    q and k are) comes out as rounding noise of the terms that cancel in it. So each gradient's
    error is relative to its own norm or, below it, to 1% of the largest input gradient's norm."""
    dtype = inputs[0].dtype
    exact = [x.detach().double().requires_grad_() for x in inputs]
    out_f, out_r = fast(*inputs), reference(*exact)
    assert out_f.shape == out_r.shape and out_f.dtype == dtype
    assert_close(out_f, out_r, FWD_TOL[dtype], f"{what} forward")
    cot = torch.randn(out_r.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g_f = torch.autograd.grad(out_f, inputs, cot.to(dtype))
    g_r = torch.autograd.grad(out_r, exact, cot)
    floor = grad_floor(g_r, least=1e-2)
    for i, (a, b) in enumerate(zip(g_f, g_r)):
        assert_close(a, b, GRAD_TOL[dtype], f"{what} grad of input {i}", floor=floor)


def vla_state_tol(lambda0: float, penalty: torch.Tensor) -> float:
    """Tolerance of an fp32 chunked VLA state (S, A) against the float64 loop's, given the loop's
    final penalty inverse ``penalty [B, H, Dk, Dk]``.

    The chunk form subtracts: ``A_C = A_0 - W^T W`` (recurrences/vla.py), rounded relative to
    ``||A_0|| <= ||I / lambda0||``, so relative to the result the error grows by ``amp = ||I /
    lambda0|| / ||A_T||`` (Frobenius) where the penalty shrinks A a lot, as with few key dims hit
    by many tokens (Dk = 2, lambda0 = 0.1, 14 tokens in one chunk: amp = 69); the loop's one-token steps do not
    cancel so (their fp32 error stays near ``eps32``). Measured once over 1,500 cases drawn as these
    tests draw them (2026-11-29): fp32 ``vla_chunked`` against float64 ``vla_reference``, the errors of
    A and S stayed below ``5.2 eps32 amp``. The bound is ``16 eps32 amp``, never below ``FWD_TOL``."""
    amp = (penalty.shape[-1] ** 0.5 / lambda0) / penalty.norm().item()
    return max(FWD_TOL[torch.float32], 16 * torch.finfo(torch.float32).eps * amp)
