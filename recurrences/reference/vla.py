"""Token-by-token reference of Variational Linear Attention (VLA paper, arXiv 2605.11196, eqs. 8-11, §5.4).

The paper's loop, in its orientation (``S`` ``[Dv, Dk]``, ``A`` ``[Dk, Dk]``), per token::

    k̂_t = k_t / ||k_t||,  û_t = u_t / ||u_t||                      (unit key, unit penalty direction)
    z = A_{t-1} û_t,  δ = 1 + û_t·z,  A_t = A_{t-1} - z z^T / δ      (Sherman-Morrison, eq. 9)
    e_t = v_t - S_{t-1} k̂_t,  α̂_t = A_t k̂_t / ||A_t k̂_t||,  S_t = S_{t-1} + e_t α̂_t^T   (eq. 10)
    o_t = S_t φ(q_t) / max(φ(q_t)·Σ_{s<=t} φ(k_s), eps)             (eq. 11, φ = elu + 1)

with ``A_0 = I / lambda0`` and, after every ``refresh_every``-th token (``t = refresh_every,
2 refresh_every, ...``, 1-based), the identity refresh ``A_t += refresh_eps I`` (§5.4:
every 20 steps, 1e-3). Norms are floored at ``eps``. Computed in float32 (float64 for
float64 inputs). Test oracle for :func:`recurrences.vla.vla_chunked`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .linear import RecurrentReferenceResult, compute_dtype, elu_plus_one


def _unit(x: Tensor, eps: float) -> Tensor:
    return x / torch.clamp(torch.sqrt((x * x).sum(-1, keepdim=True)), min=eps)


def vla_reference(q: Tensor, k: Tensor, v: Tensor, u: Tensor, *, lambda0: float = 0.1, refresh_every: int = 20,
                  refresh_eps: float = 1e-3, eps: float = 1e-4) -> RecurrentReferenceResult:
    """q, k, u ``[B, H, T, Dk]``, v ``[B, H, T, Dv]`` -> :class:`RecurrentReferenceResult`
    (with ``penalty``, ``alpha``, ``k_unit``). ``refresh_every=0`` turns the refresh off."""
    dt = compute_dtype(q)
    q32, k, v, u = q.to(dt), k.to(dt), v.to(dt), u.to(dt)
    B, H, T, Dk = k.shape
    eye = torch.eye(Dk, dtype=dt, device=q.device)
    A = (eye / lambda0).expand(B, H, Dk, Dk)
    S = q32.new_zeros(B, H, v.shape[-1], Dk)
    ksum = q32.new_zeros(B, H, Dk)
    outs, norms, alphas, kunits = [], [], [], []
    for t in range(T):
        kh, uh = _unit(k[:, :, t], eps), _unit(u[:, :, t], eps)
        z = torch.einsum("bhij,bhj->bhi", A, uh)
        delta = 1 + (uh * z).sum(-1)
        A = A - z[..., :, None] * z[..., None, :] / delta[..., None, None]
        e = v[:, :, t] - torch.einsum("bhvk,bhk->bhv", S, kh)
        alpha = _unit(torch.einsum("bhij,bhj->bhi", A, kh), eps)
        S = S + e[..., :, None] * alpha[..., None, :]
        ksum = ksum + elu_plus_one(k[:, :, t])
        fq = elu_plus_one(q32[:, :, t])
        den = torch.clamp((fq * ksum).sum(-1, keepdim=True), min=eps)
        outs.append(torch.einsum("bhvk,bhk->bhv", S, fq) / den)
        norms.append(torch.linalg.matrix_norm(S))
        alphas.append(alpha)
        kunits.append(kh)
        if refresh_every and (t + 1) % refresh_every == 0:
            A = A + refresh_eps * eye
    return RecurrentReferenceResult(torch.stack(outs, 2).to(q.dtype), S, torch.stack(norms, -1), A,
                                    torch.stack(alphas, 2), torch.stack(kunits, 2))
