"""Quadratic-form reference of VQ-attention (docs/design.md §4.4, §9.5): the test oracle.

Written independently of the linear form: materialize the quantized keys ``K̂`` of every
token and run dense causal softmax attention, ``softmax(beta · q̂ K̂ᵀ + B + causal) V``,
where ``B`` is the optional LongVQ local bias (``local_bias[h]`` on keys of the query's
own chunk and the chunk before it, 0 on older keys). O(T²) time and memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class VQReferenceResult:
    out: Tensor     # [B, H, T, Dv], dtype of q
    codes: Tensor   # [B, H, T] int64, nearest code of every key
    k_hat: Tensor   # [B, H, T, D] quantized (unit) keys, with the estimator's gradient
    gaps: Tensor    # [B, H, T] float32, best similarity minus the chosen code's (0 for the loop's own codes)


def vq_attention_reference(q: Tensor, k: Tensor, v: Tensor, codebook: Tensor, beta: Tensor, *,
                           chunk_size: int = 128, local_bias: Tensor | None = None, estimator: str = "ste",
                           code_bias: Tensor | None = None, codes: Tensor | None = None) -> VQReferenceResult:
    """q, k ``[B, H, T, D]``, v ``[B, H, T, Dv]``, codebook ``[H, N, D]``, beta ``[H]``.

    ``codes`` ``[B, H, T]`` forces the assignments (compare routes first, then outputs under
    identical routes); otherwise each key takes its most similar code, on fp32 copies of the
    keys and the codebook normalized in fp32 (whatever the input dtype, as the fused op).
    ``gaps`` says how far each (forced) code's similarity falls short of the best code's.
    """
    B, H, T, D = q.shape
    qn, kn = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    cb = F.normalize(codebook, dim=-1).to(kn.dtype)
    with torch.no_grad():
        k32 = F.normalize(k.detach().float(), dim=-1)
        cb32 = F.normalize(codebook.detach().float(), dim=-1)
        sim = k32 @ cb32.transpose(-1, -2).unsqueeze(0)  # [B, H, T, N]
        if code_bias is not None:
            sim = sim + code_bias.float()[None, :, None, :]
        if codes is None:
            codes = sim.argmax(-1)
        gaps = sim.max(-1).values - sim.gather(-1, codes.unsqueeze(-1)).squeeze(-1)
    chosen = cb[torch.arange(H, device=q.device).view(1, H, 1), codes]  # [B, H, T, D]
    if estimator == "ste":
        k_hat = kn + (chosen - kn).detach()
    elif estimator == "diveq":
        d = chosen - kn
        n = torch.sqrt((d * d).sum(-1, keepdim=True))
        k_hat = kn + n * (d / n.clamp_min(1e-12)).detach()
    else:
        raise ValueError(f"estimator must be 'ste' or 'diveq', got {estimator!r}")
    s = beta.view(1, H, 1, 1) * (qn @ k_hat.transpose(-1, -2))  # [B, H, T, T]
    i = torch.arange(T, device=q.device).view(T, 1)
    j = torch.arange(T, device=q.device).view(1, T)
    if local_bias is not None:
        near = (j // chunk_size) >= (i // chunk_size - 1)
        s = s + torch.where(near, 1.0, 0.0).to(s.dtype) * local_bias.view(1, H, 1, 1)
    s = s.masked_fill(j > i, float("-inf"))
    out = torch.softmax(s.to(torch.promote_types(s.dtype, torch.float32)), dim=-1).to(v.dtype) @ v  # fp32 or fp64
    return VQReferenceResult(out.to(q.dtype), codes, k_hat, gaps)
