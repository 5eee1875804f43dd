"""Multi-head damped EMA (MEGA, Ma et al. 2022), the SSM of the LongVQ block (SPEC §4.5).

Every channel ``d`` of ``x [B, T, D]`` runs ``n`` damped EMAs ("heads") and mixes them:

    h_t = p ⊙ β ⊙ x_t + (1 − p ⊙ α) ⊙ h_{t−1},     y_t = Σ_n γ_n h_{t,n} + ω ⊙ x_t

with ``p = sigmoid(delta_logit)``, ``α = sigmoid(alpha_logit)`` (all ``[D, n]``, ω ``[D]``).
Unrolled, ``y = K * x + ω x`` is a causal convolution with the kernel
``K[d, t] = Σ_n γ p β (1 − p α)^t`` — computed once per call and applied with an FFT of
length ``2T`` (:func:`damped_ema`), O(T log T), differentiable, no Python loop.
:func:`damped_ema_reference` is the token-by-token recurrence, the test oracle.
"""
from __future__ import annotations

import torch
from torch import Tensor


def ema_kernel(delta_logit: Tensor, alpha_logit: Tensor, beta: Tensor, gamma: Tensor, length: int) -> Tensor:
    """``K [D, length]`` of the damped EMA (parameters ``[D, n]``), fp32."""
    p = torch.sigmoid(delta_logit.float())
    decay = 1 - p * torch.sigmoid(alpha_logit.float())  # [D, n] in (0, 1)
    t = torch.arange(length, device=p.device, dtype=torch.float32)
    vander = torch.exp(torch.log(decay)[..., None] * t)  # [D, n, T]
    return torch.einsum("dn,dnt->dt", (p * beta.float() * gamma.float()), vander)


def damped_ema(x: Tensor, delta_logit: Tensor, alpha_logit: Tensor, beta: Tensor, gamma: Tensor,
               omega: Tensor) -> Tensor:
    """x ``[B, T, D]`` -> ``y [B, T, D]`` (dtype of x): the EMA as an FFT causal convolution."""
    B, T, D = x.shape
    k = ema_kernel(delta_logit, alpha_logit, beta, gamma, T)  # [D, T]
    n = 2 * T
    xf = torch.fft.rfft(x.float().transpose(1, 2), n=n)  # [B, D, n/2+1]
    kf = torch.fft.rfft(k, n=n)
    y = torch.fft.irfft(xf * kf, n=n)[..., :T].transpose(1, 2)
    return (y + x.float() * omega.float()).to(x.dtype)


def damped_ema_reference(x: Tensor, delta_logit: Tensor, alpha_logit: Tensor, beta: Tensor, gamma: Tensor,
                         omega: Tensor) -> Tensor:
    """The recurrence, one token at a time (fp32 state)."""
    B, T, D = x.shape
    p = torch.sigmoid(delta_logit)
    decay = 1 - p * torch.sigmoid(alpha_logit)
    h = x.new_zeros(B, D, delta_logit.shape[1], dtype=torch.float32)
    ys = []
    for t in range(T):
        h = p * beta * x[:, t, :, None].float() + decay * h
        ys.append((h * gamma).sum(-1) + omega * x[:, t].float())
    return torch.stack(ys, dim=1).to(x.dtype)
