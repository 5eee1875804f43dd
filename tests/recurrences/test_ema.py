"""Damped multi-head EMA (MEGA; LongVQ's SSM): chunked causal convolution == recurrence."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from recurrences.ema import _decayed_prefix_sums, damped_ema, damped_ema_reference, ema_chunk
from tests.helpers import FWD_TOL, GRAD_TOL, assert_close


def _assert_gradients_match(y, ref, inputs, tol, g):
    """The gradients of ``(y * w).sum()`` (one random ``w`` from ``g``) with respect to the EMA's ``inputs``
    ``[x, delta, alpha, beta, gamma, omega]`` are finite and equal the reference's, ``(ref * w).sum()``."""
    w = torch.randn(y.shape, generator=g, dtype=y.dtype)
    grads = torch.autograd.grad((y * w).sum(), inputs)
    ref_grads = torch.autograd.grad((ref * w).sum(), inputs)
    for name, a, b in zip(["x", "delta", "alpha", "beta", "gamma", "omega"], grads, ref_grads):
        assert a.isfinite().all(), f"d{name}"
        assert_close(a, b, tol, f"d{name}", floor=0.1)


@given(st.integers(1, 2), st.integers(1, 200), st.sampled_from([1, 4, 16]), st.integers(1, 8),
       st.sampled_from([16, 64, None]), st.integers(0, 2**16))
def test_chunked_convolution_equals_recurrence(B, T, n, D, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g, requires_grad=True)
    params = [torch.randn(D, n, generator=g).requires_grad_() for _ in range(4)]
    omega = torch.randn(D, generator=g, requires_grad=True)
    y = damped_ema(x, *params, omega, chunk_size=chunk)
    ref = damped_ema_reference(x, *params, omega)
    assert_close(y, ref, 10 * FWD_TOL[torch.float32], "forward")
    _assert_gradients_match(y, ref, [x, *params, omega], GRAD_TOL[torch.float32], g)


@pytest.mark.parametrize("dtype, saturated", [(torch.float32, 20.0), (torch.float64, 40.0)], ids=["fp32", "fp64"])
@pytest.mark.parametrize("chunk", [16, None], ids=["chunk16", "default-chunk"])
def test_a_decay_of_zero_forgets_the_past_as_the_recurrence_does(dtype, saturated, chunk):
    """Logits past the sigmoids' saturation (both round to 1) make a channel's decay exactly 0: the recurrence
    keeps no past there, and the chunked form, whose zero powers of the decay had been ``exp(0 * log 0)`` = NaN,
    equals it, gradients finite and equal too (the other channels' decays are ordinary)."""
    g = torch.Generator().manual_seed(0)
    D, n = 4, 3
    x = torch.randn(2, 50, D, generator=g, dtype=dtype, requires_grad=True)
    delta, alpha = torch.randn(2, D, n, generator=g, dtype=dtype)
    delta[:2, :2], alpha[:2, :2] = saturated, saturated
    params = [t.requires_grad_() for t in (delta, alpha, *torch.randn(2, D, n, generator=g, dtype=dtype))]
    omega = torch.randn(D, generator=g, dtype=dtype, requires_grad=True)
    assert (1 - torch.sigmoid(delta) * torch.sigmoid(alpha) == 0).sum() == 4  # the regime
    y = damped_ema(x, *params, omega, chunk_size=chunk)
    ref = damped_ema_reference(x, *params, omega)
    assert_close(y, ref, FWD_TOL[dtype], "forward")
    _assert_gradients_match(y, ref, [x, *params, omega], GRAD_TOL[dtype], g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-input", "bf16-input"])
def test_fp32_inside_under_autocast(dtype):
    """Autocast does not reach the EMA's einsums: under CPU bf16 autocast the output is the one of the
    same call without autocast, bit for bit (with autocast reaching them: 3.7e-3 relative error
    against the fp64 recurrence, where fp32 gives about 1e-7)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 300, 16, generator=g).to(dtype)
    params = [torch.randn(16, 4, generator=g) * s for s in (0.2, 0.2, 0.02, 0.5)]
    params[2] += 1.0
    omega = torch.randn(16, generator=g)
    want = damped_ema(x, *params, omega)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = damped_ema(x, *params, omega)
    assert got.dtype == dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("chunk", [16, None], ids=["chunk16", "default-chunk"])
def test_float64_inside_for_float64_inputs(chunk):
    """fp64 x and parameters: the chunked form and the recurrence both run in fp64 and agree to ~1e-15,
    gradients too, and a continued state (h0) as well (in fp32 inside the error was ~1e-7)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 150, 8, generator=g, dtype=torch.float64, requires_grad=True)
    params = [(torch.randn(8, 4, generator=g, dtype=torch.float64) * s).requires_grad_() for s in (0.5, 0.5, 1, 1)]
    omega = torch.randn(8, generator=g, dtype=torch.float64)
    y = damped_ema(x, *params, omega, chunk_size=chunk)
    ref = damped_ema_reference(x, *params, omega)
    assert y.dtype == torch.float64
    assert_close(y, ref, 1e-13, "forward")
    grads = torch.autograd.grad(y.square().sum(), [x, *params])
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *params])
    for a, b in zip(grads, ref_grads):
        assert_close(a, b, 1e-12, "grad")
    with torch.no_grad():
        head, state = damped_ema(x[:, :70], *params, omega, chunk_size=chunk, output_final_state=True)
        tail = damped_ema(x[:, 70:], *params, omega, chunk_size=chunk, h0=state)
    assert state.dtype == torch.float64
    assert_close(torch.cat([head, tail], dim=1), ref, 1e-13, "continued from h0")


@pytest.mark.parametrize("chunk", [16, None], ids=["chunk16", "default-chunk"])
def test_output_is_contiguous(chunk):
    """The einsums leave the output channel-major; it is returned contiguous, so the matmul after it
    (LongVQ's z_proj) takes the same kernel eagerly as compiled."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 100, 8, generator=g)
    y, _ = damped_ema(x, *[torch.randn(8, 4, generator=g) for _ in range(4)], torch.randn(8, generator=g),
                      chunk_size=chunk, output_final_state=True)
    assert y.is_contiguous() and y.shape == x.shape


def test_exactly_causal():
    x = torch.randn(1, 150, 4, requires_grad=True)
    params = [torch.randn(4, 3) for _ in range(4)]
    y = damped_ema(x, *params, torch.randn(4), chunk_size=16)
    for i in (0, 15, 16, 70, 149):
        (g,) = torch.autograd.grad(y[:, i].sum(), x, retain_graph=True)
        assert g[:, i + 1:].abs().sum() == 0 and g[:, : i + 1].abs().sum() > 0


def test_default_chunk_grows_like_sqrt_t_and_stays_exact():
    """Long inputs take chunks of about sqrt(T) (memory linear in T), still equal to the recurrence,
    and a continuation from the carried state equals the whole sequence; fewer than 64 tokens are
    one chunk of their own length (no padding)."""
    assert [ema_chunk(T) for T in (1, 63, 64, 4096, 4097, 16384, 65536)] == [1, 63, 64, 64, 80, 128, 256]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5000, 3, generator=g)
    params = [torch.randn(3, 2, generator=g) for _ in range(4)]
    omega = torch.randn(3, generator=g)
    ref = damped_ema_reference(x, *params, omega)
    assert_close(damped_ema(x, *params, omega), ref, 10 * FWD_TOL[torch.float32], "T=5000, chunk 80")
    head, state = damped_ema(x[:, :4200], *params, omega, output_final_state=True)
    tail = damped_ema(x[:, 4200:], *params, omega, h0=state)
    assert_close(torch.cat([head, tail], 1), ref, 10 * FWD_TOL[torch.float32], "continued from the state")


def test_compiles_with_a_symbolic_length():
    """Under ``torch.compile`` with dynamic shapes the default chunk is a power of two found by comparisons
    (``math.isqrt`` of a symbolic length cannot be traced): one graph serves 70, 90 and 300 tokens (chunk
    64, guarded ``64 < T <= 4096``), another 5,000 (chunk 128), each equal to the recurrence."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(0)
    params = [torch.randn(3, 2, generator=g) for _ in range(4)]
    omega = torch.randn(3, generator=g)
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda x: damped_ema(x, *params, omega), dynamic=True, backend="eager", fullgraph=True)
    graphs = []
    for T in (70, 90, 300, 5000):
        x = torch.randn(1, T, 3, generator=g)
        assert_close(f(x), damped_ema_reference(x, *params, omega), 10 * FWD_TOL[torch.float32], f"T={T}")
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 1, 1, 2]


@given(st.integers(1, 300), st.sampled_from([1, 16, 256]), st.integers(0, 2**16))
def test_chunk_states_are_the_decayed_prefix_sums(C, chunk, seed):
    """The states carried across chunks, ``s_c = a s_(c-1) + x_c``, one step at a time in fp64, against the
    blocked form (blocks of ``ceil(sqrt(C))`` steps, the last one padded) on its fp64 inputs; values and the
    gradients of x and of the log decay."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, C, 3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    loga = (-torch.rand(3, 4, generator=g, dtype=torch.float64) * 0.5 - 1e-3).requires_grad_()
    s, states = torch.zeros(2, 3, 4, dtype=torch.float64), []
    for c in range(C):
        s = torch.exp(loga) * s + x[:, c]
        states.append(s)
    ref = torch.stack(states, dim=1)
    got = _decayed_prefix_sums(x, loga, chunk)
    assert_close(got, ref, 1e-13, "states")
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    for name, a, b in zip(["x", "loga"], torch.autograd.grad((got * w).sum(), [x, loga]),
                          torch.autograd.grad((ref * w).sum(), [x, loga])):
        assert_close(a, b, 1e-12, f"d{name}")
