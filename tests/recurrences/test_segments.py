"""The shared snapshot sums (recurrences/segments.py): every snapshot's sums, counts and their gradient
against a dense membership reference, and what autograd keeps of them for the backward."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from recurrences import segments
from recurrences.segments import segment_snapshot_sums, sum_dtype
from tests.helpers import rel_err, sum_narrow_as_on_cuda

LEADERS = segments._cell_leaders


def membership(routes: torch.Tensor, chunk: int, n_chunks: int, rows: int, lag: int, every: int) -> torch.Tensor:
    """``[B, H, n_out, rows, T]`` float64, 1 where token t is in output snapshot o at row r: its route is r
    (``0 <= r < rows``) and it entered (``t // chunk + lag``) by the chunk the output stands for (``o * every``)."""
    n_out = -(-n_chunks // every)
    t = torch.arange(routes.shape[-1])
    entered = (t // chunk + lag)[None, :] <= (torch.arange(n_out) * every)[:, None]       # [n_out, T]
    routed = routes[:, :, None, :] == torch.arange(rows)[:, None]                          # [B, H, rows, T]
    return (entered[None, None, :, None, :] & routed[:, :, None, :, :]).double()


@st.composite
def cases(draw):
    chunk = draw(st.sampled_from([4, 16]))
    n_chunks = draw(st.integers(1, 6))
    return dict(B=draw(st.integers(1, 2)), H=draw(st.integers(1, 2)), chunk=chunk, n_chunks=n_chunks,
                T=(n_chunks - 1) * chunk + draw(st.integers(1, chunk)), rows=draw(st.integers(1, 9)),
                lag=draw(st.integers(1, 3)), every=draw(st.integers(1, 4)), seed=draw(st.integers(0, 2**16)))


@given(cases())
def test_sums_counts_and_gradients_equal_the_dense_membership_reference(case):
    """Routes of every kind (-1, a live row, one past the last row: dropped), tokens entering after the last
    chunk; the gradient of each token is the sum of the snapshot cells it is in (fp64, so the only difference
    is the order of the adds)."""
    g = torch.Generator().manual_seed(case["seed"])
    B, H, T, L, rows = case["B"], case["H"], case["T"], case["chunk"], case["rows"]
    n_chunks, lag, every = case["n_chunks"], case["lag"], case["every"]
    routes = torch.randint(-1, rows + 1, (B, H, T), generator=g)
    x = torch.randn(B, H, T, 3, generator=g, dtype=torch.float64, requires_grad=True)
    (sums,), counts = segment_snapshot_sums([x], routes, L, n_chunks, rows, lag=lag, every=every)
    m = membership(routes, L, n_chunks, rows, lag, every)
    ref = torch.einsum("bhort,bhtd->bhord", m, x)
    assert sums.shape == ref.shape and rel_err(sums, ref) < 1e-12
    assert torch.equal(counts.double(), m.sum(-1))
    upstream = torch.randn(sums.shape, generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad(sums, x, upstream)
    (ref_grad,) = torch.autograd.grad(ref, x, upstream)
    assert rel_err(grad, ref_grad) < 1e-12


def _bf16_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    B, H, T, L, rows = 1, 2, 200, 16, 7
    routes = torch.randint(-1, rows, (B, H, T), generator=g)
    x = torch.randn(B, H, T, 24, generator=g).bfloat16().requires_grad_()
    upstream = torch.randn(B, H, T // L + 1, rows, 24, generator=g).bfloat16()
    return x, routes, upstream, (L, T // L + 1, rows)


def _sums_and_grad(x, routes, upstream, shape):
    (sums,), _ = segment_snapshot_sums([x], routes, *shape)
    (grad,) = torch.autograd.grad(sums, x, upstream)
    return sums, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_narrow_adds_change_the_sums_rounding_not_the_gradient(monkeypatch, dtype):
    """CUDA's path for bf16 tokens (a cell's tokens summed in fp32 first, into the row of the cell's first token,
    and rounded once) rounds the sums differently from the CPU's, but a token's gradient is its cells' either
    way: the same bits. fp32 tokens are added as they are, and fp16 tokens too, summed in fp32 (their sums' dtype,
    ``sum_dtype``)."""
    x, routes, upstream, shape = _bf16_case(5)
    x, upstream = x.detach().to(dtype).requires_grad_(), upstream.to(dtype)
    plain_sums, plain_grad = _sums_and_grad(x, routes, upstream, shape)
    sum_narrow_as_on_cuda(monkeypatch)
    grouped = []
    monkeypatch.setattr(segments, "_cell_leaders", lambda *a: grouped.append(a) or LEADERS(*a))
    narrow_sums, narrow_grad = _sums_and_grad(x, routes, upstream, shape)
    assert len(grouped) == (dtype == torch.bfloat16)
    assert narrow_sums.dtype == sum_dtype(dtype) == (torch.float32 if dtype == torch.float16 else dtype)
    assert rel_err(narrow_sums.float(), plain_sums.float()) < 2e-2
    assert torch.equal(narrow_grad, plain_grad)


@pytest.mark.parametrize("dtype, narrow", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
                         ids=["fp32", "bf16", "bf16-narrow-as-on-cuda"])
def test_autograd_keeps_only_integer_indices(monkeypatch, dtype, narrow):
    """The backward of the sums needs each token's cell, not the tokens: ``index_add``'s own backward kept
    its source whole (the tokens, with narrow adds also their fp32 copy and its grouped sums), ``[B*H*T, D]``
    copies alive until the backward."""
    if narrow:
        sum_narrow_as_on_cuda(monkeypatch)
    x, routes, _, shape = _bf16_case(6)
    x = x.detach().to(dtype).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        (sums,), _ = segment_snapshot_sums([x], routes, *shape)
    assert sums.requires_grad
    assert saved and not [tuple(t.shape) for t in saved if t.is_floating_point()]


@pytest.mark.parametrize("dtype, narrow", [(torch.float32, False), (torch.bfloat16, True)],
                         ids=["fp32", "bf16-narrow-as-on-cuda"])
def test_compiled_gradient_is_the_eager_one(monkeypatch, dtype, narrow):
    """Compiled, the sums are autograd's own ``index_add`` (recurrences/segments.py ``_cell_sums``): torch
    2.11 compiled the eager path's ``autograd.Function`` to a zero gradient."""
    if narrow:
        sum_narrow_as_on_cuda(monkeypatch)
    x, routes, upstream, shape = _bf16_case(7)
    x, upstream = x.detach().to(dtype).requires_grad_(), upstream.to(dtype)

    def sums(x, routes):
        return segment_snapshot_sums([x], routes, *shape)[0][0]

    torch._dynamo.reset()
    (eager,) = torch.autograd.grad(sums(x, routes), x, upstream)
    (compiled,) = torch.autograd.grad(torch.compile(sums, fullgraph=True)(x, routes), x, upstream)
    assert bool(eager.abs().max() > 0) and rel_err(compiled.float(), eager.float()) < 1e-6
