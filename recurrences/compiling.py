"""Compiling fixed-shape code (docs/design.md §3 backends, §4.2-4.3 static-shape routing), and what
OVQ's and KVM's static routing steps share: ``ROUTING_IMPLS``, :func:`stable_rank`, :func:`chunk_bounds`.

``torch.compile(..., dynamic=False)`` makes one graph per input shape, and dynamo allows a
function only ``recompile_limit`` graphs (8 by default). Past it, a ``fullgraph=True`` function
raises ``FailOnRecompileLimitHit`` and any other falls back to eager, unfused code without an
error. The project's compiled code meets a new shape for every context length (a static
routing step's state buffer grows with it; a flex program's block count does), so an
evaluation over several lengths would pass 8. The limit is raised process-wide to
:data:`RECOMPILE_LIMIT` the first time such code compiles.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

#: Routing implementations of OVQ and KVM: the chunk loop, or the compiled static-shape step.
ROUTING_IMPLS = ("loop", "static")

#: dynamo's process-wide recompile limit once the project's compiled code has run
RECOMPILE_LIMIT = 64


def raise_recompile_limit() -> None:
    """Raise dynamo's ``recompile_limit`` to at least :data:`RECOMPILE_LIMIT` (never lower it)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)


def compile_fixed_shapes(fn: Callable) -> Callable:
    """``fn`` compiled with ``fullgraph=True, dynamic=False``: one graph per input shape (and per
    value of its non-tensor arguments), at most :data:`RECOMPILE_LIMIT` of them. Compiles on the
    first call, which raises the limit; later calls cost one check on the host."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            raise_recompile_limit()
            compiled = torch.compile(fn, fullgraph=True, dynamic=False)
        return compiled(*args, **kwargs)

    return call


def capture_cuda_graph(run: Callable[[], None], device: torch.device) -> "torch.cuda.CUDAGraph":
    """``run`` (fixed buffers, no host sync) captured in one CUDA graph on ``device``: warmed up
    once on a side stream first (which compiles what it compiles, outside the capture). Replay
    the graph to run it again. ``ValueError`` naming the device unless it is a CUDA device."""
    if device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a CUDA device, got {device}")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def stable_rank(key: Tensor) -> Tensor:
    """Rank ``[..., L]`` int64 of each entry of ``key [..., L]`` in its stable ascending sort along
    the last dim: ``rank < n`` marks the loop's ``sort(stable).indices[..., :n]`` with ``n`` a device value."""
    order = torch.sort(key, dim=-1, stable=True).indices
    arange = torch.arange(key.shape[-1], device=key.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, arange)


def chunk_bounds(sizes: list[int], n_chunks: int, device) -> Tensor:
    """``[n_chunks, 2]`` int64 ``(N_c, N_{c+1})`` per chunk on ``device`` (``sizes``: at least
    ``n_chunks + 1`` entries): one 16-byte row each, so every step reads an aligned input."""
    return torch.tensor([sizes[c:c + 2] for c in range(n_chunks)], dtype=torch.long, device=device).view(n_chunks, 2)
