"""The delta rule (DeltaNet), chunked with the WY / UT-transform form of Yang et al. (2024).

Token form (reference loop: ``recurrences/reference/delta.py``), state ``X`` ``[Dk, Dv]``
(the transpose of the paper's ``S``)::

    X_t = X_{t-1} + β_t k_t (v_t - X_{t-1}^T k_t)^T,   o_t = X_t^T q_t

Inside a chunk starting from ``X_0``, the writes ``w_i = β_i (v_i - X_{i-1}^T k_i)`` solve the
unit lower-triangular system ``(I + strictly_lower(diag(β) K K^T)) W = diag(β) (V - K X_0)``,
so with ``U = T⁻¹ diag(β) V`` and ``Wk = T⁻¹ diag(β) K`` (one batched triangular solve for
every chunk at once) a chunk is ``W = U - Wk X_0``, ``O = Q X_0 + tril(Q K^T) W``,
``X_1 = X_0 + K^T W`` — a Python loop over chunks only, 4 matmuls each. Stable for
``β_t ||k_t||² ∈ [0, 2]`` (the layer uses unit keys and ``β ∈ (0, 1)``). A decode cache
continues from its ``S`` as ``X_0`` of the first chunk (``initial_state``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .linear import from_chunks, to_chunks, work_dtype


def chunk_wy(read: Tensor, write: Tensor, rhs: Tensor) -> Tensor:
    """Solve ``(I + strictly_lower(read write^T)) X = rhs`` per chunk.

    read, write ``[..., C, Dk]``, rhs ``[..., C, R]`` -> ``[..., C, R]``: the writes of a
    delta-rule chunk whose token ``i`` erases along ``read_i`` what tokens ``j < i`` wrote
    along ``write_j``.
    """
    C = read.shape[-2]
    tri = torch.tril(read @ write.transpose(-1, -2), diagonal=-1) + torch.eye(C, dtype=read.dtype, device=read.device)
    return torch.linalg.solve_triangular(tri, rhs, upper=False, unitriangular=True)


def delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, chunk_size: int = 64,
                       initial_state: Tensor | None = None, output_final_state: bool = False):
    """q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]``, beta ``[B, H, T]`` -> o ``[B, H, T, Dv]``
    (q's dtype); with ``output_final_state`` also ``S_T`` ``[B, H, Dv, Dk]``
    (paper orientation; work dtype). ``initial_state``: ``S_0`` ``[B, H, Dv, Dk]`` before q, k, v
    (None: zeros, a sequence start)."""
    T, Dv, dt = q.shape[2], v.shape[-1], work_dtype(q)
    with torch.autocast(q.device.type, enabled=False):
        qc, kc, vc = (to_chunks(x.to(dt), chunk_size) for x in (q, k, v))   # [B, H, n, C, *]
        bc = to_chunks(beta.to(dt), chunk_size).unsqueeze(-1)               # [B, H, n, C, 1]; padding: β = 0
        sol = chunk_wy(bc * kc, kc, torch.cat([bc * vc, bc * kc], dim=-1))
        u, wk = sol.split([Dv, kc.shape[-1]], dim=-1)
        qk = torch.tril(qc @ kc.transpose(-1, -2))                          # [B, H, n, C, C]
        if initial_state is None:
            X = q.new_zeros(*q.shape[:2], k.shape[-1], Dv, dtype=dt)
        else:
            X = initial_state.to(dt).transpose(-1, -2)
        outs = []
        for c in range(qc.shape[2]):
            w = u[:, :, c] - wk[:, :, c] @ X
            outs.append(qc[:, :, c] @ X + qk[:, :, c] @ w)
            X = X + kc[:, :, c].transpose(-1, -2) @ w
        out = from_chunks(torch.stack(outs, 2), T).to(q.dtype)
    return (out, X.transpose(-1, -2)) if output_final_state else out
