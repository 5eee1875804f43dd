"""Cumulative sums that are fast and compile on every device (docs/design.md §5).

The state builds scan along the token or chunk axis: the versioned sums over all ``T`` tokens of a
head sorted by slot, VLA's key sums, the linear recurrences' chunk states. Two facts about torch's
scans shape :func:`cumsum`:

- Speed. ATen's CUDA scan along a dimension runs one thread per scanned line (or one block per few
  lines for the last dimension), each walking the whole length in order: a ``[1, 8, 65536, 16]``
  cumsum over the tokens is 128 threads of 65,536 dependent steps, tens of milliseconds on a GPU
  that moves the same data in microseconds. On CUDA a scan longer than :data:`LONG_SCAN` therefore
  runs in two levels: within blocks of :data:`SCAN_BLOCK` elements, then over the block totals (the
  same way again when there are more than :data:`LONG_SCAN` of them), added back.
  Integer sums are unchanged; float sums are rounded in a different order (one more addition per
  element). On the CPU, where a scan is a vectorized loop, the extra pass only costs (about 15% of a
  versioned sums' forward and backward at 16k tokens), so the CPU keeps the one-level scan.
- Compilation. Inductor (torch 2.11) turns a scan over more than :data:`SINGLE_BLOCK_SCAN` elements
  into a Triton *split scan*, whose code generator fails ("list indices must be integers or slices,
  not NoneType", pytorch/pytorch#180221) when the work fused into the scan's input reads a broadcast
  or index value. On CUDA while compiling such a scan runs as :func:`extern_cumsum`, ATen's kernel on
  a materialized input; the rest of the graph still fuses.
- Precision. ATen's CUDA scan keeps a bf16 or fp16 running sum in that dtype, so every step rounds
  (pytorch/pytorch#180150; the CPU's accumulates in fp32 and rounds each output once). Emulated on
  the CPU, such a scan over 32 chunks left bf16 state sums at 3 times one rounding's error even with
  each chunk's cells rounded once (tests/recurrences/test_versioned.py::
  test_narrow_adds_as_on_cuda_are_summed_in_fp32). On CUDA a bf16 or fp16 scan therefore runs in
  fp32 and is rounded once (:data:`NARROW_SCANS`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

#: longest scan inductor's Triton code generator does in one block; longer ones become a split scan
SINGLE_BLOCK_SCAN = 128

#: scans longer than this run in two levels on CUDA (:func:`cumsum`), the first within blocks of SCAN_BLOCK
LONG_SCAN = 1024
SCAN_BLOCK = 256


@torch.library.custom_op("ovqflex::cumsum", mutates_args=())
def extern_cumsum(x: Tensor, dim: int) -> Tensor:
    """``x.cumsum(dim)`` as one op inductor cannot look into: ATen's scan kernel on a real buffer."""
    return x.cumsum(dim)


@extern_cumsum.register_fake
def _(x, dim):
    return x.new_empty(x.shape, dtype=x.dtype if x.is_floating_point() else torch.int64)


def _cumsum_setup(ctx, inputs, output) -> None:
    ctx.dim = inputs[1]


def _cumsum_backward(ctx, grad: Tensor):
    return extern_cumsum(grad.flip(ctx.dim), ctx.dim).flip(ctx.dim), None  # sum over the later positions


extern_cumsum.register_autograd(_cumsum_backward, setup_context=_cumsum_setup)


def _one_level(x: Tensor, dim: int, extern: bool | None) -> Tensor:
    if extern is None:
        extern = x.is_cuda and torch.compiler.is_compiling() and x.shape[dim] > SINGLE_BLOCK_SCAN
    return extern_cumsum(x, dim) if extern else x.cumsum(dim)


#: whether a device's ATen scan adds bf16/fp16 in their own dtype, rounding every step of the running sum
#: (CUDA: ``std::plus<scalar_t>``, pytorch/pytorch#180150; the CPU's accumulates in fp32); there
#: :func:`cumsum` scans such inputs in fp32 and rounds each output once, as the CPU does
NARROW_SCANS = {"cpu": False, "cuda": True}

#: columns of a widened scan done at once (:func:`_widened`): its fp32 buffers are this many columns wide
WIDE_SCAN_COLUMNS = 16


def _widened(x: Tensor, dim: int, two_level: bool | None, extern: bool | None) -> Tensor:
    """``cumsum(x.float(), dim)`` rounded once to x's dtype, :data:`WIDE_SCAN_COLUMNS` columns of the last
    dimension at a time when the scan runs along another (the columns are independent): the fp32 copies
    are a fraction of x's size."""
    parts = x.split(WIDE_SCAN_COLUMNS, -1) if dim != x.dim() - 1 else (x,)
    out = [cumsum(part.float(), dim, two_level=two_level, extern=extern).to(x.dtype) for part in parts]
    return out[0] if len(out) == 1 else torch.cat(out, -1)


def cumsum(x: Tensor, dim: int, *, two_level: bool | None = None, extern: bool | None = None) -> Tensor:
    """``x.cumsum(dim)`` (bool and integer inputs sum to int64), fast and compilable on every device;
    bf16 and fp16 accumulate in fp32 on every device (:data:`NARROW_SCANS`).
    ``two_level`` (default: on CUDA, for scans longer than :data:`LONG_SCAN`): scan within blocks of
    :data:`SCAN_BLOCK` elements, then over the block totals (with the same default). ``extern``
    (default: on CUDA while compiling, for scans longer than :data:`SINGLE_BLOCK_SCAN`): each scan runs
    as :func:`extern_cumsum`. The block is fixed, so a length traced as a symbol stays one."""
    dim = dim % x.dim()
    if x.dtype in (torch.bfloat16, torch.float16) and NARROW_SCANS.get(x.device.type, False):
        return _widened(x, dim, two_level, extern)
    n = x.shape[dim]
    asked = two_level
    if two_level is None:
        two_level = x.is_cuda and n > LONG_SCAN
    if not two_level or n <= SCAN_BLOCK:
        return _one_level(x, dim, extern)
    block = SCAN_BLOCK
    n_blocks = -(-n // block)
    if n_blocks * block > n:
        pads = [0, 0] * (x.dim() - 1 - dim) + [0, n_blocks * block - n]
        x = F.pad(x if x.is_floating_point() else x.long(), pads)
    inner = _one_level(x.unflatten(dim, (n_blocks, block)), dim + 1, extern)  # within each block
    totals = inner.select(dim + 1, block - 1)
    before = cumsum(totals, dim, two_level=asked, extern=extern) - totals  # sum of the blocks before each
    return (inner + before.unsqueeze(dim + 1)).flatten(dim, dim + 1).narrow(dim, 0, n)
