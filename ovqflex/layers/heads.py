"""``MultiHeadProjection``: the projections every attention layer shares.

Owns the fused ``qkv_proj`` (``[B, T, hidden] -> 3 x [B, H, T, head_dim]``) and
``o_proj`` (``[B, H, T, head_dim] -> [B, T, hidden]``), and validates the sizes.
"""
from __future__ import annotations

from torch import Tensor, nn

from recurrences.checks import check_choice, check_int, check_tensor

from ..attention import BACKENDS


class MultiHeadProjection(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int | None, backend: str):
        super().__init__()
        check_int("hidden_size", hidden_size)
        check_int("num_heads", num_heads)
        head_dim = hidden_size // num_heads if head_dim is None else head_dim
        check_int("head_dim", head_dim)
        check_choice("backend", backend, BACKENDS)
        self.hidden_size, self.num_heads, self.head_dim, self.backend = hidden_size, num_heads, head_dim, backend
        self.qkv_proj = nn.Linear(hidden_size, 3 * num_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def split_heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x ``[B, T, hidden]`` -> q, k, v ``[B, H, T, head_dim]``."""
        check_tensor("x", x, 3)
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have last dim hidden_size={self.hidden_size}, got shape {tuple(x.shape)}")
        B, T, _ = x.shape
        return self.qkv_proj(x).view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def merge(self, o: Tensor) -> Tensor:
        """o ``[B, H, T, head_dim]`` -> ``[B, T, hidden]``."""
        B, H, T, D = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * D))
