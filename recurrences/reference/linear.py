"""Token-by-token reference of causal linear attention (Katharopoulos et al.; VLA paper, arXiv 2605.11196, eq. 3).

The paper's loop, in the paper's orientation: a state ``S`` ``[Dv, Dk]`` and a key sum
``z`` ``[Dk]``, updated one token at a time::

    S_t = S_{t-1} + v_t φ(k_t)^T,   z_t = z_{t-1} + φ(k_t),   o_t = S_t φ(q_t) / max(φ(q_t)·z_t, eps)

with ``φ(x) = elu(x) + 1``. Computed in float32 (float64 for float64 inputs); the output
is cast back to q's dtype. Test oracle for :func:`recurrences.linear.linear_attention_chunked`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class RecurrentReferenceResult:
    """What the reference loops of the non-softmax recurrences return.

    out ``[B, H, T, Dv]`` (q's dtype); state ``[B, H, Dv, Dk]``: ``S_T`` in the paper's
    orientation (``S k -> v``); state_norms ``[B, H, T]``: ``||S_t||_F`` after each token.
    VLA adds penalty ``[B, H, Dk, Dk]`` (``A_T``), alpha and k_unit ``[B, H, T, Dk]`` (the
    unit write direction ``α̂_t`` and unit key ``k̂_t`` of every step).
    """

    out: Tensor
    state: Tensor
    state_norms: Tensor
    penalty: Tensor | None = None
    alpha: Tensor | None = None
    k_unit: Tensor | None = None


def compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def elu_plus_one(x: Tensor) -> Tensor:
    """``elu(x) + 1`` written out: ``x + 1`` for ``x > 0``, ``exp(x)`` otherwise."""
    return torch.where(x > 0, x + 1, torch.exp(torch.clamp(x, max=0.0)))


def linear_attention_reference(q: Tensor, k: Tensor, v: Tensor, *, eps: float = 1e-6) -> RecurrentReferenceResult:
    """q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]`` -> :class:`RecurrentReferenceResult`."""
    dt = compute_dtype(q)
    q32, k, v = q.to(dt), k.to(dt), v.to(dt)
    B, H, T, Dk = k.shape
    S = q32.new_zeros(B, H, v.shape[-1], Dk)
    z = q32.new_zeros(B, H, Dk)
    outs, norms = [], []
    for t in range(T):
        fk, fq = elu_plus_one(k[:, :, t]), elu_plus_one(q32[:, :, t])
        S = S + v[:, :, t, :, None] * fk[:, :, None, :]
        z = z + fk
        num = torch.einsum("bhvk,bhk->bhv", S, fq)
        den = (fq * z).sum(-1, keepdim=True)
        outs.append(num / torch.clamp(den, min=eps))
        norms.append(torch.linalg.matrix_norm(S))
    return RecurrentReferenceResult(torch.stack(outs, 2).to(q.dtype), S, torch.stack(norms, -1))
