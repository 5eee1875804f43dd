"""recurrences/scan.py: cumsum in two levels for long scans and through an extern op on CUDA while
compiling — the same sums as ``torch.cumsum`` (integers exactly), with the same gradients."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from recurrences import scan
from recurrences.scan import LONG_SCAN, SCAN_BLOCK, SINGLE_BLOCK_SCAN, cumsum, extern_cumsum


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 5000), dim=st.sampled_from([0, 1, -1]), seed=st.integers(0, 2**16))
def test_cumsum_equals_torch_cumsum(n, dim, seed):
    """Any length, one level or two (as on CUDA past LONG_SCAN, with a padded last block), any dim:
    integer sums exactly, fp64 sums to rounding."""
    g = torch.Generator().manual_seed(seed)
    shape = [3, 2, 2]
    shape[dim] = n
    ints = torch.randint(-50, 50, shape, generator=g)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    for two_level in (None, True):
        assert torch.equal(cumsum(ints, dim, two_level=two_level), ints.cumsum(dim))
        # bool counts come back int64
        assert torch.equal(cumsum(ints > 0, dim, two_level=two_level), (ints > 0).cumsum(dim))
        torch.testing.assert_close(cumsum(x, dim, two_level=two_level), x.cumsum(dim), rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("n, two_level", [(LONG_SCAN, False), (3 * LONG_SCAN + 7, True)],
                         ids=["one-level", "two-levels-padded"])
@pytest.mark.parametrize("extern", [False, True], ids=["aten", "extern"])
def test_cumsum_gradient_equals_torch_cumsum(n, two_level, extern):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(2, n, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, n, 5, generator=g, dtype=torch.float64)
    (got,) = torch.autograd.grad((cumsum(x, 1, two_level=two_level, extern=extern) * w).sum(), x)
    (want,) = torch.autograd.grad((x.cumsum(1) * w).sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-9)


def test_extern_cumsum_is_a_well_formed_op():
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.library.opcheck(extern_cumsum, (x, 1))
    torch.library.opcheck(extern_cumsum, (x, -1))


def test_cumsum_inside_a_compiled_graph_with_broadcast_input():
    """The shape of pytorch/pytorch#180221 (a scan longer than one Triton block over ``x + bias``),
    and a two-level one: compiled, with and without the extern scan, values and gradients equal
    eager. (On the CPU the default never takes the extern path; the CUDA code generation itself is
    checked by the cuda tier.)"""
    def fn(x, b, extern):
        return cumsum(x + b, 1, two_level=x.shape[1] > LONG_SCAN, extern=extern).square().sum()

    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(4)
    for n in (SINGLE_BLOCK_SCAN + 1, LONG_SCAN + 1):
        x = torch.randn(2, n, 16, generator=g, requires_grad=True)
        b = torch.randn(16, generator=g, requires_grad=True)
        want = torch.autograd.grad(fn(x, b, False), (x, b))
        for extern in (True, None):
            got = torch.autograd.grad(compiled(x, b, extern), (x, b))
            for a, e in zip(got, want):
                torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-3)


def test_cumsum_recurses_over_many_block_totals():
    """More than SCAN_BLOCK blocks: the totals are scanned in two levels too (three in all)."""
    x = torch.randint(-9, 9, (2, SCAN_BLOCK * SCAN_BLOCK + 3), generator=torch.Generator().manual_seed(6))
    assert torch.equal(cumsum(x, 1, two_level=True), x.cumsum(1))


def test_cumsum_compiles_with_the_length_as_a_symbol():
    """``torch.compile(model)`` traces a second length as a symbol: the block size must not depend on it."""
    compiled = torch.compile(lambda x: cumsum(x, 1, two_level=True), dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(7)
    for n in (2000, 3001, 5000):
        x = torch.randn(2, n, 3, generator=g, dtype=torch.float64)
        torch.testing.assert_close(compiled(x), x.cumsum(1), rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dim", [0, 1, 2], ids=["first-dim", "middle-dim", "last-dim"])
def test_a_device_with_narrow_scans_scans_half_floats_in_fp32_and_rounds_once(dtype, dim, monkeypatch):
    """What CUDA takes (``NARROW_SCANS``: its ATen scan would round a bf16 running sum at every
    step), forced on the CPU: the fp32 scan rounded once, bit for bit, in 16-column parts (37 columns:
    16 + 16 + 5) or whole along the last dim; the gradient is the fp32 reverse scan rounded once."""
    monkeypatch.setitem(scan.NARROW_SCANS, "cpu", True)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 300, 37, generator=g).to(dtype).requires_grad_()
    y = cumsum(x, dim)
    assert y.dtype == dtype and torch.equal(y, x.detach().float().cumsum(dim).to(dtype))
    gy = torch.randn(y.shape, generator=g).to(dtype)
    y.backward(gy)
    assert torch.equal(x.grad, gy.float().flip(dim).cumsum(dim).flip(dim).to(dtype))
