"""Variational Linear Attention (VLA paper, arXiv 2605.11196), chunked: Woodbury for ``A``, WY for ``S``.

Token form (reference loop: ``recurrences/reference/vla.py``), state ``X = S^T`` ``[Dk, Dv]``::

    A_t = A_{t-1} - (A_{t-1} û_t)(A_{t-1} û_t)^T / (1 + û_t^T A_{t-1} û_t)     Sherman-Morrison
    α̂_t = A_t k̂_t / ||A_t k̂_t||,   X_t = X_{t-1} + α̂_t (v_t - X_{t-1}^T k̂_t)^T
    o_t = X_t^T φ(q_t) / max(φ(q_t)·Σ_{s<=t} φ(k_s), eps)

plus ``A += refresh_eps I`` after every ``refresh_every``-th token.

Chunked form. **A:** the Sherman-Morrison steps of a chunk starting from ``A_0`` are the
Cholesky factorisation of ``G = I + U A_0 U^T`` (``U`` the chunk's unit penalty rows): with
``G = L L^T`` and ``W = L⁻¹ U A_0``, ``A_t = A_0 - Σ_{s<=t} w_s w_s^T``, hence all write
directions of the chunk at once, ``A_t k̂_t = A_0 k̂_t - Σ_{s<=t} (k̂_t·w_s) w_s``, and
``A_C = A_0 - W^T W``. ``G`` has eigenvalues >= 1, so the factorisation is always defined
(``cholesky_ex``: no host sync). Chunks must end on refresh steps (``refresh_every`` a
multiple of the chunk). **S:** with ``α̂`` known, ``X`` is a delta rule that writes along
``α̂`` and erases along ``k̂`` with ``β = 1``: one batched triangular solve for all chunks
(:func:`recurrences.delta.chunk_wy`), then the chunks as the delta rule runs them
(:func:`recurrences.delta.delta_chunks`: a loop, or a blocked scan on a GPU and while compiling).
``A``'s chunk steps are not associative (each factorises a matrix of the ``A`` before it): they stay a
loop over the chunks, which a compiled graph unrolls.

**Precision.** ``A_0 - W^T W`` cancels what the chunk's penalty rows remove, so ``A`` and the write
directions are rounded relative to ``||A_0||``, not to the smaller result: against the float64 loop
the fp32 error of ``A_T`` and ``S_T`` grows with ``||I / lambda0|| / ||A_T||``. That ratio is large
only when many rows hit few key dims in one chunk (2 dims, 14 rows, ``lambda0 = 0.1``: about 70, an
error of 1.1e-5 where the fp32 loop's is 1e-8); with ``Dk >= 16`` and ``lambda0 >= 0.01`` the chunk
form's error of ``A_T`` stayed within 2x of the fp32 loop's on random inputs of 200 and 400 tokens
(tests/recurrences/recurrent_cases.py::vla_state_tol).

**Continuing** (a decode cache, docs/design.md §6) from a :class:`VLAState` at absolute position ``p``:
chunks stay on absolute boundaries, so the refreshes still fall on chunk ends — the new
tokens get ``p mod C`` zero rows in front (after the unit-normalisation and the feature
map). A zero row is an exact no-op: ``û = k̂ = 0`` gives ``w = 0`` and ``α̂ = 0``, so neither
``A`` nor ``S`` moves. The normaliser ``Σ φ(k)`` is a cumulative sum over the real tokens
only (``φ(0) = 1``: a padded raw key would count), continued from the state's ``z``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .checks import check_int, check_number
from .scan import cumsum
from .delta import chunk_wy, delta_chunks
from .linear import feature_map, from_chunks, to_chunks
from .precision import no_autocast, work_dtype


@dataclass(frozen=True)
class VLAOptions:
    """VLA hyper-parameters (VLA paper, arXiv 2605.11196, §5.4 and Table 3 defaults).

    ``lambda0``: initial regulariser (``A_0 = I / lambda0``); ``refresh_every``: tokens between
    identity refreshes (0: none); ``refresh_eps``: their size; ``eps``: floor of every norm
    and of the read-out denominator; ``chunk_size``: tokens per chunk of the fast form
    (``None``: ``refresh_every``, or 64 without refresh); ``refresh_every`` must be a multiple.
    """

    lambda0: float = 0.1
    refresh_every: int = 20
    refresh_eps: float = 1e-3
    eps: float = 1e-4
    chunk_size: int | None = None

    def __post_init__(self):
        check_number("lambda0", self.lambda0)
        check_int("refresh_every", self.refresh_every, minimum=0)
        check_number("refresh_eps", self.refresh_eps, strict=False)
        check_number("eps", self.eps)
        if self.chunk_size is not None:
            check_int("chunk_size", self.chunk_size)
            if self.refresh_every % self.chunk_size:
                raise ValueError(f"chunk_size must divide refresh_every={self.refresh_every} so refreshes fall on "
                                 f"chunk ends, got chunk_size={self.chunk_size}")

    @property
    def chunk(self) -> int:
        if self.chunk_size is not None:
            return self.chunk_size
        return self.refresh_every or 64


class VLAState(NamedTuple):
    """The VLA recurrence after ``position`` tokens: S ``[B, H, Dv, Dk]`` (paper orientation),
    the penalty inverse A ``[B, H, Dk, Dk]`` (refreshes up to ``position`` applied), the
    normaliser z ``[B, H, Dk]`` ``= Σ_s φ(k_s)``, and ``position`` (int: where the refresh
    schedule stands)."""

    S: Tensor
    A: Tensor
    z: Tensor
    position: int


def vla_write_directions(k_unit: Tensor, u_unit: Tensor, opts: VLAOptions, T: int, *, A0: Tensor | None = None,
                         base: int = 0) -> tuple[Tensor, Tensor]:
    """Unit write directions of every token and the final penalty inverse.

    k_unit, u_unit ``[B, H, n, C, Dk]`` (chunked, zero rows for padding) whose row 0 is the
    token at absolute position ``base`` (a multiple of C), ``T`` the absolute position after
    the last real token, ``A0`` ``[B, H, Dk, Dk]`` the penalty inverse at ``base`` (None:
    ``I / lambda0``, a sequence start) -> (α̂ ``[B, H, n, C, Dk]``, ``A_T`` ``[B, H, Dk, Dk]``).
    """
    B, H, _, C, Dk = k_unit.shape
    eye = torch.eye(Dk, dtype=k_unit.dtype, device=k_unit.device)
    eye_c = torch.eye(C, dtype=k_unit.dtype, device=k_unit.device)
    A = (eye / opts.lambda0).expand(B, H, Dk, Dk) if A0 is None else A0
    alphas = []
    # (unbind: a select of each chunk would add a gradient the size of all chunks, per chunk, in backward)
    for c, (uc, kc) in enumerate(zip(u_unit.unbind(2), k_unit.unbind(2))):
        ua = uc @ A                                                     # [B, H, C, Dk] (A symmetric)
        L = torch.linalg.cholesky_ex(eye_c + ua @ uc.transpose(-1, -2)).L
        w = torch.linalg.solve_triangular(L, ua, upper=False)           # rows w_s
        raw = kc @ A - torch.tril(kc @ w.transpose(-1, -2)) @ w        # rows A_t k̂_t
        alphas.append(F.normalize(raw, dim=-1, eps=opts.eps))
        A = A - w.transpose(-1, -2) @ w
        end = base + (c + 1) * C
        if opts.refresh_every and end <= T and end % opts.refresh_every == 0:
            A = A + opts.refresh_eps * eye
    return torch.stack(alphas, 2), A


def vla_chunked(q: Tensor, k: Tensor, v: Tensor, u: Tensor, opts: VLAOptions = VLAOptions(), *,
                initial_state: VLAState | None = None, output_final_state: bool = False,
                blocked: bool | None = None):
    """q, k, u ``[B, H, T, Dk]``, v ``[B, H, T, Dv]`` -> o ``[B, H, T, Dv]`` (q's dtype).

    ``initial_state``: the :class:`VLAState` before q, k, v (None: a sequence start at
    position 0). ``output_final_state=True`` returns ``(o, VLAState)`` after the last token
    (work dtype). ``blocked``: how the states of ``S`` before the chunks are found
    (:func:`recurrences.delta.delta_chunks`; default by device).
    """
    T, Dv, dt, C = q.shape[2], v.shape[-1], work_dtype(q), opts.chunk
    start = 0 if initial_state is None else initial_state.position
    lead = start % C                                                    # zero rows up to the chunk boundary
    with no_autocast(q):
        kh = to_chunks(F.normalize(k.to(dt), dim=-1, eps=opts.eps), C, lead)   # [B, H, n, C, Dk]
        uh = to_chunks(F.normalize(u.to(dt), dim=-1, eps=opts.eps), C, lead)
        fq = to_chunks(feature_map(q.to(dt)), C, lead)
        vc = to_chunks(v.to(dt), C, lead)
        A0 = None if initial_state is None else initial_state.A.to(dt)
        alpha, A = vla_write_directions(kh, uh, opts, start + T, A0=A0, base=start - lead)
        sol = chunk_wy(kh, alpha, torch.cat([vc, kh], dim=-1))
        e0, wk = sol.split([Dv, kh.shape[-1]], dim=-1)
        if initial_state is None:
            X0 = q.new_zeros(*q.shape[:2], k.shape[-1], Dv, dtype=dt)
        else:
            X0 = initial_state.S.to(dt).transpose(-1, -2)
        num, last = delta_chunks(fq, alpha, wk, e0, X0, blocked=blocked)   # writes along α̂, erases along k̂
        ksum = cumsum(feature_map(k.to(dt)), 2)                         # [B, H, T, Dk], real tokens only
        if initial_state is not None:
            ksum = ksum + initial_state.z.to(dt).unsqueeze(2)
        den = (feature_map(q.to(dt)) * ksum).sum(-1, keepdim=True)
        out = (from_chunks(num, T, lead) / torch.clamp(den, min=opts.eps)).to(q.dtype)
    if output_final_state:
        if T:
            z = ksum[:, :, -1]
        else:  # no tokens: the normaliser as it was
            z = k.new_zeros(*k.shape[:2], k.shape[-1], dtype=dt) if initial_state is None else initial_state.z.to(dt)
        return out, VLAState(last.transpose(-1, -2), A, z, start + T)
    return out
