"""Continuing a non-softmax recurrence from a carried state (docs/design.md §4.6, §6).

The chunked forms run segment by segment — each from the state the previous one
returned (``initial_state`` / ``output_final_state``) — must give the token loop's
outputs on the concatenated sequence and its final state (S, the normaliser z, VLA's A
and position), at cuts anywhere: inside a chunk, on a chunk boundary, next to a VLA
refresh step. The gradients of every input flow through the carried states too.
"""
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from recurrences.delta import delta_rule_chunked
from recurrences.linear import LinearState, feature_map, linear_attention_chunked
from recurrences.reference import delta_rule_reference, linear_attention_reference, vla_reference
from recurrences.vla import VLAOptions, VLAState, vla_chunked
from tests.helpers import FWD_TOL, assert_close
from tests.recurrences.recurrent_cases import (assert_fast_matches_reference, one_thread, randn, shapes,  # noqa: F401
                                              vla_state_tol)

# (refresh_every, chunk): chunks end on refresh steps
SCHEDULES = st.sampled_from([(20, 20), (20, 10), (20, 4), (20, 1), (12, 6), (0, 16), (0, 5)])


@st.composite
def cuts(draw, T: int):
    """Segment ends ``[c_1, ..., T]`` (strictly increasing): 1 to 4 segments."""
    inner = draw(st.lists(st.integers(1, max(1, T - 1)), max_size=3, unique=True)) if T > 1 else []
    return sorted(set(inner) | {T})


def segmented(step, inputs, ends):
    """Run ``step(*segment_inputs, state) -> (out, state)`` over the segments ``[prev, end)``
    of every input (time is dim 2) and concatenate the outputs."""
    outs, state, start = [], None, 0
    for end in ends:
        out, state = step(*(x[:, :, start:end] for x in inputs), state)
        outs.append(out)
        start = end
    return torch.cat(outs, 2), state


@given(shapes(), st.integers(1, 32), st.data())
def test_linear_attention_continued_equals_reference(shape, chunk, data):
    B, H, T, Dk, Dv, seed = shape
    ends = data.draw(cuts(T))
    inputs = randn(seed, torch.float32, (B, H, T, Dk), (B, H, T, Dk), (B, H, T, Dv))
    step = lambda q, k, v, s: linear_attention_chunked(q, k, v, chunk_size=chunk, initial_state=s,  # noqa: E731
                                                       output_final_state=True)
    assert_fast_matches_reference(lambda *a: segmented(step, a, ends)[0],
                                  lambda *a: linear_attention_reference(*a).out, inputs, f"chunk {chunk} ends {ends}")
    with torch.no_grad():
        _, state = segmented(step, inputs, ends)
        ref = linear_attention_reference(*(x.double() for x in inputs))
    assert isinstance(state, LinearState)
    assert_close(state.S, ref.state, FWD_TOL[torch.float32], "S_T")
    assert_close(state.z, feature_map(inputs[1].double()).sum(2), FWD_TOL[torch.float32], "z_T")


@given(shapes(), st.integers(1, 32), st.booleans(), st.data())
def test_delta_rule_continued_equals_reference(shape, chunk, blocked, data):
    B, H, T, Dk, Dv, seed = shape
    ends = data.draw(cuts(T))
    inputs = randn(seed, torch.float32, (B, H, T, Dk), (B, H, T, Dk), (B, H, T, Dv), (B, H, T))
    gated = lambda q, k, v, b: (q, F.normalize(k, dim=-1), v, torch.sigmoid(b))  # noqa: E731  the layer's regime
    step = lambda q, k, v, b, s: delta_rule_chunked(*gated(q, k, v, b), chunk_size=chunk,  # noqa: E731
                                                    initial_state=s, output_final_state=True, blocked=blocked)
    assert_fast_matches_reference(lambda *a: segmented(step, a, ends)[0],
                                  lambda *a: delta_rule_reference(*gated(*a)).out, inputs,
                                  f"chunk {chunk} ends {ends} blocked {blocked}")
    with torch.no_grad():
        _, state = segmented(step, inputs, ends)
        ref = delta_rule_reference(*gated(*(x.double() for x in inputs)))
    assert_close(state, ref.state, FWD_TOL[torch.float32], "S_T")


@given(shapes(), SCHEDULES, st.sampled_from([0.1, 1.0]), st.booleans(), st.data())
def test_vla_continued_equals_reference(shape, schedule, lambda0, blocked, data):
    B, H, T, Dk, Dv, seed = shape
    refresh, chunk = schedule
    ends = data.draw(cuts(T))
    opts = VLAOptions(lambda0=lambda0, refresh_every=refresh, refresh_eps=0.05, chunk_size=chunk)
    kw = dict(lambda0=lambda0, refresh_every=refresh, refresh_eps=0.05)
    inputs = randn(seed, torch.float32, (B, H, T, Dk), (B, H, T, Dk), (B, H, T, Dv), (B, H, T, Dk))
    step = lambda q, k, v, u, s: vla_chunked(q, k, v, u, opts, initial_state=s,  # noqa: E731
                                             output_final_state=True, blocked=blocked)
    assert_fast_matches_reference(lambda *a: segmented(step, a, ends)[0], lambda *a: vla_reference(*a, **kw).out,
                                  inputs, f"{opts} ends {ends} blocked {blocked}")
    with torch.no_grad():
        _, state = segmented(step, inputs, ends)
        ref = vla_reference(*(x.double() for x in inputs), **kw)
    assert isinstance(state, VLAState) and state.position == T
    tol = vla_state_tol(lambda0, ref.penalty)
    assert_close(state.S, ref.state, tol, "S_T")
    assert_close(state.A, ref.penalty, tol, "A_T")
    assert_close(state.z, feature_map(inputs[1].double()).sum(2), FWD_TOL[torch.float32], "z_T")


def test_vla_refresh_follows_the_absolute_position():
    """u = 0: A only changes by the refreshes, A_T = I/λ0 + ⌊T/R⌋ ε I, whatever the segments —
    here single tokens and segments that straddle refresh steps."""
    q, k, v = (torch.randn(1, 2, 47, 4, dtype=torch.float64) for _ in range(3))
    u = torch.zeros_like(k)
    opts = VLAOptions(refresh_every=10, refresh_eps=0.25, chunk_size=5)
    step = lambda q, k, v, u, s: vla_chunked(q, k, v, u, opts, initial_state=s, output_final_state=True)  # noqa: E731
    for ends in ([47], list(range(1, 48)), [3, 9, 10, 11, 29, 47]):
        _, state = segmented(step, (q, k, v, u), ends)
        assert_close(state.A, (10.0 + 4 * 0.25) * torch.eye(4, dtype=torch.float64).expand(1, 2, 4, 4), 1e-12,
                     f"A_T, ends {ends}")


def test_fp64_continuations_are_exact():
    """Token by token and in odd segments, fp64: the chunked continuation is the loop to 1e-12."""
    g = torch.Generator().manual_seed(3)
    q, k, v, u = (torch.randn(2, 2, 61, d, generator=g, dtype=torch.float64) for d in (6, 6, 5, 6))
    beta = torch.sigmoid(torch.randn(2, 2, 61, generator=g, dtype=torch.float64))
    kn = F.normalize(k, dim=-1)
    for ends in (list(range(1, 62)), [7, 8, 40, 61]):
        out, st_ = segmented(lambda q, k, v, s: linear_attention_chunked(q, k, v, chunk_size=8, initial_state=s,
                                                                         output_final_state=True), (q, k, v), ends)
        ref = linear_attention_reference(q, k, v)
        assert_close(out, ref.out, 1e-12, "linear out")
        assert_close(st_.S, ref.state, 1e-12, "linear S")
        out, st_ = segmented(lambda q, k, v, b, s: delta_rule_chunked(q, k, v, b, chunk_size=8, initial_state=s,
                                                                       output_final_state=True),
                             (q, kn, v, beta), ends)
        ref = delta_rule_reference(q, kn, v, beta)
        assert_close(out, ref.out, 1e-12, "delta out")
        assert_close(st_, ref.state, 1e-12, "delta S")
        out, st_ = segmented(lambda q, k, v, u, s: vla_chunked(q, k, v, u, VLAOptions(chunk_size=10), initial_state=s,
                                                               output_final_state=True), (q, k, v, u), ends)
        ref = vla_reference(q, k, v, u)
        assert_close(out, ref.out, 1e-12, "vla out")
        assert_close(st_.S, ref.state, 1e-12, "vla S")
        assert_close(st_.A, ref.penalty, 1e-12, "vla A")
