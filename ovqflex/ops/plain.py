"""Plain (stateless) attention ops: full causal, token / block sliding window, sinks (SPEC §4.1)."""
from __future__ import annotations

from torch import Tensor

from masks.program import DEFAULT_BLOCK, build_program
from masks.regions import BlockWindow, Causal, Region, Sinks, TokenWindow
from recurrences.checks import check_chunk, check_int

from ..attention import attend
from ..profiling import stage


def plain_regions(
    *, window: int | None = None, block_window: int | None = None, chunk_size: int = 128, n_sinks: int = 0
) -> tuple[Region, ...]:
    """Regions of a plain program.

    ``window`` (tokens) or ``block_window`` (``Nb`` chunks of ``chunk_size``) — at most
    one; neither means full causal. ``n_sinks`` first tokens are always visible.
    """
    if window is not None and block_window is not None:
        raise ValueError(f"give window or block_window, not both (window={window}, block_window={block_window})")
    check_int("n_sinks", n_sinks, minimum=0)
    if window is not None:
        check_int("window", window)
        regions: tuple[Region, ...] = (TokenWindow(window),)
    elif block_window is not None:
        check_int("block_window", block_window)
        check_chunk("chunk_size", chunk_size)
        regions = (BlockWindow(block_window, chunk_size),)
    else:
        regions = (Causal(),)
    return ((Sinks(n_sinks),) if n_sinks else ()) + regions


def causal_attention(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, backend: str = "auto",
    block_size: int = DEFAULT_BLOCK,
) -> Tensor:
    """Full causal softmax attention. q, k: ``[B, H, T, D]``, v: ``[B, H, T, Dv]`` -> ``[B, H, T, Dv]``."""
    return sliding_window_attention(q, k, v, scale=scale, backend=backend, block_size=block_size)


def sliding_window_attention(
    q: Tensor, k: Tensor, v: Tensor, *, window: int | None = None, block_window: int | None = None,
    chunk_size: int = 128, n_sinks: int = 0, scale: float | None = None, backend: str = "auto",
    block_size: int = DEFAULT_BLOCK,
) -> Tensor:
    """Causal attention restricted to a token window, a block window and/or sinks.

    q, k: ``[B, H, T, D]``, v: ``[B, H, T, Dv]`` -> ``[B, H, T, Dv]``.
    """
    regions = plain_regions(window=window, block_window=block_window, chunk_size=chunk_size, n_sinks=n_sinks)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    with stage("block_mask"):
        program = build_program(q, k, v, regions, scale=scale, block_size=block_size)
    with stage("attention"):
        return attend(program, backend)
