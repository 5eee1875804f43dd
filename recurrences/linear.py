"""Causal linear attention (ELU+1 feature map, normalised read-out), chunk-parallel.

Token form (VLA paper, arXiv 2605.11196, eq. 3; the reference loop is ``recurrences/reference/linear.py``)::

    S_t = S_{t-1} + φ(k_t) v_t^T,   z_t = z_{t-1} + φ(k_t),   o_t = φ(q_t)^T S_t / max(φ(q_t)·z_t, eps)

Chunked form, with no Python loop: split ``T`` into chunks of ``C`` (zero-padded at the
end — a zero feature row adds nothing, and padding only follows the real tokens); the
state each chunk starts from is an exclusive cumulative sum over chunks of ``φ(K_c)^T V_c``,
and inside a chunk ``tril(φ(Q_c) φ(K_c)^T)`` is the causal part. Memory
``O(T/C · Dk · Dv)`` per head. An initial state ``(S_0, z_0)`` (a decode cache's, docs/design.md §6)
is added to every chunk's starting state, so a continuation equals one pass over the
concatenated sequence. Also the helpers the other recurrences share.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .compiling import narrow_rows, pad_to
from .precision import no_autocast, one_plus_elu, work_dtype
from .scan import cumsum


def feature_map(x: Tensor) -> Tensor:
    """``φ(x) = elu(x) + 1`` (positive), the linear-attention feature map, without its cancellation
    (:func:`~recurrences.precision.one_plus_elu`)."""
    return one_plus_elu(x)


def to_chunks(x: Tensor, chunk_size: int, lead: int = 0) -> Tensor:
    """``[B, H, T, *rest]`` -> ``[B, H, n, chunk_size, *rest]``: ``lead`` zero rows in front (so a
    continuation's chunks fall on absolute chunk boundaries), zero-padded at the end to ``n * chunk_size``. At
    least one chunk: an empty sequence is one chunk of padding, which the recurrences read as no tokens."""
    T = x.shape[2]
    n = max(1, -(-(lead + T) // chunk_size))
    if lead:
        x = torch.cat([x.new_zeros(*x.shape[:2], lead, *x.shape[3:]), x], dim=2)
    x = pad_to(x, 2, n * chunk_size)
    return x.view(*x.shape[:2], n, chunk_size, *x.shape[3:])


def from_chunks(x: Tensor, T: int, lead: int = 0) -> Tensor:
    """``[B, H, n, chunk, D]`` -> ``[B, H, T, D]`` (drops ``lead`` front rows and the end padding)."""
    return narrow_rows(x.flatten(2, 3), 2, lead, T)


def _exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    total = cumsum(x, dim)
    return torch.cat([torch.zeros_like(total.narrow(dim, 0, 1)), total.narrow(dim, 0, x.shape[dim] - 1)], dim)


class LinearState(NamedTuple):
    """The linear-attention recurrence after ``t`` tokens: S ``[B, H, Dv, Dk]`` ``= Σ_s v_s φ(k_s)^T``
    (paper orientation, ``S k -> v``) and z ``[B, H, Dk]`` ``= Σ_s φ(k_s)`` (the read-out's normaliser)."""

    S: Tensor
    z: Tensor


def linear_attention_chunked(q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int = 64, eps: float = 1e-6,
                             initial_state: LinearState | None = None, output_final_state: bool = False):
    """q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]`` -> o ``[B, H, T, Dv]`` (q's dtype).

    ``initial_state``: the :class:`LinearState` before q, k, v (None: zeros, a sequence start).
    ``output_final_state=True`` returns ``(o, LinearState)`` after the last token (work dtype).
    """
    T, dt = q.shape[2], work_dtype(q)
    with no_autocast(q):
        fq = to_chunks(feature_map(q.to(dt)), chunk_size)            # [B, H, n, C, Dk]; padding rows 0
        fk = to_chunks(feature_map(k.to(dt)), chunk_size)
        vc = to_chunks(v.to(dt), chunk_size)                         # [B, H, n, C, Dv]
        kv = fk.transpose(-1, -2) @ vc                               # [B, H, n, Dk, Dv]
        state = _exclusive_cumsum(kv, 2)                             # state each chunk starts from
        zsum = _exclusive_cumsum(fk.sum(-2), 2)                      # [B, H, n, Dk]
        if initial_state is not None:
            state = state + initial_state.S.to(dt).transpose(-1, -2).unsqueeze(2)
            zsum = zsum + initial_state.z.to(dt).unsqueeze(2)
        scores = torch.tril(fq @ fk.transpose(-1, -2))               # [B, H, n, C, C], causal incl. diagonal
        num = fq @ state + scores @ vc
        den = (fq * zsum.unsqueeze(-2)).sum(-1) + scores.sum(-1)     # [B, H, n, C]
        out = from_chunks(num / torch.clamp(den, min=eps).unsqueeze(-1), T).to(q.dtype)
    if not output_final_state:
        return out
    return out, LinearState((state[:, :, -1] + kv[:, :, -1]).transpose(-1, -2), zsum[:, :, -1] + fk[:, :, -1].sum(-2))
