"""The delta rule (DeltaNet), chunked with the WY / UT-transform form of Yang et al. (2024).

Token form (reference loop: ``recurrences/reference/delta.py``), state ``X`` ``[Dk, Dv]``
(the transpose of the paper's ``S``)::

    X_t = X_{t-1} + β_t k_t (v_t - X_{t-1}^T k_t)^T,   o_t = X_t^T q_t

Inside a chunk starting from ``X_0``, the writes ``w_i = β_i (v_i - X_{i-1}^T k_i)`` solve the
unit lower-triangular system ``(I + strictly_lower(diag(β) K K^T)) W = diag(β) (V - K X_0)``,
so with ``U = T⁻¹ diag(β) V`` and ``Wk = T⁻¹ diag(β) K`` (one batched triangular solve for
every chunk at once) a chunk is ``W = U - Wk X_0``, ``O = Q X_0 + tril(Q K^T) W``,
``X_1 = X_0 + K^T W`` (:func:`delta_chunks`): a loop over the chunks, 4 matmuls each, or, on a
GPU and while compiling, the states before the chunks by a blocked scan of the affine map
``X_1 = (I - K^T Wk) X_0 + K^T U`` (:func:`affine_chunk_states`): a fixed number of steps per level
and a handful of levels for any length. The outputs then need no loop. Stable for
``β_t ||k_t||² ∈ [0, 2]`` (the layer uses unit keys and ``β ∈ (0, 1)``): every ``I - K^T Wk`` is
then a product of the tokens' ``I - β_t k_t k_t^T``, of norm at most 1. A decode cache continues
from its ``S`` as ``X_0`` of the first chunk (``initial_state``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .compiling import is_symbolic, narrow_rows, pad_to
from .linear import from_chunks, to_chunks
from .precision import no_autocast, work_dtype

#: chunks per block of :func:`affine_chunk_states`: each level of its scan is this many steps
SCAN_CHUNKS = 16


def chunk_wy(read: Tensor, write: Tensor, rhs: Tensor) -> Tensor:
    """Solve ``(I + strictly_lower(read write^T)) X = rhs`` per chunk.

    read, write ``[..., C, Dk]``, rhs ``[..., C, R]`` -> ``[..., C, R]``: the writes of a
    delta-rule chunk whose token ``i`` erases along ``read_i`` what tokens ``j < i`` wrote
    along ``write_j``.
    """
    C = read.shape[-2]
    tri = torch.tril(read @ write.transpose(-1, -2), diagonal=-1) + torch.eye(C, dtype=read.dtype, device=read.device)
    return torch.linalg.solve_triangular(tri, rhs, upper=False, unitriangular=True)


def delta_chunks(query: Tensor, write: Tensor, read: Tensor, target: Tensor, X0: Tensor, *,
                 blocked: bool | None = None) -> tuple[Tensor, Tensor]:
    """The delta rule chunk by chunk, from its WY form: chunk ``c`` starts from ``X_c``, writes
    ``W_c = U_c - R_c X_c`` (its rows, one per token) along ``L_c``, and reads ``O_c = Q_c X_c +
    tril(Q_c L_c^T) W_c``; ``X_{c+1} = X_c + L_c^T W_c``.

    query ``Q`` ``[..., n, C, Dk]``, write ``L`` ``[..., n, C, Dk]``, read ``R`` ``[..., n, C, Dk]``,
    target ``U`` ``[..., n, C, Dv]``, X0 ``[..., Dk, Dv]`` -> (O ``[..., n, C, Dv]``, ``X_n``
    ``[..., Dk, Dv]``).

    ``blocked``: the states before the chunks by the blocked scan of :func:`affine_chunk_states` on
    ``E = L^T R``, ``F = L^T U``, whose graph does not grow with the chunk count and whose launches are a
    few per level rather than a few per chunk; then the outputs in one batch. Otherwise a loop over the
    chunks, 4 matmuls of ``C`` rows each, half the scan's work (``E`` and the scan's products are
    ``Dk x Dk`` matmuls per chunk). Default: blocked for a symbolic chunk count, and for more than
    :data:`SCAN_CHUNKS` chunks on a GPU or while compiling; on a CPU, where launches are cheap, the loop
    (``profiles/linear.toml``, ``recurrent-long-T``).
    """
    n = write.shape[-3]
    if blocked is None:
        blocked = is_symbolic(n) or (n > SCAN_CHUNKS and (X0.device.type != "cpu" or torch.compiler.is_compiling()))
    scores = torch.tril(query @ write.transpose(-1, -2))                   # [..., n, C, C]
    if blocked:
        L = write.transpose(-1, -2)
        X, last = affine_chunk_states(L @ read, L @ target, X0)           # [..., n, Dk, Dv]: before each chunk
        return query @ X + scores @ (target - read @ X), last
    outs, X = [], X0
    # (unbind: a select of each chunk would add a gradient the size of all chunks, per chunk, in backward)
    for Q, L, R, U, M in zip(*(x.unbind(-3) for x in (query, write, read, target, scores))):
        W = U - R @ X
        outs.append(Q @ X + M @ W)
        X = X + L.transpose(-1, -2) @ W
    return torch.stack(outs, -3), X


def affine_chunk_states(erase: Tensor, write: Tensor, X0: Tensor) -> tuple[Tensor, Tensor]:
    """The states of ``X_{c+1} = X_c - E_c X_c + F_c`` before every chunk, and after the last.

    erase ``E`` ``[..., n, Dk, Dk]``, write ``F`` ``[..., n, Dk, Dv]``, X0 ``[..., Dk, Dv]`` ->
    (starts ``[..., n, Dk, Dv]``, ``X_n`` ``[..., Dk, Dv]``).

    Up to :data:`SCAN_CHUNKS` chunks: one step per chunk. More: a blocked scan. The chunks are cut into
    blocks of ``SCAN_CHUNKS`` (the last padded with no-op chunks, ``E = F = 0``), and one loop of
    ``SCAN_CHUNKS`` steps, batched over the blocks, runs each block from a zero state (``Y``) while it
    multiplies the block's transitions (``P = Π (I - E)``), so that the state before chunk ``j`` of a
    block that starts at ``X_b`` is ``P_j X_b + Y_j``. The block starts are the same recurrence over
    the blocks (``E = I - P``, ``F = Y`` of whole blocks), solved the same way. A compiled graph is
    ``SCAN_CHUNKS`` steps per level, ``ceil(log_16 n)`` levels, whatever the chunk count (a symbolic
    count always pads, so it recompiles only when the number of levels changes: at 17 and 257 chunks).
    The float order differs from a loop over the chunks by the products.
    """
    n = erase.shape[-3]
    if not is_symbolic(n) and n <= SCAN_CHUNKS:
        return _affine_loop(erase, write, X0)
    blocks = -(-n // SCAN_CHUNKS)
    E, F = (pad_to(x, -3, blocks * SCAN_CHUNKS).unflatten(-3, (blocks, SCAN_CHUNKS)) for x in (erase, write))
    if blocks == 1:                                      # (a symbolic count of at most SCAN_CHUNKS chunks)
        starts, last = _affine_loop(E.squeeze(-4), F.squeeze(-4), X0)
        return narrow_rows(starts, -3, 0, n), last
    eye = torch.eye(E.shape[-1], dtype=E.dtype, device=E.device)
    Y = F.new_zeros(F[..., 0, :, :].shape)               # [..., blocks, Dk, Dv]: each block's run from zero
    P = eye.expand(E[..., 0, :, :].shape)                # [..., blocks, Dk, Dk]: its transitions so far
    runs, products = [], []
    for Ej, Fj in zip(E.unbind(-3), F.unbind(-3)):
        runs.append(Y)
        products.append(P)
        Y = Y - Ej @ Y + Fj
        P = P - Ej @ P
    block_starts, last = affine_chunk_states(eye - P, Y, X0)
    starts = torch.stack(products, -3) @ block_starts.unsqueeze(-3) + torch.stack(runs, -3)
    return narrow_rows(starts.flatten(-4, -3), -3, 0, n), last


def _affine_loop(erase: Tensor, write: Tensor, X: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`affine_chunk_states` one chunk after another (a plain chunk count)."""
    starts = []
    for E, F in zip(erase.unbind(-3), write.unbind(-3)):
        starts.append(X)
        X = X - E @ X + F
    return torch.stack(starts, -3), X


def delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, chunk_size: int = 64,
                       initial_state: Tensor | None = None, output_final_state: bool = False,
                       blocked: bool | None = None):
    """q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]``, beta ``[B, H, T]`` -> o ``[B, H, T, Dv]``
    (q's dtype); with ``output_final_state`` also ``S_T`` ``[B, H, Dv, Dk]``
    (paper orientation; work dtype). ``initial_state``: ``S_0`` ``[B, H, Dv, Dk]`` before q, k, v
    (None: zeros, a sequence start). ``blocked``: how the chunk states are found
    (:func:`delta_chunks`; default by device)."""
    T, Dv, dt = q.shape[2], v.shape[-1], work_dtype(q)
    with no_autocast(q):
        qc, kc, vc = (to_chunks(x.to(dt), chunk_size) for x in (q, k, v))   # [B, H, n, C, *]
        bc = to_chunks(beta.to(dt), chunk_size).unsqueeze(-1)               # [B, H, n, C, 1]; padding: β = 0
        sol = chunk_wy(bc * kc, kc, torch.cat([bc * vc, bc * kc], dim=-1))
        u, wk = sol.split([Dv, kc.shape[-1]], dim=-1)
        if initial_state is None:
            X0 = q.new_zeros(*q.shape[:2], k.shape[-1], Dv, dtype=dt)
        else:
            X0 = initial_state.to(dt).transpose(-1, -2)
        out, last = delta_chunks(qc, kc, wk, u, X0, blocked=blocked)
        out = from_chunks(out, T).to(q.dtype)
    return (out, last.transpose(-1, -2)) if output_final_state else out
