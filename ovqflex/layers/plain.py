"""Plain attention layers: ``forward(x [B, T, hidden]) -> [B, T, hidden]``."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from masks.program import DEFAULT_BLOCK, build_program
from recurrences.checks import check_choice, check_int, check_tensor

from ..attention import BACKENDS, attend
from ..ops.plain import plain_regions
from .rope import apply_rope


class _PlainAttention(nn.Module):
    """Shared body: fused qkv projection, optional RoPE, one program, output projection."""

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None, rope: bool, rope_base: float,
                 backend: str, block_size: int, regions):
        super().__init__()
        check_int("hidden_size", hidden_size)
        check_int("num_heads", num_heads)
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        check_int("head_dim", head_dim)
        if head_dim % 2 and rope:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        check_choice("backend", backend, BACKENDS)
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.rope, self.rope_base, self.backend, self.block_size = rope, rope_base, backend, block_size
        self.regions = regions
        self.qkv_proj = nn.Linear(hidden_size, 3 * num_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def project(self, x: Tensor, positions: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """x ``[B, T, hidden]`` -> q, k, v ``[B, H, T, head_dim]`` (RoPE applied to q, k)."""
        check_tensor("x", x, 3)
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have last dim hidden_size={self.hidden_size}, got shape {tuple(x.shape)}")
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.rope:
            pos = torch.arange(T, device=x.device) if positions is None else positions
            q = apply_rope(q, pos, base=self.rope_base)
            k = apply_rope(k, pos, base=self.rope_base)
        return q, k, v

    def merge(self, o: Tensor) -> Tensor:
        """o ``[B, H, T, head_dim]`` -> ``[B, T, hidden]``."""
        B, H, T, D = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * D))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.project(x)
        program = build_program(q, k, v, self.regions, scale=self.head_dim**-0.5, block_size=self.block_size)
        return self.merge(attend(program, self.backend))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"rope={self.rope}, regions={self.regions}, backend={self.backend!r}")


class CausalAttention(_PlainAttention):
    """Full causal multi-head attention, NoPE (``rope=False``) or RoPE."""

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None = None, rope: bool = False,
                 rope_base: float = 10000.0, backend: str = "auto", block_size: int = DEFAULT_BLOCK):
        super().__init__(hidden_size, num_heads, head_dim=head_dim, rope=rope, rope_base=rope_base,
                         backend=backend, block_size=block_size, regions=plain_regions())


class SlidingWindowAttention(_PlainAttention):
    """Sliding-window attention with RoPE: a token window of ``window`` tokens, or a
    block window of ``block_window`` chunks of ``chunk_size``; ``n_sinks`` first
    tokens always visible (StreamingLLM)."""

    def __init__(self, hidden_size: int, num_heads: int, *, window: int | None = 512,
                 block_window: int | None = None, chunk_size: int = 128, n_sinks: int = 0,
                 head_dim: int | None = None, rope: bool = True, rope_base: float = 10000.0,
                 backend: str = "auto", block_size: int = DEFAULT_BLOCK):
        if block_window is not None:
            window = None
        regions = plain_regions(window=window, block_window=block_window, chunk_size=chunk_size, n_sinks=n_sinks)
        super().__init__(hidden_size, num_heads, head_dim=head_dim, rope=rope, rope_base=rope_base,
                         backend=backend, block_size=block_size, regions=regions)
        self.window, self.block_window, self.chunk_size, self.n_sinks = window, block_window, chunk_size, n_sinks
