"""The ``AttentionProgram``: everything one attention call needs (docs/design.md §3).

A program bundles the padded queries ``q [B, H, Qp, D]``, the kv sequence
``k, v [B, H, S + Tp, D]`` laid out as ``[state rows ; token rows]``, the regions
(whose union is the ``mask_mod``), the analytic block lists, the softmax scale
and an optional per-row bias (the ``score_mod``). Programs never run attention:
backends in :mod:`ovqflex.attention` do.

Queries are written token-major. Flex's output follows its query's memory order (torch lays
the output out with the query's strides, in eager and in inductor), and a layer merges heads
from ``[B, T, H, D]`` memory (``o.transpose(1, 2).reshape(B, T, H * D)``). A query written
``[B, H, T, D]`` makes that merge a copy: one more pass over the output, and in training the
window, full-attention and KVM layers kept that copy for the output projection's backward
besides flex's own (64 MB at 64k tokens, hidden 512, bf16; docs/design.md §7). So whatever
writes a query a program reads writes it in ``[B, T, H, D]`` shape and hands on its
``[B, H, T, D]`` transpose: the rotary embedding (:mod:`ovqflex.layers.rope`),
:func:`scaled_unit_queries` and :func:`pad_queries`. The shape, not a ``.contiguous()``, is
what holds under ``torch.compile``: inductor lays an intermediate out in the order of its
shape, whatever strides eager would give it, and drops a copy whose traced strides already
match. Eager ops follow their input's layout instead; the layers' queries are views of their
``[B, T, ...]`` projections, so eager writes them token-major too, while a caller's
contiguous ``[B, H, T, D]`` queries stay so in eager unless padded.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from recurrences.checks import check_block_size, check_qkv
from recurrences.compiling import is_symbolic, pad_to, plain_int
from recurrences.precision import compute_dtype, no_autocast, to_dtype, work_dtype

from .blocks import BlockLayout, build_block_layout
from .regions import Geometry, Region, union_tests
from .scores import row_bias

DEFAULT_BLOCK = 128


@dataclass
class AttentionProgram:
    """One attention call. ``q_len`` real queries; outputs are ``[B, H, q_len, Dv]``."""

    q: Tensor
    k: Tensor
    v: Tensor
    regions: tuple[Region, ...]
    params: tuple[tuple[Tensor, ...], ...]
    layout: BlockLayout
    scale: float
    bias: Tensor | None = None
    _mask_mod: object = field(default=None, repr=False)

    @property
    def geom(self) -> Geometry:
        return self.layout.geom

    @property
    def q_len(self) -> int:
        return self.geom.q_len

    @property
    def mask_mod(self):
        """Union of the regions: ``mask_mod(b, h, q_idx, kv_idx) -> bool``."""
        if self._mask_mod is None:
            (first, p0), *rest = union_tests(self.regions, self.params)

            def mask_mod(b, h, q_idx, kv_idx):
                visible = first(p0, q_idx, kv_idx, b, h)
                for test, p in rest:
                    visible = visible | test(p, q_idx, kv_idx, b, h)
                return visible

            self._mask_mod = mask_mod
        return self._mask_mod

    @property
    def score_mod(self):
        return None if self.bias is None else row_bias(self.bias)

    def block_mask(self, *, with_q_side: bool = False):
        return self.layout.block_mask(self.mask_mod, with_q_side=with_q_side)

    def on_blocks(self, block: int) -> "AttentionProgram":
        """The same program on blocks of ``block`` rows, a multiple of its block size (what the
        flex backend runs on CUDA: ``ovqflex.attention.flex_block_size``).

        q is padded to a multiple of ``block``; k, v and the bias get token rows at the end, so
        that every padded query still sees at least itself; the block lists are rebuilt
        analytically. State rows keep their place, so a block may hold state and token rows
        (it is then listed partial and the ``mask_mod`` decides). Outputs of the real queries
        and their gradients are those of the original program.
        """
        g = self.geom
        if block == g.block_q:
            return self
        if block % g.block_q:
            raise ValueError(f"block must be a multiple of the program's block size {g.block_q}, got {block}")
        q_pad = _round_up(g.q_pad, block)
        kv_len = _round_up(g.n_state + q_pad, block)
        geom = Geometry(q_len=g.q_len, q_pad=q_pad, n_state=g.n_state, kv_tokens=kv_len - g.n_state,
                        block_q=block, block_kv=block)
        extra = kv_len - g.kv_len
        q = pad_queries(self.q, q_pad)
        k, v = F.pad(self.k, (0, 0, 0, extra)), F.pad(self.v, (0, 0, 0, extra))
        bias = None if self.bias is None else F.pad(self.bias, (0, extra))  # token rows: bias 0
        params = tuple(r.params(geom, q.device) for r in self.regions)
        return AttentionProgram(q=q, k=k, v=v, regions=self.regions, params=params,
                                layout=build_block_layout(self.regions, params, geom), scale=self.scale, bias=bias)


def unit_rows(x: Tensor) -> Tensor:
    """``x / |x|`` over the last dim, in x's dtype with autocast off: OVQ's, VQ's and the ``qk_norm`` layers'
    unit keys (and, through :func:`scaled_unit_queries`, queries). CUDA's autocast computes the norm in fp32
    and so hands back fp32 rows for bf16 ``x`` (the CPU's keeps bf16): an op's bits would depend on whether
    autocast is on (docs/precision.md)."""
    with no_autocast(x):
        return F.normalize(x, dim=-1)


def scaled_unit_queries(q: Tensor, beta: Tensor) -> Tensor:
    """``beta_h q / |q|``, the unit queries with a per-head temperature of OVQ, VQ and the ``qk_norm`` layers:
    q ``[B, H, T, D]``, beta ``[H]`` -> ``[B, H, T, D]`` in q's dtype (:func:`unit_rows`), written token-major
    (module docstring)."""
    qn = unit_rows(q.transpose(1, 2))  # [B, T, H, D]
    return (qn * beta.to(qn.dtype).view(1, 1, -1, 1)).transpose(1, 2)


def pad_queries(q: Tensor, n: int) -> Tensor:
    """``q [B, H, T, D]`` padded with zero rows up to ``n`` queries, written token-major (module docstring);
    ``q`` itself when it is ``n`` long already."""
    tokens = q.transpose(1, 2)
    padded = pad_to(tokens, 1, n)
    return q if padded is tokens else padded.transpose(1, 2)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def program_geometry(T: int, n_state: int, block_size: int) -> Geometry:
    """The geometry :func:`build_program` gives a program of ``T`` queries and tokens after ``n_state`` state rows:
    both padded up to ``block_size``, the blocks' size on both sides."""
    t_pad = _round_up(max(T, 1), block_size)
    n_state = _round_up(n_state, block_size) if n_state else 0
    return Geometry(q_len=T, q_pad=t_pad, n_state=n_state, kv_tokens=t_pad, block_q=block_size, block_kv=block_size)


def _kv_rows(state: Tensor | None, n_state: int, tokens: Tensor, t_pad: int) -> Tensor:
    """``[state ; zeros ; tokens ; zeros]`` along dim 2, ``[B, H, n_state + t_pad, D]``: one
    concatenation, each row written once (padding each part first would copy the state twice). Under
    symbolic sizes the parts are padded instead: a gap of zero rows whose size can be 0 or 1 makes
    torch guard on those values, so the graph would recompile for lengths that fill their blocks."""
    if state is None:
        return pad_to(tokens, 2, t_pad)
    if is_symbolic(n_state) or is_symbolic(t_pad):
        return torch.cat([pad_to(state, 2, n_state), pad_to(tokens, 2, t_pad)], dim=2)
    B, H, S, D = state.shape
    gaps = [state.new_zeros(B, H, n, D) for n in (n_state - S, t_pad - tokens.shape[2])]
    return torch.cat([state, gaps[0], tokens, gaps[1]], dim=2)


def build_program(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    regions: tuple[Region, ...] | list[Region],
    *,
    scale: float,
    state_k: Tensor | None = None,
    state_v: Tensor | None = None,
    state_bias: Tensor | None = None,
    block_size: int = DEFAULT_BLOCK,
) -> AttentionProgram:
    """Lay out ``[state rows ; tokens]`` and build the block lists.

    q, k, v: ``[B, H, T, D]`` (v: ``[B, H, T, Dv]``); state_k/state_v: ``[B, H, S, D]``
    rows placed before the tokens (S padded up to ``block_size``, padded rows get
    ``-inf`` bias); state_bias: ``[B, H, S]`` bias of the state rows (the program keeps it in fp32, in
    fp64 for a float64 program).
    Sequence lengths are padded up to ``block_size`` (a power of two >= 16); padding
    never reaches a real query because every token region is causal.

    q, k, v are cast to their compute dtype (:mod:`recurrences.precision`), the state
    rows to the same dtype; the program runs in it.
    """
    check_qkv(q, k, v)
    block_size = plain_int(check_block_size("block_size", block_size))  # an option: one graph per value
    dtype = compute_dtype(q, k, v)
    q, k, v, state_k, state_v = to_dtype(dtype, q, k, v, state_k, state_v)
    regions = tuple(regions)
    B, H, T, _ = q.shape
    if (state_k is None) != (state_v is None) or (state_k is not None and state_k.shape[:3] != state_v.shape[:3]):
        raise ValueError("state_k and state_v must both be given with matching [B, H, S]")
    s_real = 0 if state_k is None else state_k.shape[2]
    geom = program_geometry(T, s_real, block_size)
    n_state, t_pad = geom.n_state, geom.kv_tokens
    bias = None
    if state_k is not None:
        sb = torch.zeros(B, H, s_real, device=q.device) if state_bias is None else state_bias
        bias = pad_to(pad_to(sb.to(work_dtype(q)), 2, n_state, value=float("-inf")), 2, n_state + t_pad)
    k = _kv_rows(state_k, n_state, k, t_pad)
    v = _kv_rows(state_v, n_state, v, t_pad)
    q = pad_queries(q, geom.q_pad)
    params = tuple(r.params(geom, q.device) for r in regions)
    layout = build_block_layout(regions, params, geom)
    return AttentionProgram(q=q, k=k, v=v, regions=regions, params=params, layout=layout, scale=scale, bias=bias)
