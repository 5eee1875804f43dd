"""Linear attention (ELU+1): chunked form == the token loop; its state norm grows (docs/design.md §4.6)."""
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from recurrences.linear import linear_attention_chunked
from recurrences.reference import linear_attention_reference
from tests.helpers import assert_close
from tests.recurrences.recurrent_cases import assert_fast_matches_reference, one_thread, randn, shapes  # noqa: F401


@given(shapes(), st.integers(1, 32))
@example(shape=(1, 2, 1, 2, 10, 24021), chunk=1)  # one token: dq, dk are 0 up to rounding (found by the fuzz profile)
def test_chunked_equals_reference_fp32(shape, chunk):
    B, H, T, Dk, Dv, seed = shape
    inputs = randn(seed, torch.float32, (B, H, T, Dk), (B, H, T, Dk), (B, H, T, Dv))
    assert_fast_matches_reference(lambda *a: linear_attention_chunked(*a, chunk_size=chunk),
                                  lambda *a: linear_attention_reference(*a).out, inputs, f"chunk {chunk}")


def test_chunked_equals_reference_fp64_and_final_state():
    q, k, v = randn(3, torch.float64, (2, 2, 45, 5), (2, 2, 45, 5), (2, 2, 45, 7))
    assert_fast_matches_reference(lambda *a: linear_attention_chunked(*a, chunk_size=16),
                                  lambda *a: linear_attention_reference(*a).out, [q, k, v], "fp64")
    _, state = linear_attention_chunked(q, k, v, chunk_size=16, output_final_state=True)
    assert_close(state.S, linear_attention_reference(q, k, v).state, 1e-12, "final state")


def test_reference_is_a_normalised_causal_average():
    """Independent of the loop: o_t = Σ_{s<=t} w_ts v_s / Σ_{s<=t} w_ts with w_ts = φ(q_t)·φ(k_s)."""
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    w = torch.tril(phi(q) @ phi(k).transpose(-1, -2))
    expected = (w @ v) / w.sum(-1, keepdim=True)
    assert_close(linear_attention_reference(q, k, v).out, expected, 1e-12, "quadratic form")


@pytest.mark.parametrize("chunk", [1, 7, 64], ids=["chunk1", "chunk7", "chunk64"])
def test_bf16_inputs_compute_in_fp32(chunk):
    q, k, v = (torch.randn(1, 2, 30, 8) for _ in range(3))
    out = linear_attention_chunked(q.bfloat16(), k.bfloat16(), v.bfloat16(), chunk_size=chunk)
    assert out.dtype == torch.bfloat16
    ref = linear_attention_reference(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float()).out
    assert_close(out, ref, 1e-2, "bf16")
