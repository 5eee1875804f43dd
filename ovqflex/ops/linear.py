"""Non-softmax recurrent attention ops (docs/design.md §4.6): linear attention, the delta rule, VLA.

All causal; ``[B, H, T, D]`` in, ``[B, H, T, Dv]`` out. They validate their inputs, cast q,
k, v and the per-token companions (``beta``, ``u``) to one compute dtype (the output's;
:mod:`recurrences.precision`) and call the chunked forms of ``recurrences/`` (linear.py,
delta.py, vla.py), which work in float32 (float64 for float64 inputs) whatever the autocast
state; the token-by-token references the tests compare them with are in ``recurrences/reference/``.

Each op continues from an ``initial_state`` (None: a sequence start) and returns the state
after its last token with ``output_final_state=True`` — what the layers' decode caches
(``ovqflex.cache.recurrent``) carry, so a continuation equals one pass over the whole sequence.
"""
from __future__ import annotations

from torch import Tensor

from recurrences.checks import check_companion, check_finite_args, check_int, check_number, check_qkv
from recurrences.compiling import plain_int, plain_options
from recurrences.delta import delta_rule_chunked
from recurrences.linear import LinearState, linear_attention_chunked
from recurrences.precision import to_compute_dtype
from recurrences.vla import VLAOptions, VLAState, vla_chunked


def _check_initial_state(state, kind: type, q: Tensor, v: Tensor) -> None:
    """A carried state: floating tensors of the state's shapes on q's device (any floating
    dtype: caches keep fp32 states for bf16 layers)."""
    if state is None:
        return
    if not isinstance(state, kind):
        raise TypeError(f"initial_state must be a {kind.__name__}, got {type(state).__name__}")
    B, H, _, Dk = q.shape
    check_companion("initial_state.S", state.S, (B, H, v.shape[-1], Dk), q)
    check_companion("initial_state.z", state.z, (B, H, Dk), q)
    if kind is VLAState:
        check_companion("initial_state.A", state.A, (B, H, Dk, Dk), q)
        check_int("initial_state.position", state.position, minimum=0)


def _state_tensors(state) -> dict:
    """A carried state's tensors by argument name (for the ``check_finite`` option)."""
    if state is None:
        return {}
    if isinstance(state, Tensor):
        return {"initial_state": state}
    return {f"initial_state.{f}": x for f, x in zip(state._fields, state) if isinstance(x, Tensor)}


def linear_attention(q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int = 64, eps: float = 1e-6,
                     initial_state: LinearState | None = None, output_final_state: bool = False,
                     check_finite: bool | None = None):
    """Causal linear attention with the ELU+1 feature map and normalised read-out.

    q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]`` -> ``[B, H, T, Dv]``::

        o_t = Σ_{s<=t} (φ(q_t)·φ(k_s)) v_s / max(Σ_{s<=t} φ(q_t)·φ(k_s), eps),   φ = elu + 1

    ``output_final_state=True`` also returns the :class:`recurrences.linear.LinearState` ``(S_T, z_T)``
    after the last token (``S_T = Σ_s v_s φ(k_s)^T`` ``[B, H, Dv, Dk]``, ``z_T = Σ_s φ(k_s)`` ``[B, H, Dk]``,
    fp32), which ``initial_state`` continues from. ``check_finite=True`` refuses nan/inf in q, k, v and
    the initial state (None: :func:`ovqflex.finite_checks`; eager only).
    """
    check_qkv(q, k, v)
    chunk_size = plain_int(check_int("chunk_size", chunk_size))  # an option: one graph per value
    check_number("eps", eps)
    _check_initial_state(initial_state, LinearState, q, v)
    check_finite_args(check_finite, q=q, k=k, v=v, **_state_tensors(initial_state))
    q, k, v = to_compute_dtype(q, k, v)
    return linear_attention_chunked(q, k, v, chunk_size=chunk_size, eps=eps, initial_state=initial_state,
                                    output_final_state=output_final_state)


def delta_rule(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, chunk_size: int = 64,
               initial_state: Tensor | None = None, output_final_state: bool = False,
               check_finite: bool | None = None):
    """The delta rule (DeltaNet) with a per-token write strength.

    q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]``, beta ``[B, H, T]`` -> ``[B, H, T, Dv]``::

        S_t = S_{t-1} + β_t (v_t - S_{t-1} k_t) k_t^T,   o_t = S_t q_t

    Keys are used as given: the recurrence is stable for ``β_t ||k_t||² ∈ [0, 2]``
    (:class:`ovqflex.DeltaNetAttention` uses unit keys and ``β = sigmoid(.)``).
    ``output_final_state=True`` also returns ``S_T`` ``[B, H, Dv, Dk]``
    (fp32), the whole state: ``initial_state`` ``S_0`` continues from it. ``check_finite`` as
    :func:`linear_attention`.
    """
    check_qkv(q, k, v)
    check_companion("beta", beta, q.shape[:3], q)
    chunk_size = plain_int(check_int("chunk_size", chunk_size))  # an option: one graph per value
    if initial_state is not None:
        check_companion("initial_state", initial_state, (*q.shape[:2], v.shape[-1], q.shape[-1]), q)
    check_finite_args(check_finite, q=q, k=k, v=v, beta=beta, **_state_tensors(initial_state))
    q, k, v, beta = to_compute_dtype(q, k, v, beta)
    return delta_rule_chunked(q, k, v, beta, chunk_size=chunk_size, initial_state=initial_state,
                              output_final_state=output_final_state)


def vla_attention(q: Tensor, k: Tensor, v: Tensor, u: Tensor, *, lambda0: float = 0.1, refresh_every: int = 20,
                  refresh_eps: float = 1e-3, eps: float = 1e-4, chunk_size: int | None = None,
                  initial_state: VLAState | None = None, output_final_state: bool = False,
                  check_finite: bool | None = None):
    """Variational Linear Attention (VLA paper, arXiv 2605.11196): a residual update written along the unit
    direction ``α̂_t = A_t k̂_t / ||A_t k̂_t||`` of a Sherman-Morrison penalty inverse ``A_t``.

    q, k, u ``[B, H, T, Dk]`` (``u``: penalty directions, the layer's ``f_θ(k)``), v
    ``[B, H, T, Dv]`` -> ``[B, H, T, Dv]``. k and u are unit-normalised inside::

        A_t = A_{t-1} - A_{t-1} û_t û_t^T A_{t-1} / (1 + û_t^T A_{t-1} û_t),   A_0 = I / lambda0
        S_t = S_{t-1} + (v_t - S_{t-1} k̂_t) α̂_t^T
        o_t = S_t φ(q_t) / max(φ(q_t)·Σ_{s<=t} φ(k_s), eps),   φ = elu + 1

    and ``A += refresh_eps I`` after every ``refresh_every``-th token (0: never). See
    :class:`recurrences.vla.VLAOptions` for ``chunk_size``. ``output_final_state=True`` also returns
    the :class:`recurrences.vla.VLAState` ``(S_T [B, H, Dv, Dk], A_T [B, H, Dk, Dk], z_T [B, H, Dk],
    position)`` (fp32) after the last token, which
    ``initial_state`` continues from — the refresh schedule follows the absolute position.
    ``check_finite`` as :func:`linear_attention` (u too).
    """
    check_qkv(q, k, v)
    check_companion("u", u, k.shape, q)
    opts = plain_options(VLAOptions(lambda0=lambda0, refresh_every=refresh_every, refresh_eps=refresh_eps, eps=eps,
                                    chunk_size=chunk_size))
    _check_initial_state(initial_state, VLAState, q, v)
    check_finite_args(check_finite, q=q, k=k, v=v, u=u, **_state_tensors(initial_state))
    q, k, v, u = to_compute_dtype(q, k, v, u)
    return vla_chunked(q, k, v, u, opts, initial_state=initial_state, output_final_state=output_final_state)
