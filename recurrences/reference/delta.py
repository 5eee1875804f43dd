"""Token-by-token reference of the delta rule (DeltaNet; Schlag et al. 2021, Yang et al. 2024).

The loop, in the paper's orientation (``S`` ``[Dv, Dk]``, ``S k -> v``)::

    e_t = v_t - S_{t-1} k_t,   S_t = S_{t-1} + β_t e_t k_t^T,   o_t = S_t q_t

``β_t`` is a per-token, per-head write strength. Keys are used as given (the layer
L2-normalises them). Computed in float32 (float64 for float64 inputs). Test oracle for
:func:`recurrences.delta.delta_rule_chunked`.
"""
from __future__ import annotations

from torch import Tensor
import torch

from .linear import RecurrentReferenceResult, compute_dtype


def delta_rule_reference(q: Tensor, k: Tensor, v: Tensor, beta: Tensor) -> RecurrentReferenceResult:
    """q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]``, beta ``[B, H, T]`` -> :class:`RecurrentReferenceResult`."""
    dt = compute_dtype(q)
    q32, k, v, beta = q.to(dt), k.to(dt), v.to(dt), beta.to(dt)
    B, H, T, Dk = k.shape
    S = q32.new_zeros(B, H, v.shape[-1], Dk)
    outs, norms = [], []
    for t in range(T):
        kt = k[:, :, t]
        e = v[:, :, t] - torch.einsum("bhvk,bhk->bhv", S, kt)
        S = S + beta[:, :, t, None, None] * e[..., :, None] * kt[..., None, :]
        outs.append(torch.einsum("bhvk,bhk->bhv", S, q32[:, :, t]))
        norms.append(torch.linalg.matrix_norm(S))
    return RecurrentReferenceResult(torch.stack(outs, 2).to(q.dtype), S, torch.stack(norms, -1))
