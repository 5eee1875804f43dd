"""Causal linear attention (ELU+1 feature map, normalised read-out), chunk-parallel.

Token form (seed 002 eq. 3; the reference loop is ``recurrences/reference/linear.py``)::

    S_t = S_{t-1} + φ(k_t) v_t^T,   z_t = z_{t-1} + φ(k_t),   o_t = φ(q_t)^T S_t / max(φ(q_t)·z_t, eps)

Chunked form, with no Python loop: split ``T`` into chunks of ``C`` (zero-padded at the
end — a zero feature row adds nothing, and padding only follows the real tokens); the
state each chunk starts from is an exclusive cumulative sum over chunks of ``φ(K_c)^T V_c``,
and inside a chunk ``tril(φ(Q_c) φ(K_c)^T)`` is the causal part. Memory
``O(T/C · Dk · Dv)`` per head. Also the helpers the other recurrences share.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def feature_map(x: Tensor) -> Tensor:
    """``φ(x) = elu(x) + 1`` (positive), the linear-attention feature map."""
    return F.elu(x) + 1


def work_dtype(x: Tensor) -> torch.dtype:
    """The recurrences compute in float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def to_chunks(x: Tensor, chunk: int) -> Tensor:
    """``[B, H, T, *rest]`` -> ``[B, H, n, chunk, *rest]``, zero-padded at the end to ``n * chunk``."""
    T = x.shape[2]
    n = -(-T // chunk)
    pad = n * chunk - T
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:2], pad, *x.shape[3:])], dim=2)
    return x.view(*x.shape[:2], n, chunk, *x.shape[3:])


def from_chunks(x: Tensor, T: int) -> Tensor:
    """``[B, H, n, chunk, D]`` -> ``[B, H, T, D]`` (drops the padding)."""
    return x.flatten(2, 3)[:, :, :T]


def _exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    total = x.cumsum(dim)
    return torch.cat([torch.zeros_like(total.narrow(dim, 0, 1)), total.narrow(dim, 0, x.shape[dim] - 1)], dim)


def linear_attention_chunked(q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int = 64, eps: float = 1e-6,
                             return_state: bool = False):
    """q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]`` -> o ``[B, H, T, Dv]`` (q's dtype); with
    ``return_state`` also ``S_T`` ``[B, H, Dv, Dk]`` (the paper's orientation, ``S k -> v``)."""
    T, dt = q.shape[2], work_dtype(q)
    with torch.autocast(q.device.type, enabled=False):
        fq = to_chunks(feature_map(q.to(dt)), chunk_size)            # [B, H, n, C, Dk]; padding rows 0
        fk = to_chunks(feature_map(k.to(dt)), chunk_size)
        vc = to_chunks(v.to(dt), chunk_size)                         # [B, H, n, C, Dv]
        kv = fk.transpose(-1, -2) @ vc                               # [B, H, n, Dk, Dv]
        state = _exclusive_cumsum(kv, 2)                             # state each chunk starts from
        zsum = _exclusive_cumsum(fk.sum(-2), 2)                      # [B, H, n, Dk]
        scores = torch.tril(fq @ fk.transpose(-1, -2))               # [B, H, n, C, C], causal incl. diagonal
        num = fq @ state + scores @ vc
        den = (fq * zsum.unsqueeze(-2)).sum(-1) + scores.sum(-1)     # [B, H, n, C]
        out = from_chunks(num / torch.clamp(den, min=eps).unsqueeze(-1), T).to(q.dtype)
    if not return_state:
        return out
    return out, (state[:, :, -1] + kv[:, :, -1]).transpose(-1, -2)
