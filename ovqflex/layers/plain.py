"""Plain attention layers: ``forward(x [B, T, hidden]) -> [B, T, hidden]``."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from masks.program import DEFAULT_BLOCK, AttentionProgram, build_program
from recurrences.checks import check_block_size

from ..attention import attend
from ..cache.base import check_cache
from ..cache.plain import PlainCache
from ..ops.decode import positions
from ..ops.plain import plain_regions, window_regions
from ..ops.plain_decode import plain_decode, plain_prefill
from ..profiling import stage
from .heads import MultiHeadProjection
from .rope import apply_rope


class _PlainAttention(MultiHeadProjection):
    """Shared body: fused qkv projection, optional RoPE, one program, output projection.

    ``qk_norm=True`` is the OVQ paper's baseline form (arXiv 2602.03922, §8.2): q and k are
    L2-normalized per head and scored as ``beta[h] * <q̂, k̂>`` with a learned ``beta``
    ``[H]`` initialised to ``sqrt(head_dim)``; otherwise scores are ``<q, k> / sqrt(head_dim)``.
    """

    supports_cache = True  # forward(x, cache=None, use_cache=False): docs/design.md §6

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None, rope: bool, rope_base: float,
                 qk_norm: bool, backend: str, block_size: int, regions, qk_conv: int = 0):
        super().__init__(hidden_size, num_heads, head_dim, backend, qk_conv)
        if self.head_dim % 2 and rope:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        self.rope, self.rope_base, self.regions = rope, rope_base, regions
        self.block_size = check_block_size("block_size", block_size)
        self.qk_norm = qk_norm
        if qk_norm:
            self.beta = nn.Parameter(torch.full((num_heads,), math.sqrt(self.head_dim)))

    def project(self, x: Tensor, positions: Tensor | None = None,
                conv_tail: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """x ``[B, T, hidden]`` -> q, k, v ``[B, H, T, head_dim]`` (RoPE applied to q, k at
        ``positions``, default ``0..T-1``) and the q/k conv tail (see ``split_heads_cached``)."""
        q, k, v, tail = self.split_heads_cached(x, conv_tail)
        if self.qk_norm:
            q = F.normalize(q, dim=-1) * self.beta.to(q.dtype).view(1, -1, 1, 1)
            k = F.normalize(k, dim=-1)
        if self.rope:
            pos = torch.arange(x.shape[1], device=x.device) if positions is None else positions
            q = apply_rope(q, pos, base=self.rope_base)
            k = apply_rope(k, pos, base=self.rope_base)
        return q, k, v, tail

    @property
    def scale(self) -> float:
        return 1.0 if self.qk_norm else self.head_dim**-0.5

    def program(self, x: Tensor) -> AttentionProgram:
        """The layer's attention program for x ``[B, T, hidden]`` (what the visualizer draws)."""
        with stage("proj"):
            q, k, v, _ = self.project(x)
        with stage("block_mask"):
            return build_program(q, k, v, self.regions, scale=self.scale, block_size=self.block_size)

    def forward(self, x: Tensor, cache: PlainCache | None = None, use_cache: bool = False):
        """x ``[B, T, hidden]`` -> y ``[B, T, hidden]``; ``(y, cache)`` with ``use_cache=True``
        or a ``cache`` (:class:`~ovqflex.cache.PlainCache`) to continue from."""
        check_cache(cache, PlainCache, self)
        if cache is None:
            with stage("proj"):
                q, k, v, tail = self.project(x)
            with stage("block_mask"):
                program = build_program(q, k, v, self.regions, scale=self.scale, block_size=self.block_size)
            with stage("attention"):
                o = attend(program, self.backend)
            new_cache = plain_prefill(self.regions, k, v, tail) if use_cache else None
        else:
            start = cache.position
            q, k, v, tail = self.project(x, positions(start, x.shape[1], x.device), cache.conv)
            o, new_cache = plain_decode(cache, self.regions, q, k, v, scale=self.scale, conv=tail)
        with stage("proj"):
            y = self.merge(o)
        return y if new_cache is None else (y, new_cache)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"rope={self.rope}, qk_norm={self.qk_norm}, regions={self.regions}, backend={self.backend!r}")


class CausalAttention(_PlainAttention):
    """Full causal multi-head attention, NoPE (``rope=False``) or RoPE."""

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None = None, rope: bool = False,
                 rope_base: float = 10000.0, qk_norm: bool = False, qk_conv: int = 0, backend: str = "auto",
                 block_size: int = DEFAULT_BLOCK):
        super().__init__(hidden_size, num_heads, head_dim=head_dim, rope=rope, rope_base=rope_base,
                         qk_norm=qk_norm, backend=backend, block_size=block_size, regions=plain_regions(),
                         qk_conv=qk_conv)


class SlidingWindowAttention(_PlainAttention):
    """Sliding-window attention with RoPE: a token window of ``window`` tokens, or a
    block window of ``block_window`` chunks of ``chunk_size``; ``n_sinks`` first
    tokens always visible (StreamingLLM)."""

    def __init__(self, hidden_size: int, num_heads: int, *, window: int | None = 512,
                 block_window: int | None = None, chunk_size: int = 128, n_sinks: int = 0,
                 head_dim: int | None = None, rope: bool = True, rope_base: float = 10000.0,
                 qk_norm: bool = False, qk_conv: int = 0, backend: str = "auto", block_size: int = DEFAULT_BLOCK):
        if block_window is not None:
            window = None
        regions = window_regions("SlidingWindowAttention", "CausalAttention", window=window, block_window=block_window,
                                 chunk_size=chunk_size, n_sinks=n_sinks)
        super().__init__(hidden_size, num_heads, head_dim=head_dim, rope=rope, rope_base=rope_base,
                         qk_norm=qk_norm, backend=backend, block_size=block_size, regions=regions,
                         qk_conv=qk_conv)
        self.window, self.block_window, self.chunk_size, self.n_sinks = window, block_window, chunk_size, n_sinks
