"""The VQ codebook quantizer (docs/design.md §4.4; OVQ paper, arXiv 2602.03922, appendix 8.1, LongVQ paper, §3).

Per head ``h`` a codebook ``C[h] ∈ R^{N×d}`` of unit rows. Keys are L2-normalized and
each is assigned its nearest code (largest cosine; for unit vectors the same as the
smallest Euclidean distance), computed in fp32 without grad. Then:

- ``quantize(..., estimator="ste")``: ``k̂ = k + sg(C[z] - k)`` — forward value the code,
  gradient straight through to the key; the codebook gets no gradient (it is learned by
  EMA k-means, :func:`ema_update_`).
- ``quantize(..., estimator="diveq")``: DiVeQ (Vali et al. 2025), ``k̂ = k + ||C[z] - k|| ·
  sg((C[z] - k)/||C[z] - k||)`` — forward value the code, gradient to the key *and* to the
  codebook (through the distance), so the codebook is a trained parameter. The paper's
  directional noise is not used: it would make the quantized keys of one code differ,
  which breaks the linear form == quadratic form invariant.
- ``commitment_loss``: ``mean ||k - sg(C[z])||²`` (VQ-VAE / Transformer-VQ).
- ``ema_update_``: in-place EMA k-means step on the buffers (``decay``), then every code whose
  EMA count fell below ``dead_threshold`` is revived: replaced by a randomly drawn key of the
  current batch (the usual dead-code remedy), its EMA count reset to 1. Under data parallelism
  its statistics are summed over the ranks first (``reduce``): one step, the global batch's.

No host syncs and no data-dependent Python control flow: everything traces under
``torch.compile(fullgraph=True)``.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..precision import no_autocast, routing_keys

ESTIMATORS = ("ste", "diveq")


def assign_codes(k: Tensor, codebook: Tensor, code_bias: Tensor | None = None) -> Tensor:
    """Nearest code of every key: ``[B, H, T]`` int64.

    k ``[B, H, T, D]`` (normalized here), codebook ``[H, N, D]`` (normalized here),
    ``code_bias`` ``[H, N]``: added to the cosine similarities before the argmax (the
    OVQ paper's "no-use penalty" that lets idle codes win). fp32, no grad.
    """
    with torch.no_grad(), no_autocast(k):
        kn = routing_keys(k)
        cb = F.normalize(codebook.detach().float(), dim=-1)
        sim = torch.einsum("bhtd,hnd->bhtn", kn, cb)
        if code_bias is not None:
            sim = sim + code_bias.detach().float()[None, :, None, :]
        return sim.argmax(dim=-1)


def gather_codes(codebook: Tensor, codes: Tensor) -> Tensor:
    """``C[h, codes[b, h, t]]``: codebook ``[H, N, D]``, codes ``[B, H, T]`` -> ``[B, H, T, D]``."""
    B, H, T = codes.shape
    cb = codebook.unsqueeze(0).expand(B, *codebook.shape)  # [B, H, N, D]
    return cb.gather(2, codes[..., None].expand(B, H, T, codebook.shape[-1]))


def quantize(kn: Tensor, codebook: Tensor, codes: Tensor, estimator: str = "ste") -> Tensor:
    """Quantized keys ``k̂ [B, H, T, D]`` (forward value ``codebook[h, codes]``) with the
    estimator's gradient. kn: unit keys; codebook: unit rows ``[H, N, D]``."""
    c = gather_codes(codebook.to(kn.dtype), codes)
    if estimator == "ste":
        return kn + (c.detach() - kn).detach()
    if estimator == "diveq":
        diff = c - kn
        dist = diff.norm(dim=-1, keepdim=True)
        direction = (diff / dist.clamp_min(1e-12)).detach()
        return kn + dist * direction
    raise ValueError(f"estimator must be one of {list(ESTIMATORS)}, got {estimator!r}")


def commitment_loss(kn: Tensor, codebook: Tensor, codes: Tensor) -> Tensor:
    """``mean_{b,h,t} ||k - sg(C[z])||²`` (0-d, fp32): pulls keys toward their codes; 0 for no keys
    (an empty batch), where the mean of none would be NaN."""
    c = gather_codes(codebook.detach().to(kn.dtype), codes)
    sq = (kn - c).float().square().sum(-1)
    return sq.sum() / torch.sym_max(sq.numel(), 1)


def code_histogram(codes: Tensor, n_codes: int) -> Tensor:
    """Tokens per code and head, over batch and time: ``[H, N]`` fp32."""
    B, H, T = codes.shape
    flat = codes.permute(1, 0, 2).reshape(H, B * T)
    return torch.zeros(H, n_codes, device=codes.device).scatter_add(1, flat, torch.ones(H, B * T, device=codes.device))


def codebook_metrics(kn: Tensor, codebook: Tensor, codes: Tensor) -> dict[str, Tensor]:
    """Detached 0-d fp32 metrics of one batch (no host sync):

    ``usage``: fraction of codes used by at least one token (mean over heads);
    ``perplexity``: ``exp(entropy)`` of the code histogram (mean over heads; ``N`` at best);
    ``unused_codes``: codes no token of the batch chose (summed over heads);
    ``rel_quant_error``: ``sum ||k - C[z]||² / sum ||k||²`` (k unit: the mean squared distance).
    """
    with torch.no_grad():
        N = codebook.shape[1]
        hist = code_histogram(codes, N)
        p = hist / hist.sum(-1, keepdim=True).clamp_min(1.0)
        entropy = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
        c = gather_codes(codebook.detach().float(), codes)
        k32 = kn.detach().float()
        err = (k32 - c).square().sum() / k32.square().sum().clamp_min(1e-12)
        return {"usage": (hist > 0).float().mean(), "perplexity": entropy.exp().mean(),
                "unused_codes": (hist == 0).float().sum(), "rel_quant_error": err}


def ema_update_(codebook: Tensor, ema_counts: Tensor, ema_sums: Tensor, kn: Tensor, codes: Tensor, *,
                decay: float, dead_threshold: float, reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """One EMA k-means step, in place on the buffers; returns the revived mask ``[H, N]``.

    codebook ``[H, N, D]`` unit rows, ema_counts ``[H, N]``, ema_sums ``[H, N, D]`` (fp32),
    kn ``[B, H, T, D]`` unit keys, codes ``[B, H, T]`` their assignments.

    ``counts ← decay·counts + (1-decay)·n``, ``sums ← decay·sums + (1-decay)·Σ k``,
    ``C ← normalize(sums / counts)`` (the direction of the EMA mean of the assigned keys).
    Codes with ``counts < dead_threshold`` are revived: ``C ← k`` for a uniformly drawn key
    ``k`` of this batch (global RNG), ``counts ← 1``, ``sums ← k``. A step without keys (``B·T = 0``)
    leaves the state as it was. Autocast is off: CUDA's would normalize the rows of a bf16 codebook in
    fp32, the same update with autocast on or off giving other bits.

    ``reduce`` (data parallelism): sums a tensor over the ranks. The counts and key sums are then the
    global batch's, every rank takes the same step, and a revived code takes the mean of the keys the
    ranks drew (one rank's key alone; ranks without keys draw none)."""
    with torch.no_grad(), no_autocast(kn):
        B, H, T, D = kn.shape
        N = codebook.shape[1]
        flat_k = kn.detach().float().permute(1, 0, 2, 3).reshape(H, B * T, D)
        n = code_histogram(codes, N)  # [H, N]
        flat_codes = codes.permute(1, 0, 2).reshape(H, B * T)
        s = torch.zeros(H, N, D, device=kn.device).scatter_add(1, flat_codes[..., None].expand(H, B * T, D), flat_k)
        if B * T:  # (the flag a constant in each branch: a compiled step keeps T symbolic)
            pick = torch.randint(0, B * T, (H, N), device=kn.device)
            sample, drew = flat_k.gather(1, pick[..., None].expand(H, N, D)), 1.0  # [H, N, D]
        else:
            sample, drew = flat_k.new_zeros(H, N, D), 0.0
        drew = torch.full((H, N, 1), drew, device=kn.device)  # whether a key was drawn
        if reduce is not None:
            n, s, sample, drew = reduce(torch.cat([n[..., None], s, sample, drew], -1)).split([1, D, D, 1], -1)
            n, sample = n[..., 0], sample / drew.clamp_min(1.0)
        seen = drew[..., 0] > 0  # [H, N]: keys this step (the same everywhere)
        keep = torch.full_like(ema_counts, decay).masked_fill_(~seen, 1.0)  # no keys: 1 (and n = 0, s = 0)
        ema_counts.mul_(keep).add_(n, alpha=1 - decay)
        ema_sums.mul_(keep[..., None]).add_(s, alpha=1 - decay)
        dead = (ema_counts < dead_threshold) & seen  # [H, N]
        ema_sums.copy_(torch.where(dead[..., None], sample, ema_sums))
        ema_counts.copy_(torch.where(dead, torch.ones_like(ema_counts), ema_counts))
        means = F.normalize(ema_sums / ema_counts[..., None].clamp_min(1e-12), dim=-1).to(codebook.dtype)
        codebook.copy_(torch.where(seen[..., None], means, codebook))
        return dead
