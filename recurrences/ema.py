"""Multi-head damped EMA (MEGA, Ma et al. 2022), the SSM of the LongVQ block (docs/design.md §4.5).

Every channel ``d`` of ``x [B, T, D]`` runs ``n`` damped EMAs ("heads") and mixes them:

    h_t = p ⊙ β ⊙ x_t + (1 − p ⊙ α) ⊙ h_{t−1},     y_t = Σ_n γ_n h_{t,n} + ω ⊙ x_t

with ``p = sigmoid(delta_logit)``, ``α = sigmoid(alpha_logit)`` (all ``[D, n]``, ω ``[D]``).
Unrolled, ``y = K * x + ω x`` is a causal convolution with the kernel
``K[d, t] = Σ_n γ p β (1 − p α)^t``, computed by :func:`damped_ema` in a chunked form
(no Python loop, differentiable). Not with an FFT: its round-off lets later inputs move
earlier outputs (~1e-9 relative in fp32), which breaks exact causality.
:func:`damped_ema_reference` is the token-by-token recurrence, the test oracle.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .compiling import is_symbolic, pad_to, size_max, size_min
from .precision import no_autocast, work_dtype


def log_decay(delta_logit: Tensor, alpha_logit: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``p = sigmoid(delta_logit)`` and ``log(1 - p sigmoid(alpha_logit))``, the log decay per step (``[D, n]``
    each, in ``dtype``). Both sigmoids round to 1 for logits above about 17 (fp32), and the decay is then exactly
    0: its log is floored at the dtype's smallest normal number (a decay of 1e-38 in fp32), so no ``0 * log(0)``
    of a zero power makes the chunked form NaN where the recurrence forgets its past, and the gradient through
    the floor is 0 (the sigmoids' own is 0 there too)."""
    p = torch.sigmoid(delta_logit.to(dtype))
    decay = 1 - p * torch.sigmoid(alpha_logit.to(dtype))  # [D, n] in [0, 1)
    return p, torch.log(torch.clamp(decay, min=torch.finfo(dtype).tiny))


def ema_kernel(delta_logit: Tensor, alpha_logit: Tensor, beta: Tensor, gamma: Tensor, length: int,
               dtype: torch.dtype = torch.float32) -> Tensor:
    """``K [D, length]`` of the damped EMA (parameters ``[D, n]``), in ``dtype`` (fp32 or fp64)."""
    p, loga = log_decay(delta_logit, alpha_logit, dtype)
    t = torch.arange(length, device=p.device, dtype=dtype)
    vander = torch.exp(loga[..., None] * t)  # [D, n, T]
    return torch.einsum("dn,dnt->dt", (p * beta.to(dtype) * gamma.to(dtype)), vander)


def ema_chunk(T: int) -> int:
    """Default chunk of :func:`damped_ema` for ``T`` tokens: ``sqrt(T)`` rounded up to a multiple
    of 16, at least 64 — the ``[chunk, chunk]`` Toeplitz blocks and the ``[T/chunk, T/chunk]``
    carry matrix then both hold ``O(T)`` entries per channel (a fixed chunk of 64 would make the
    carry matrix quadratic in ``T``: 1 GB at T = 16k, hidden 256, 16 EMA heads) — or ``T`` when
    shorter: one chunk without padding (a one-token decode step would otherwise build a 64 x 64
    Toeplitz block per channel for one row of it).

    A symbolic ``T`` (a compiled graph with dynamic shapes, where ``math.isqrt`` cannot be traced) gets
    the smallest power of two ``>= 64`` whose square holds ``T``, found by comparisons: the graph then
    serves every length up to that square (still ``O(T)`` entries: the chunk is below ``2 sqrt(T)``)."""
    if is_symbolic(T):
        chunk = 64
        while chunk * chunk < T:
            chunk *= 2
        return size_min(T, chunk)
    root = math.isqrt(T - 1) + 1 if T > 1 else 1  # ceil(sqrt(T))
    return min(T, max(64, -(-root // 16) * 16)) if T > 0 else 64


def damped_ema(x: Tensor, delta_logit: Tensor, alpha_logit: Tensor, beta: Tensor, gamma: Tensor,
               omega: Tensor, *, chunk_size: int | None = None, h0: Tensor | None = None,
               output_final_state: bool = False):
    """x ``[B, T, D]`` -> ``y [B, T, D]`` (dtype of x), exactly causal, fp32 inside (fp64 for fp64 x).

    ``h0`` ``[B, D, n]``: the EMA state before ``x`` (None: zeros, a sequence start) — how a
    decode cache continues; ``output_final_state=True`` also returns the state after ``x``
    ``[B, D, n]`` in the inner dtype.

    Chunked form: inside each chunk of ``chunk_size`` tokens a ``[chunk_size, chunk_size]``
    lower-triangular Toeplitz matrix of the kernel; across chunks, the EMA states at chunk
    ends carried by lower-triangular matrices of decay powers, in blocks of about ``sqrt(n_chunks)``
    chunks (:func:`_decayed_prefix_sums`). Masked entries are exact zeros (built with ``where`` before
    ``exp``), so an output has an exactly zero gradient with respect to later inputs. Work
    ``O(T·L·D + (T/L)^1.5·D·n)`` (``L`` the chunk), memory ``O(D·L² + D·n·T/L)``; ``chunk_size=None`` takes
    :func:`ema_chunk` (about ``sqrt(T)``), which keeps the memory linear in ``T``. Autocast is switched off
    inside: it would run the einsums in bf16 (3.7e-3 relative error against the fp64 recurrence where fp32
    gives 1.1e-7).
    """
    with no_autocast(x):
        return _damped_ema(x, delta_logit, alpha_logit, beta, gamma, omega, chunk_size, h0, output_final_state)


def _damped_ema(x, delta_logit, alpha_logit, beta, gamma, omega, chunk_size, h0, output_final_state):
    """:func:`damped_ema`'s work, autocast off."""
    B, T, D = x.shape
    dt = work_dtype(x)
    L = ema_chunk(T) if chunk_size is None else chunk_size
    nc = size_max(1, -(-T // L))
    xf = F.pad(x.to(dt), (0, 0, 0, nc * L - T)).view(B, nc, L, D)
    p, loga = log_decay(delta_logit, alpha_logit, dt)  # [D, n], <= 0
    b, g = p * beta.to(dt), gamma.to(dt)
    i = torch.arange(L, device=x.device)
    lag = i[:, None] - i[None, :]  # [L, L]
    kernel = ema_kernel(delta_logit, alpha_logit, beta, gamma, L, dt)  # [D, L]
    toeplitz = torch.where(lag >= 0, kernel[:, lag.clamp_min(0)], 0.0)  # [D, L(t), L(s)]
    y = torch.einsum("dts,bcsd->bctd", toeplitz, xf)
    # state contribution of each chunk at its last token, then carried across chunks
    to_end = torch.exp((L - 1 - i).to(dt)[None, None, :] * loga[..., None]) * b[..., None]  # [D, n, L]
    ends = torch.einsum("dns,bcsd->bcdn", to_end, xf)
    states = _decayed_prefix_sums(ends, L * loga, L)  # EMA state at the end of chunk c
    before = torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], dim=1)  # state entering chunk c
    from_state = torch.exp((i + 1).to(dt)[None, None, :] * loga[..., None]) * g[..., None]  # [D, n, L]
    y = y + torch.einsum("dnt,bcdn->bctd", from_state, before)
    y = y.reshape(B, nc * L, D)[:, :T]
    t = torch.arange(T, device=x.device, dtype=dt)
    if h0 is not None:  # the carried state decays into every output: sum_n g (decay^(t+1)) h0
        y = y + torch.einsum("dnt,bdn->btd", torch.exp((t + 1)[None, None, :] * loga[..., None]) * g[..., None],
                             h0.to(dt))
    # contiguous: the einsums leave y channel-major ([D, B, T] in memory), and a bf16 matmul reading
    # that layout (LongVQ's z_proj, eagerly) rounds 15% of its outputs otherwise than a contiguous one
    y = (y + x.to(dt) * omega.to(dt)).to(x.dtype).contiguous()
    if not output_final_state:
        return y
    to_last = torch.exp((T - 1 - t)[None, None, :] * loga[..., None]) * b[..., None]  # [D, n, T]
    state = torch.einsum("dnt,btd->bdn", to_last, x.to(dt))
    if h0 is not None:
        state = state + torch.exp(T * loga)[None] * h0.to(dt)
    return y, state


def _decay_matrix(m: int, loga: Tensor) -> Tensor:
    """``M [D, n, m, m]``: ``exp(loga (i - j))`` for ``i >= j``, exact zeros above the diagonal (``where``
    before ``exp``); loga ``[D, n]``, the log decay per step."""
    i = torch.arange(m, device=loga.device)
    lag = (i[:, None] - i[None, :]).to(loga.dtype)
    return torch.exp(torch.where(lag >= 0, lag.clamp_min(0) * loga[..., None, None], float("-inf")))


def _decayed_prefix_sums(x: Tensor, loga: Tensor, chunk: int) -> Tensor:
    """``s_c = sum_{e <= c} exp(loga (c - e)) x_e``: x ``[B, C, D, n]``, loga ``[D, n]`` (< 0) -> ``[B, C, D, n]``
    (the EMA states at the ends of :func:`damped_ema`'s chunks, ``chunk`` tokens each).

    Two levels, as the EMA's chunks themselves: blocks of ``G`` steps (about ``sqrt(C)``), a ``[G, G]`` decay
    matrix inside each block and a ``[C/G, C/G]`` one across the blocks' ends, ``D n (G^2 + (C/G)^2)``
    entries in all, where one ``[C, C]`` matrix held ``D n C^2``: at 64k tokens, hidden 512 and 16 EMA heads
    that matrix was 2 GB, built even without gradients and kept for the backward with them. Masked entries
    are exact zeros, so a state reads no later step."""
    B, C, D, n = x.shape
    G = _prefix_block(C, chunk)
    nb = size_max(1, -(-C // G))
    xb = pad_to(x, 1, nb * G).view(B, nb, G, D, n)
    local = torch.einsum("dnij,bkjdn->bkidn", _decay_matrix(G, loga), xb)  # within each block
    block_ends = torch.einsum("dnkm,bmdn->bkdn", _decay_matrix(nb, G * loga), local[:, :, -1])
    entering = torch.cat([torch.zeros_like(block_ends[:, :1]), block_ends[:, :-1]], dim=1)  # [B, nb, D, n]
    into = torch.exp(torch.arange(1, G + 1, device=x.device, dtype=loga.dtype)[:, None, None] * loga)  # [G, D, n]
    return (local + into * entering[:, :, None]).reshape(B, nb * G, D, n)[:, :C]


def _prefix_block(C: int, chunk: int) -> int:
    """:func:`_decayed_prefix_sums`' block: ``ceil(sqrt(C))``. For a symbolic ``C`` (a compiled graph with
    dynamic shapes) a plain int that adds no guard: ``ceil(sqrt(chunk))``, as the default chunk
    (:func:`ema_chunk`) is a plain power of two whose square holds ``T``, so ``C <= chunk`` (or 8 where the chunk
    is the symbolic length itself: one chunk)."""
    bound = C if not is_symbolic(C) else chunk if not is_symbolic(chunk) else 64
    return math.isqrt(bound - 1) + 1 if bound > 1 else 1


def damped_ema_reference(x: Tensor, delta_logit: Tensor, alpha_logit: Tensor, beta: Tensor, gamma: Tensor,
                         omega: Tensor) -> Tensor:
    """The recurrence, one token at a time (fp32 state, fp64 for fp64 x)."""
    B, T, D = x.shape
    dt = work_dtype(x)
    delta_logit, alpha_logit, beta, gamma, omega = (t.to(dt) for t in (delta_logit, alpha_logit, beta, gamma, omega))
    p = torch.sigmoid(delta_logit)
    decay = 1 - p * torch.sigmoid(alpha_logit)
    h = x.new_zeros(B, D, delta_logit.shape[1], dtype=dt)
    ys = []
    for t in range(T):
        h = p * beta * x[:, t, :, None].to(dt) + decay * h
        ys.append((h * gamma).sum(-1) + omega * x[:, t].to(dt))
    return torch.stack(ys, dim=1).to(x.dtype)
