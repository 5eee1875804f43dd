"""Rotary position embedding (RoPE), full or partial, half-split or interleaved pairs.

``apply_rope(x, positions, rope_dims, base, interleaved)`` rotates the first
``rope_dims`` channels of ``x [B, H, T, D]``; the rest pass through. Pairs are
``(x[i], x[i + r/2])`` (half-split, GPT-NeoX/Llama) or ``(x[2i], x[2i+1])``
(interleaved, as KVM uses). Angles and the rotation are computed in fp32 (fp64 for an fp64 ``x``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from recurrences.precision import widened


def rope_angles(positions: Tensor, rope_dims: int, base: float = 10000.0,
                dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """cos, sin of ``positions [T] * base^(-2i/rope_dims)``: each ``[T, 1, rope_dims // 2]`` in ``dtype``, to
    broadcast over the heads of a token-major ``[B, T, H, rope_dims // 2]``."""
    inv = base ** (-torch.arange(0, rope_dims, 2, device=positions.device, dtype=dtype) / rope_dims)
    ang = positions.to(dtype)[:, None, None] * inv
    return torch.cos(ang), torch.sin(ang)


def apply_rope(
    x: Tensor, positions: Tensor, rope_dims: int | None = None, base: float = 10000.0, interleaved: bool = False
) -> Tensor:
    """Rotate ``x [B, H, T, D]`` at ``positions [T]``; ``rope_dims`` (even, default D)."""
    D = x.shape[-1]
    r = D if rope_dims is None else rope_dims
    if r % 2 or not 0 <= r <= D:
        raise ValueError(f"rope_dims must be even and in [0, {D}], got {r}")
    if r == 0:
        return x
    # written token-major, [B, T, H, D] (masks/program.py, "Queries are written token-major")
    xt = x.transpose(-3, -2)
    xr, rest = widened(xt[..., :r]), xt[..., r:]
    cos, sin = rope_angles(positions, r, base, xr.dtype)  # [T, 1, r/2]
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    else:
        a, b = xr[..., : r // 2], xr[..., r // 2 :]
        rot = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return torch.cat([rot.to(x.dtype), rest], dim=-1).transpose(-3, -2)
