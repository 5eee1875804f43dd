"""``MultiHeadProjection``: the projections every attention layer shares.

Owns ``qkv_proj`` (``[B, T, hidden] -> 3 x [B, H, T, head_dim]``; with gradients recorded its weight is
applied as two products, q/k and v, so that what the backward keeps of one does not hold the other) and ``o_proj``
(``[B, H, T, head_dim] -> [B, T, hidden]``), and validates the sizes.

``qk_conv=K > 0`` adds a depthwise causal convolution of width ``K`` over time on the
q and k projections (the OVQ paper's appendix-C tweak, arXiv 2602.03922 §9: "applying
convolutions to query and keys"), initialised to the identity (last tap 1), so a
layer with it starts out equal to one without. Each q/k channel at ``t`` then mixes
the projections of tokens ``t-K+1 .. t``: a key can name the tokens before it without
a previous-token head in an earlier layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recurrences.checks import check_int, check_layer_input
from recurrences.precision import rounded, to_compute_dtype, widened

from ..profiling import stage
from .base import AttentionLayer


class MultiHeadProjection(AttentionLayer):
    """The projections, and the default ``_project`` (q, k, v ``[B, H, T, head_dim]`` and the conv
    tail, continuing after a cache's ``conv``) and ``_output`` (``o_proj``) hooks of
    :class:`~ovqflex.layers.base.AttentionLayer`."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int | None, backend: str | None,
                 qk_conv: int = 0):
        super().__init__()
        check_int("hidden_size", hidden_size)
        check_int("num_heads", num_heads)
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads} "
                                 f"(or give head_dim)")
            head_dim = hidden_size // num_heads
        check_int("head_dim", head_dim)
        self.hidden_size, self.num_heads, self.head_dim, self.backend = hidden_size, num_heads, head_dim, backend
        self.qkv_proj = nn.Linear(hidden_size, 3 * num_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        check_int("qk_conv", qk_conv, minimum=0)
        self.qk_conv = qk_conv
        if qk_conv:
            weight = torch.zeros(2 * num_heads * head_dim, 1, qk_conv)
            weight[:, 0, -1] = 1.0
            self.qk_conv_weight = nn.Parameter(weight)  # [2*H*D, 1, K] depthwise taps, oldest first

    def check_input(self, x: Tensor) -> None:
        """x ``[B, T, hidden]`` in the projections' dtype (any floating dtype under autocast)."""
        check_layer_input(x, self.hidden_size, self.qkv_proj.weight.dtype)

    def split_heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x ``[B, T, hidden]`` -> q, k, v ``[B, H, T, head_dim]``."""
        return self.split_heads_cached(x, None)[:3]

    def split_heads_cached(self, x: Tensor, conv_tail: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Like :meth:`split_heads`, continuing after earlier tokens: ``conv_tail``
        ``[B, 2*H*D, qk_conv-1]`` holds the raw q/k projections of the ``qk_conv-1`` tokens
        before ``x`` (None: none, zero padding as at the sequence start). Returns q, k, v and
        the tail after ``x`` (None without ``qk_conv``)."""
        self.check_input(x)
        B, T, _ = x.shape
        n = 2 * self.num_heads * self.head_dim
        weight = self.qkv_proj.weight
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            # q/k and v from products of their own (x cast once for both under autocast): the backward keeps q and
            # k (OVQ's and VQ's normalization reads them) or v (flex reads it beside the rotated q, k), and views
            # of one [B, T, 3*H*D] product kept all three alive for it
            (x,) = to_compute_dtype(x)
            qk, v = F.linear(x, weight[:n]), F.linear(x, weight[n:])  # [B, T, 2HD], [B, T, HD]
        else:  # nothing kept for a backward: one product, the fewest launches and ops for a decode step
            qkv = self.qkv_proj(x)  # [B, T, 3HD]
            if not self.qk_conv:
                return (*self._heads(qkv), None)
            qk, v = qkv[..., :n], qkv[..., n:]
        if not self.qk_conv:
            return (*self._heads(qk), *self._heads(v), None)
        prev = qk.new_zeros(B, self.qk_conv - 1, n) if conv_tail is None else conv_tail.to(qk.dtype).transpose(1, 2)
        qk = torch.cat([prev, qk], dim=1)  # causal: the K-1 tokens before x, then x
        tail = qk[:, qk.shape[1] - (self.qk_conv - 1):].transpose(1, 2)  # the cache's [B, 2HD, K-1]
        # in fp32, rounded once: the same q, k eager and compiled (recurrences/precision.py, rule 4)
        qk = rounded(_causal_depthwise(widened(qk), widened(self.qk_conv_weight)), qk.dtype)
        return (*self._heads(qk), *self._heads(v), tail)

    def _heads(self, x: Tensor) -> tuple[Tensor, ...]:
        """x ``[B, T, n*H*D]`` -> n views ``[B, H, T, D]``."""
        B, T, width = x.shape
        n = width // (self.num_heads * self.head_dim)  # not -1: an empty batch leaves it ambiguous
        return x.view(B, T, n, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def merge(self, o: Tensor) -> Tensor:
        """o ``[B, H, T, head_dim]`` -> ``[B, T, hidden]``."""
        B, H, T, D = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * D))

    def _project(self, x: Tensor, cache, use_cache: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """x ``[B, T, hidden]`` -> q, k, v ``[B, H, T, head_dim]`` and the conv tail after x."""
        with stage("proj"):
            return self.split_heads_cached(x, None if cache is None else cache.conv)

    def _output(self, o: Tensor, inputs) -> Tensor:
        """o ``[B, H, T, head_dim]`` -> y ``[B, T, hidden]``."""
        with stage("proj"):
            return self.merge(o)


def _causal_depthwise(x: Tensor, weight: Tensor) -> Tensor:
    """Depthwise convolution over time of ``x [B, T + K - 1, C]`` (the ``K - 1`` earlier tokens first) with
    ``weight [C, 1, K]`` (oldest tap first) -> ``[B, T, C]``: ``sum_j weight[:, 0, j] * x[:, j:j + T]``, the
    same sum as ``F.conv1d`` over ``x`` channels-first with ``groups=C``, written as ``K`` shifted products.
    Elementwise, so a compiled graph fuses it and keeps ``T`` symbolic: inductor's convolution backward
    guards the input gradient's strides to ints, which pins a graph to one length (docs/design.md §3.5).
    Time-major like the projections it reads, so neither pass transposes: channels-first, inductor's
    fused CPU backward under bf16 autocast transposed one bf16 32 x 32 tile per tap in one loop, and that
    code (AVX-512, torch 2.11 and 2.13, GCC 12) gave garbage taps' gradients, NaN (docs/torch-versions.md)."""
    K = weight.shape[-1]
    T = x.shape[1] - K + 1
    taps = weight[:, 0, :]  # [C, K]
    out = x[:, :T] * taps[:, 0]
    for j in range(1, K):
        out = out + x[:, j:j + T] * taps[:, j]
    return out
