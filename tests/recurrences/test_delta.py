"""Delta rule (DeltaNet): chunked WY form == the token loop (docs/design.md §4.6)."""
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from recurrences.delta import delta_rule_chunked
from recurrences.reference import delta_rule_reference
from tests.helpers import assert_close
from tests.recurrences.recurrent_cases import assert_fast_matches_reference, one_thread, randn, shapes  # noqa: F401


def _unit_keys_and_gates(q, k, v, b):
    """The layer's regime: unit keys, β = sigmoid(.) in (0, 1)."""
    return q, F.normalize(k, dim=-1), v, torch.sigmoid(b)


@given(shapes(), st.integers(1, 32))
def test_chunked_equals_reference_fp32(shape, chunk):
    B, H, T, Dk, Dv, seed = shape
    inputs = randn(seed, torch.float32, (B, H, T, Dk), (B, H, T, Dk), (B, H, T, Dv), (B, H, T))
    assert_fast_matches_reference(
        lambda *a: delta_rule_chunked(*_unit_keys_and_gates(*a), chunk_size=chunk),
        lambda *a: delta_rule_reference(*_unit_keys_and_gates(*a)).out, inputs, f"chunk {chunk}")


def test_final_state_and_fp64():
    q, k, v, b = randn(5, torch.float64, (2, 2, 50, 6), (2, 2, 50, 6), (2, 2, 50, 3), (2, 2, 50))
    args = _unit_keys_and_gates(q, k, v, b)
    out, state = delta_rule_chunked(*args, chunk_size=16, output_final_state=True)
    ref = delta_rule_reference(*args)
    assert_close(out, ref.out, 1e-12, "fp64 forward")
    assert_close(state, ref.state, 1e-12, "final state")


def test_beta_one_with_unit_key_overwrites_the_association():
    """β = 1, unit key: after a write, reading with that key returns exactly the value."""
    q, k, v, _ = randn(2, torch.float64, (1, 1, 6, 4), (1, 1, 6, 4), (1, 1, 6, 3), (1,))
    k = F.normalize(k, dim=-1).detach()
    out = delta_rule_chunked(k, k, v.detach(), torch.ones(1, 1, 6, dtype=torch.float64), chunk_size=4)
    assert_close(out, v, 1e-12, "read-back of the token's own write")
