"""Delta rule (DeltaNet): chunked WY form == the token loop (docs/design.md §4.6)."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from recurrences.delta import SCAN_CHUNKS, affine_chunk_states, delta_rule_chunked
from recurrences.reference import delta_rule_reference
from tests.helpers import assert_close
from tests.recurrences.recurrent_cases import assert_fast_matches_reference, one_thread, randn, shapes  # noqa: F401


def _unit_keys_and_gates(q, k, v, b):
    """The layer's regime: unit keys, β = sigmoid(.) in (0, 1)."""
    return q, F.normalize(k, dim=-1), v, torch.sigmoid(b)


@given(shapes(), st.integers(1, 32), st.booleans())
def test_chunked_equals_reference_fp32(shape, chunk, blocked):
    """Either way of running the chunks (a loop, or the blocked scan of GPUs and compiled graphs)."""
    B, H, T, Dk, Dv, seed = shape
    inputs = randn(seed, torch.float32, (B, H, T, Dk), (B, H, T, Dk), (B, H, T, Dv), (B, H, T))
    assert_fast_matches_reference(
        lambda *a: delta_rule_chunked(*_unit_keys_and_gates(*a), chunk_size=chunk, blocked=blocked),
        lambda *a: delta_rule_reference(*_unit_keys_and_gates(*a)).out, inputs, f"chunk {chunk} blocked {blocked}")


@pytest.mark.parametrize("chunk, blocked", [(16, False), (2, False), (2, True)],
                         ids=["4-chunks", "25-chunks-loop", "25-chunks-blocked"])
def test_final_state_and_fp64(chunk, blocked):
    q, k, v, b = randn(5, torch.float64, (2, 2, 50, 6), (2, 2, 50, 6), (2, 2, 50, 3), (2, 2, 50))
    args = _unit_keys_and_gates(q, k, v, b)
    out, state = delta_rule_chunked(*args, chunk_size=chunk, output_final_state=True, blocked=blocked)
    ref = delta_rule_reference(*args)
    assert_close(out, ref.out, 1e-12, "fp64 forward")
    assert_close(state, ref.state, 1e-12, "final state")


def test_beta_one_with_unit_key_overwrites_the_association():
    """β = 1, unit key: after a write, reading with that key returns exactly the value."""
    q, k, v, _ = randn(2, torch.float64, (1, 1, 6, 4), (1, 1, 6, 4), (1, 1, 6, 3), (1,))
    k = F.normalize(k, dim=-1).detach()
    out = delta_rule_chunked(k, k, v.detach(), torch.ones(1, 1, 6, dtype=torch.float64), chunk_size=4)
    assert_close(out, v, 1e-12, "read-back of the token's own write")


def _chunk_loop(erase, write, X):
    """``X_{c+1} = X_c - E_c X_c + F_c``, one chunk after another: the states before each chunk, and the last."""
    starts = []
    for c in range(erase.shape[-3]):
        starts.append(X)
        X = X - erase[..., c, :, :] @ X + write[..., c, :, :]
    return torch.stack(starts, -3), X


def _affine_chunks(seed: int, n: int, dtype=torch.float64):
    """Erase ``E = I - Q diag(s) Q^T`` (transitions of norm <= 1, as the delta rule's), writes, a start."""
    g = torch.Generator().manual_seed(seed)
    Dk, Dv = 5, 3
    Q = torch.linalg.qr(torch.randn(2, n, Dk, Dk, generator=g, dtype=torch.float64)).Q
    s = torch.rand(2, n, Dk, generator=g, dtype=torch.float64)
    erase = torch.eye(Dk, dtype=torch.float64) - Q @ torch.diag_embed(s) @ Q.transpose(-1, -2)
    write = torch.randn(2, n, Dk, Dv, generator=g, dtype=torch.float64)
    X0 = torch.randn(2, Dk, Dv, generator=g, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (erase, write, X0)]


@pytest.mark.parametrize("n", [1, SCAN_CHUNKS, SCAN_CHUNKS + 1, 40, SCAN_CHUNKS**2, SCAN_CHUNKS**2 + 1, 300],
                         ids=lambda n: f"{n}-chunks")
def test_the_blocked_scan_equals_the_chunk_loop(n):
    """One level (<= 16 chunks), two (17..256) and three (257..4096): states and gradients."""
    inputs = _affine_chunks(n, n)
    starts, last = affine_chunk_states(*inputs)
    ref_starts, ref_last = _chunk_loop(*inputs)
    assert_close(starts, ref_starts, 1e-12, "states before each chunk")
    assert_close(last, ref_last, 1e-12, "state after the last chunk")
    cot = torch.randn(starts.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((starts * cot).sum() + last.sum(), inputs)
    ref_grads = torch.autograd.grad((ref_starts * cot).sum() + ref_last.sum(), inputs)
    for what, a, b in zip(("erase", "write", "X0"), grads, ref_grads):
        assert_close(a, b, 1e-12, f"grad of {what}")


@pytest.mark.parametrize("counts, graphs", [
    pytest.param((4, 11, 20, 90, 256), [1, 0, 1, 0, 0], id="one-and-two-levels"),
    pytest.param((20, 257, 400), [1, 1, 0], id="three-levels", marks=pytest.mark.slow),
])
def test_the_blocked_scan_compiles_a_graph_per_number_of_levels(counts, graphs):
    """A symbolic chunk count pads to whole blocks: one graph for up to 16 chunks, one for 17..256, one for
    257..4096, none per chunk count (a loop over the chunks unrolls into a graph of its own for each).
    Forward only, to keep the default run short; the layers' backward is compiled by the conformance tests.
    (No count of 2, 3 or 5: duck sizing would tie it to the batch, Dv or Dk.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    scan = torch.compile(affine_chunk_states, fullgraph=True, dynamic=True, backend="aot_eager")
    compiled = []
    for n in counts:
        inputs = [x.detach() for x in _affine_chunks(n, n, torch.float32)]
        before = counters["stats"]["unique_graphs"]
        starts, last = scan(*inputs)
        compiled.append(counters["stats"]["unique_graphs"] - before)
        ref_starts, ref_last = _chunk_loop(*inputs)
        assert_close(starts, ref_starts, 1e-5, f"states before each of {n} chunks")
        assert_close(last, ref_last, 1e-5, f"state after {n} chunks")
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert compiled == graphs


@pytest.mark.parametrize("blocked", [False, True], ids=["loop", "blocked"])
def test_hundreds_of_chunks_continue_the_token_loop(blocked):
    """550 tokens in chunks of 2 (275 chunks: three levels of the blocked scan) continued from the token
    loop's state after 50 tokens == the token loop over all 600, outputs and final state."""
    args = _unit_keys_and_gates(*randn(7, torch.float64, (1, 2, 600, 6), (1, 2, 600, 6), (1, 2, 600, 4), (1, 2, 600)))
    ref = delta_rule_reference(*args)
    prefix = delta_rule_reference(*(x[:, :, :50] for x in args))
    out, state = delta_rule_chunked(*(x[:, :, 50:] for x in args), chunk_size=2, initial_state=prefix.state,
                                    output_final_state=True, blocked=blocked)
    assert_close(out, ref.out[:, :, 50:], 1e-12, "outputs after the prefix")
    assert_close(state, ref.state, 1e-12, "final state")


@pytest.mark.parametrize("compiling, chunks, blocked", [(False, 20, False), (True, 20, True), (True, 16, False)],
                         ids=["eager-20-chunks-loop", "compiling-20-chunks-blocked", "compiling-16-chunks-loop"])
def test_the_default_runs_the_blocked_scan_when_compiling_more_than_16_chunks(monkeypatch, compiling, chunks, blocked):
    """On a CPU: the loop in eager code; the blocked scan while compiling (``is_compiling`` patched here)
    once there are more than SCAN_CHUNKS chunks. (A GPU takes the compiled choice in eager code too.)"""
    import recurrences.delta as delta

    calls = []
    real = delta.affine_chunk_states
    monkeypatch.setattr(delta, "affine_chunk_states", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    args = _unit_keys_and_gates(*randn(chunks, torch.float64, *[(1, 2, 4 * chunks, 8)] * 3, (1, 2, 4 * chunks)))
    out = delta_rule_chunked(*args, chunk_size=4)
    assert bool(calls) == blocked
    assert_close(out, delta_rule_reference(*args).out, 1e-12, "forward")
