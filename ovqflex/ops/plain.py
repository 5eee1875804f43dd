"""Plain (stateless) attention ops: full causal, token / block sliding window, sinks (docs/design.md §4.1)."""
from __future__ import annotations

import math

import torch
from torch import Tensor

from masks.program import DEFAULT_BLOCK, build_program
from masks.regions import BlockWindow, Causal, Region, Sinks, TokenWindow
from recurrences.checks import check_chunk, check_finite_args, check_int
from recurrences.compiling import plain_int

from ..attention import attend
from ..profiling import stage


def plain_regions(
    *, window: int | None = None, block_window: int | None = None, chunk_size: int = 128, n_sinks: int = 0
) -> tuple[Region, ...]:
    """Regions of a plain program.

    ``window`` (tokens) or ``block_window`` (``Nb`` chunks of ``chunk_size``) — at most
    one; neither means full causal. ``n_sinks`` first tokens are always visible. Under
    ``torch.compile`` the numbers are taken plain (``recurrences.compiling.plain_int``: one graph
    per value, as an op's options, docs/design.md §3.5).
    """
    if window is not None and block_window is not None:
        raise ValueError(f"give window or block_window, not both (window={window}, block_window={block_window})")
    n_sinks = plain_int(check_int("n_sinks", n_sinks, minimum=0))
    if window is not None:
        regions: tuple[Region, ...] = (TokenWindow(plain_int(check_int("window", window))),)
    elif block_window is not None:
        regions = (BlockWindow(plain_int(check_int("block_window", block_window)),
                               plain_int(check_chunk("chunk_size", chunk_size))),)
    else:
        regions = (Causal(),)
    return ((Sinks(n_sinks),) if n_sinks else ()) + regions


def window_regions(what: str, causal: str, *, window: int | None, block_window: int | None, chunk_size: int,
                   n_sinks: int) -> tuple[Region, ...]:
    """:func:`plain_regions` of a sliding window, which must be given: a window op or layer
    (``what``) never falls back to full causal attention (``causal``) silently."""
    regions = plain_regions(window=window, block_window=block_window, chunk_size=chunk_size, n_sinks=n_sinks)
    if window is None and block_window is None:
        raise ValueError(f"{what} needs window=N (tokens) or block_window=N (chunks of chunk_size), got "
                         f"neither; for full causal attention use {causal}")
    return regions


def _plain_attention(q: Tensor, k: Tensor, v: Tensor, regions: tuple[Region, ...], scale: float | None,
                     backend: str, block_size: int, check_finite: bool | None) -> Tensor:
    with stage("block_mask"):
        program = build_program(q, k, v, regions, scale=q.shape[-1] ** -0.5 if scale is None else scale,
                                block_size=block_size)
    check_finite_args(check_finite, q=q, k=k, v=v)
    with stage("attention"):
        return attend(program, backend)


def causal_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, backend: str = "auto",
    block_size: int = DEFAULT_BLOCK, check_finite: bool | None = None,
) -> Tensor:
    """Full causal softmax attention. q, k: ``[B, H, T, D]``, v: ``[B, H, T, Dv]`` -> ``[B, H, T, Dv]``.

    ``check_finite=True`` refuses nan/inf in q, k, v (None: :func:`ovqflex.finite_checks`; eager only)."""
    return _plain_attention(q, k, v, plain_regions(), scale, backend, block_size, check_finite)


def sliding_window_attention(
    q: Tensor, k: Tensor, v: Tensor, *, window: int | None = None, block_window: int | None = None,
    chunk_size: int = 128, n_sinks: int = 0, scale: float | None = None, backend: str = "auto",
    block_size: int = DEFAULT_BLOCK, check_finite: bool | None = None,
) -> Tensor:
    """Causal attention restricted to a token ``window`` or a ``block_window`` (exactly one),
    plus ``n_sinks`` sinks; full causal attention is :func:`causal_attention`.

    q, k: ``[B, H, T, D]``, v: ``[B, H, T, Dv]`` -> ``[B, H, T, Dv]``. ``check_finite`` as
    :func:`causal_attention`.
    """
    regions = window_regions("sliding_window_attention", "causal_attention", window=window, block_window=block_window,
                             chunk_size=chunk_size, n_sinks=n_sinks)
    return _plain_attention(q, k, v, regions, scale, backend, block_size, check_finite)


def check_logn_len(logn_len: object) -> int:
    """``logn_len`` of :func:`logn_scale`: 0 (off) or an int >= 2."""
    value = check_int("logn_len", logn_len, minimum=0)
    if value == 1:
        raise ValueError("logn_len must be 0 (off) or an int >= 2 (the length the logits were trained at), got 1")
    return value


def logn_scale(pos: Tensor, logn_len: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Log-length logit scale ``[T]`` in ``dtype`` (fp32, or fp64 for an fp64 layer) of causal queries at
    absolute positions ``pos`` ``[T]``: ``max(1, ln(pos + 1) / ln(logn_len))``.

    A query at ``pos`` sees ``n = pos + 1`` keys, and a softmax over ``n`` keys gives a match with
    a fixed logit margin ``d`` over the rest a weight that falls about as ``1 / n``. With the
    logits multiplied by ``log_L(n)``, ``L = logn_len``, the match's term ``exp(d)`` becomes
    ``n ** (d / ln L)``: a margin that gave it half the weight or more among ``L`` keys gives it
    half or more among any ``n > L`` (set ``L`` to the training length: shorter contexts are
    unchanged). The length-dependent logit scale of "Overcoming a
    Theoretical Limitation of Self-Attention" (Chiang & Cholak, ACL 2022) and of Scalable-Softmax
    (arXiv 2501.19399), here with the scale fixed so that a model trained without it can use it
    at test time (docs/experiments.md: icr at the gpu scale).
    """
    return ((pos + 1).to(dtype).log() / math.log(logn_len)).clamp(min=1.0)
