"""Non-softmax recurrent layers (SPEC §4.6): ``forward(x [B, T, hidden]) -> [B, T, hidden]``.

Each owns the shared q/k/v/output projections (:class:`MultiHeadProjection`, with the
optional causal q/k convolution) and calls one op of ``ovqflex.ops.linear``; ``out_norm=True``
adds a per-head RMSNorm (learned ``[head_dim]`` gain shared by the heads) on the op's output
before the output projection, as flash-linear-attention's layers do:

- :class:`LinearAttention`: ELU+1 linear attention (``linear_attention``).
- :class:`DeltaNetAttention`: unit q/k, ``β = sigmoid(x W_β)`` per token and head (``delta_rule``).
- :class:`VLAAttention`: penalty directions ``u = f_θ(k)`` from a learned ``[head_dim, head_dim]``
  map of the raw key shared by the heads (seed 002 eq. 8), then ``vla_attention``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recurrences.checks import check_int, check_number
from recurrences.vla import VLAOptions

from ..ops.linear import delta_rule, linear_attention, vla_attention
from .heads import MultiHeadProjection


class _Recurrent(MultiHeadProjection):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int | None, qk_conv: int, out_norm: bool):
        super().__init__(hidden_size, num_heads, head_dim, None, qk_conv)
        self.out_norm = nn.RMSNorm(self.head_dim) if out_norm else None

    def finish(self, o: Tensor) -> Tensor:
        """op output ``[B, H, T, head_dim]`` -> ``[B, T, hidden]``."""
        return self.merge(o if self.out_norm is None else self.out_norm(o))


class LinearAttention(_Recurrent):
    """Multi-head causal linear attention (ELU+1 features, normalised read-out).

    x ``[B, T, hidden]`` -> ``[B, T, hidden]``; q, k, v ``[B, H, T, head_dim]`` inside.
    """

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None = None, chunk_size: int = 64,
                 eps: float = 1e-6, qk_conv: int = 0, out_norm: bool = False):
        super().__init__(hidden_size, num_heads, head_dim, qk_conv, out_norm)
        self.chunk_size, self.eps = check_int("chunk_size", chunk_size), check_number("eps", eps)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.split_heads(x)
        return self.finish(linear_attention(q, k, v, chunk_size=self.chunk_size, eps=self.eps))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"chunk_size={self.chunk_size}, out_norm={self.out_norm is not None}")


class DeltaNetAttention(_Recurrent):
    """Multi-head DeltaNet: L2-normalised q and k, write strength ``β = sigmoid(x W_β)``
    ``[B, H, T]`` (``W_β``: ``hidden -> num_heads``, no bias), the delta rule.

    x ``[B, T, hidden]`` -> ``[B, T, hidden]``.
    """

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None = None, chunk_size: int = 64,
                 qk_conv: int = 0, out_norm: bool = False):
        super().__init__(hidden_size, num_heads, head_dim, qk_conv, out_norm)
        self.chunk_size = check_int("chunk_size", chunk_size)
        self.beta_proj = nn.Linear(hidden_size, num_heads, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.split_heads(x)
        beta = torch.sigmoid(self.beta_proj(x)).transpose(1, 2)      # [B, H, T]
        o = delta_rule(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, beta.to(q.dtype),
                       chunk_size=self.chunk_size)
        return self.finish(o)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"chunk_size={self.chunk_size}, out_norm={self.out_norm is not None}")


class VLAAttention(_Recurrent):
    """Multi-head Variational Linear Attention (seed 002).

    x ``[B, T, hidden]`` -> ``[B, T, hidden]``. ``u = f_θ(k)`` ``[B, H, T, head_dim]`` with
    ``f_θ`` (``penalty_proj``) a bias-free ``head_dim -> head_dim`` linear map shared by the
    heads; ``vla_attention`` unit-normalises k and u. Keyword options are the fields of
    :class:`recurrences.vla.VLAOptions` (``lambda0``, ``refresh_every``, ``refresh_eps``,
    ``eps``, ``chunk_size``), or pass ``options=VLAOptions(...)``.
    """

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None = None, qk_conv: int = 0,
                 out_norm: bool = False, options: VLAOptions | None = None, **option_kwargs):
        super().__init__(hidden_size, num_heads, head_dim, qk_conv, out_norm)
        if options is not None and option_kwargs:
            raise ValueError(f"give options or keyword options, not both (got {sorted(option_kwargs)})")
        known = {f.name for f in dataclasses.fields(VLAOptions)}
        unknown = sorted(set(option_kwargs) - known)
        if unknown:
            raise TypeError(f"unknown VLA options {unknown}; known: {sorted(known)}")
        self.options = options if options is not None else VLAOptions(**option_kwargs)
        self.penalty_proj = nn.Linear(self.head_dim, self.head_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.split_heads(x)
        u = self.penalty_proj(k)
        return self.finish(vla_attention(q, k, v, u, **dataclasses.asdict(self.options)))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"out_norm={self.out_norm is not None}, options={self.options}")
