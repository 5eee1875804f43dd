"""``vq_attention``: VQ-attention (Transformer-VQ; the OVQ paper's sw-vq) as one attention
program (docs/design.md §4.4).

q, k, codebook ─normalize─▶ codes (nearest code, no grad, fp32) ─▶ quantized keys k̂
(straight-through or DiVeQ) ─▶ snapshots (differentiable segment means, lag 2) ─▶ program
[per-chunk codebook bank (log-count bias) ; chunks c−1, c causal with k̂] ─▶ backend.

Gradients. q, v, beta and ``local_bias`` get exactly the quadratic form's gradients. Keys:
tokens of the window (chunks c−1, c) get their exact straight-through gradient; a token
that a query reads through the state (a codebook row) gets the *mean* key gradient of the
tokens sharing its code and snapshot: the per-code sums of the key gradients equal the
quadratic form's, but the split among tokens of a code does not (the value each token
carries is averaged away in the state). With ``estimator="diveq"`` the codebook is
trained by gradient through the same path.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from masks.program import DEFAULT_BLOCK, AttentionProgram, scaled_unit_queries, unit_rows
from masks.regions import BlockWindow
from recurrences.checks import check_choice, check_chunk, check_finite_args, check_qkv, check_tensor, options_of
from recurrences.compiling import size_max
from recurrences.precision import to_compute_dtype
from recurrences.versioned import check_state_layout
from recurrences.vq import (ESTIMATORS, LAG, assign_codes, build_vq_snapshots, build_vq_versioned, codebook_metrics,
                            commitment_loss, quantize, vq_state_sizes)

from ..attention import attend
from ..profiling import stage
from .state_program import build_state_program


@dataclass(frozen=True)
class VQOptions:
    """VQ-attention's options, validated once; shared by :func:`vq_program`, :func:`vq_attention`,
    :class:`~ovqflex.VQAttention` and :class:`~ovqflex.LongVQBlock`.

    ``chunk_size`` ``C`` (a multiple of 16); ``estimator``: ``"ste"`` (straight-through; the
    codebook gets no gradient) or ``"diveq"``; ``state_layout`` (docs/design.md §5): ``"snapshot"``
    (one codebook state per chunk, ``n_chunks * N`` rows), ``"versioned"`` (checkpoints every
    ``checkpoint_every`` chunks plus one version row per token: memory-linear) or ``"auto"`` (the one
    whose backward keeps less, or without gradients the faster forward: ``recurrences.versioned.
    choose_state_layout``), same outputs and gradients; ``block_size``, the attention block (a power of two >= 16).
    """

    chunk_size: int = 128
    estimator: str = "ste"
    state_layout: str = "auto"
    checkpoint_every: int | None = None
    block_size: int = DEFAULT_BLOCK

    def __post_init__(self):
        check_chunk("chunk_size", self.chunk_size)
        check_choice("estimator", self.estimator, ESTIMATORS)
        check_state_layout(self.state_layout, self.checkpoint_every, self.block_size)


def _check_vq_args(q, k, v, codebook, beta, local_bias, code_bias, check_finite):
    check_qkv(q, k, v)
    H, D = q.shape[1], q.shape[-1]
    check_tensor("codebook", codebook, 3)
    if codebook.shape[0] != H or codebook.shape[2] != D or codebook.shape[1] < 1:
        raise ValueError(f"codebook must have shape [H, N, D]=[{H}, N>=1, {D}], got {tuple(codebook.shape)}")
    if not codebook.is_floating_point() or codebook.device != q.device:
        raise TypeError(f"codebook must be a floating tensor on {q.device}, got {codebook.dtype} on {codebook.device}")
    check_tensor("beta", beta, 1)
    if beta.shape[0] != H:
        raise ValueError(f"beta must have shape [H]=[{H}], got {tuple(beta.shape)}")
    if local_bias is not None:
        check_tensor("local_bias", local_bias, 1)
        if local_bias.shape[0] != H:
            raise ValueError(f"local_bias must have shape [H]=[{H}], got {tuple(local_bias.shape)}")
    if code_bias is not None:
        check_tensor("code_bias", code_bias, 2)
        if tuple(code_bias.shape) != tuple(codebook.shape[:2]):
            raise ValueError(f"code_bias must have shape [H, N]={tuple(codebook.shape[:2])}, "
                             f"got {tuple(code_bias.shape)}")
    check_finite_args(check_finite, q=q, k=k, v=v, codebook=codebook, beta=beta, local_bias=local_bias,
                      code_bias=code_bias)


def vq_program(q: Tensor, k: Tensor, v: Tensor, codebook: Tensor, beta: Tensor, *, local_bias: Tensor | None = None,
               code_bias: Tensor | None = None, options: VQOptions | None = None, check_finite: bool | None = None,
               **option_kwargs) -> tuple[AttentionProgram, dict]:
    """The VQ attention program, without running it -> ``(program, aux)``. Arguments as
    :func:`vq_attention`.

    ``aux``: ``codes [B, H, T]``, ``k_hat`` (quantized unit keys), ``k_unit`` (normalized keys), ``codebook_unit``
    (normalized codebook rows ``[H, N, D]``).
    q, k, v are cast to one compute dtype; codes are assigned on fp32 unit keys and codebook
    rows (:mod:`recurrences.precision`).
    """
    o = options_of(VQOptions, options, option_kwargs, "VQ options")
    _check_vq_args(q, k, v, codebook, beta, local_bias, code_bias, check_finite)
    chunk_size = o.chunk_size
    q, k, v = to_compute_dtype(q, k, v)
    T = q.shape[2]
    N = codebook.shape[1]
    with stage("proj"):
        kn = unit_rows(k)
        cb = unit_rows(codebook)
        q_scaled = scaled_unit_queries(q, beta)
    with stage("routing"):
        codes = assign_codes(k, codebook, code_bias)  # fp32 unit keys and codes (recurrences.precision)
    with stage("state_build"):
        k_hat = quantize(kn, cb, codes, o.estimator)
    n_chunks = size_max(1, -(-T // chunk_size))
    # + local_bias on window rows == - local_bias on state rows (softmax is shift invariant per query, and every
    # query sees the whole window region): exact, differentiable
    program = build_state_program(
        q_scaled, k_hat, v, BlockWindow(2, chunk_size), scale=1.0, sizes=vq_state_sizes(n_chunks, N, q.device), rows=N,
        lag=LAG, options=o, snapshots=lambda: build_vq_snapshots(k_hat, v, codes, chunk_size=chunk_size, n_codes=N),
        versioned=lambda plan: build_vq_versioned(k_hat, v, codes, plan), count_bias=True, bias_shift=local_bias)
    return program, {"codes": codes, "k_unit": kn, "k_hat": k_hat, "codebook_unit": cb}


def vq_attention(q: Tensor, k: Tensor, v: Tensor, codebook: Tensor, beta: Tensor, *, local_bias: Tensor | None = None,
                 code_bias: Tensor | None = None, backend: str = "auto", options: VQOptions | None = None,
                 check_finite: bool | None = None, **option_kwargs) -> tuple[Tensor, dict]:
    """VQ-attention. q, k ``[B, H, T, D]``, v ``[B, H, T, Dv]``, codebook ``[H, N, D]``, beta ``[H]``
    -> ``(out [B, H, T, Dv], aux)``.

    q, k and the codebook rows are L2-normalized inside; each key is replaced by its nearest
    code ``k̂``; scores are ``beta[h] * <q̂, k̂>``, causal — computed in linear form: chunk
    ``c`` reads the codebook with ``log(count)`` and running-mean values of the tokens of
    chunks ``< c−1``, plus the quantized keys of chunks ``c−1, c`` causally. Equal to
    ``softmax(q K̂ᵀ + causal) V`` (see :func:`recurrences.reference.vq_attention_reference`).

    ``local_bias`` ``[H]``: added to the scores of the window rows (LongVQ's local bias).
    ``code_bias`` ``[H, N]``: added to the assignment similarities only (no-use penalty).
    Options: a :class:`VQOptions` (chunk size, estimator, state layout, block size) or its fields
    as keywords. ``check_finite=True`` refuses nan/inf in every tensor argument (None:
    :func:`ovqflex.finite_checks`; eager only).

    ``aux``: ``codes``, ``commitment`` (``mean ||k̂ - sg(code)||²``, differentiable in k),
    and detached metrics ``usage``, ``perplexity``, ``unused_codes``, ``rel_quant_error``.
    """
    program, aux = vq_program(q, k, v, codebook, beta, local_bias=local_bias, code_bias=code_bias, options=options,
                              check_finite=check_finite, **option_kwargs)
    with stage("attention"):
        out = attend(program, backend)
    kn, cb, codes = aux.pop("k_unit"), aux.pop("codebook_unit"), aux["codes"]
    aux.pop("k_hat")
    aux["commitment"] = commitment_loss(kn, cb, codes)
    aux.update(codebook_metrics(kn, cb, codes))
    return out, aux


def vq_flops(T: int, H: int, D: int, options: VQOptions, codebook_size: int, B: int = 1) -> float:
    """Model FLOPs of VQ attention in linear form: per chunk, the ``codebook_size`` codebook rows
    (from chunk 2 on), the whole previous chunk and the causal half of its own chunk."""
    C, N = options.chunk_size, codebook_size
    total = 0
    for c in range(-(-T // C)):
        lq = min(C, T - c * C)
        total += lq * (N if c >= 2 else 0) + lq * (C if c >= 1 else 0) + lq * (lq + 1) / 2
    return 4.0 * B * H * D * total
