"""OVQ routing with static shapes (docs/design.md §4.2): the chunk loop of
:func:`~recurrences.ovq.routing.route_ovq`, every chunk step on tensors of one shape.

The loop's dictionary already lives in fixed buffers (fp32 ``sums [B, H, S+1, D]``,
``counts [B, H, S+1]``, ``S = max(sizes)``, row ``S`` the spare); what grows is the
number of live rows it reads. Here the rows are padded to ``R = static_rows(S)`` (a power of
two) with the spare after them (``R + 1`` rows); a step reads all ``R`` rows, not the spare
(so ``N = 2048`` reads 2048 rows, not 4096), and masks the dead ones
(``arange(R) < N_c``, scores ``-inf``); the sizes ``N_c, N_{c+1}`` are a device tensor; the
``n_new`` founders are the tokens whose rank in the stable sort is below ``N_{c+1} - N_c``
(a mask, not a slice). So ``torch.compile(fullgraph=True, dynamic=False)`` compiles the step
once for every chunk and every length whose dictionary falls in the same bucket, and the
loop over chunks (:func:`route_chunks_static`) has no host sync and no data-dependent shape:
the target of one CUDA-graph capture (:class:`StaticOVQRouter`, ``cuda_graph=True``), which
``route_ovq(impl="static")`` and the ops' default ``routing="auto"`` use on CUDA, one cached
router per input shape and options (:func:`~recurrences.compiling.static_router`).

What a step moves is kept to the chunk's rows, since on a GPU a step's time is its passes
over the dictionary: the router keeps the rows' read form (means, unit with
``normalize_centroids``: :func:`dictionary_means`), which the absorb derives again on the
rows it wrote, instead of dividing all ``R`` every step; and the absorb writes the buffers in
place, where compiled code would copy the whole dictionary in and out around a functional
scatter-add: one opaque op of the loop's own kernels (:func:`absorb_in_place`), or in a step
compiled for CUDA (:data:`FUSED_ABSORB`) ``index_put_`` writes that inductor keeps in place and
fuses with the step's kernels (:func:`absorb_fused`; on the CPU they would make the whole step the
product and one kernel).

Same routes as the loop: live rows are divided by the same counts (dead rows read 0,
never 0/0), dead scores are ``-inf`` (they never win a max; the max and its first
index over the live scores are the loop's), the founders are the loop's
``sort(stable)[:n_new]`` in the same order, the absorb is the loop's own
:func:`~recurrences.ovq.routing.ovq_absorb` write (its sums bit for bit), and with
``normalize_centroids`` the row norm is the eager kernel (:func:`_eager_unit_rows`; a row's
result does not depend on the others). What remains is the product ``kc @ d^T``: the
padded ``[L, R]`` one may round a score differently from the loop's ``[L, N_c]`` one when
the library picks another kernel by shape. On the CPU (MKL) the padded product gives the
exact one's bits from ``N_c = 12`` rows on (``L >= 8``, ``D >= 4``); below that ATen's naive
bmm or MKL's small-matrix kernels round some columns otherwise, and an exact tie between two
scores (duplicated keys) can break the other way. A dictionary reads at least 12 rows from its
first non-empty chunk whenever ``N`` is not tiny (``N = 2048``, ``L = 128``: 120 rows, plateau
growth), and then scores are bit-identical and so are routes
(tests/recurrences/test_ovq_routing_static.py). On CUDA, cuBLAS picks its kernel by
shape too, and the loop's ``scatter_add_`` is an unordered atomic sum, so there only
near-ties can differ, as between the loop and the paper's reference (§4.2 "Near ties").
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from ..compiling import (capture_cuda_graph, chunk_bounds, chunks_first, compile_fixed_shapes, eager_kernels,
                         replay_or_run, row_index, stable_rank, static_router, static_rows, tokens_from_chunks)
from ..precision import no_autocast
from .routing import add_to_rows, ovq_absorb, ovq_route_chunk, seeding_draw

#: Whether a compiled static step writes its absorb as traced code that inductor fuses into the step's
#: kernels (:func:`absorb_fused`), per device type; otherwise (and always eager) it calls the opaque
#: :func:`absorb_in_place`, the loop's own kernels. On CUDA the loop's scatter-add is an unordered
#: atomic sum already, so fusing costs no exactness, and the opaque op's seven eager launches a step
#: (in a run bound by launches) join the step's fused kernels; on the CPU the eager kernels add a
#: row's tokens in token order, the loop's bits, where inductor's fused adds may split a head's tokens
#: over threads.
FUSED_ABSORB = {"cpu": False, "cuda": True}


def route_ovq_static(k: Tensor, *, chunk_size: int, sizes: list[int], seeding: str = "spread", seed: int = 0,
                     normalize_centroids: bool = False, compile: bool = True, cuda_graph: bool | None = None) -> Tensor:
    """Slot of every token, ``[B, H, T]`` int64 (-1: not routed): what ``route_ovq`` returns.

    k: ``[B, H, T, D]`` unit keys (any float dtype; routing in fp32); ``sizes``:
    ``dictionary_sizes(...)``; ``compile``: the step compiled (``compiled_static_step``, once
    per step shape — ``[B, H, L, D]`` keys against a dictionary bucket, :func:`static_rows` — and per
    ``(seeding, normalize_centroids)``; at most :data:`~recurrences.compiling.RECOMPILE_LIMIT` such
    variants per process); ``cuda_graph`` (None: on CUDA): the run replayed from one CUDA graph
    (inside a capture of the caller's, run into that graph). One call of the :class:`StaticOVQRouter`
    cached for these arguments (:func:`~recurrences.compiling.static_router`). No grad.
    """
    device = k.device
    cuda_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
    key = ("ovq", tuple(k.shape), device, chunk_size, tuple(sizes), seeding, seed, normalize_centroids, compile,
           cuda_graph)
    router = static_router(key, lambda: StaticOVQRouter(
        tuple(k.shape), chunk_size=chunk_size, sizes=sizes, seeding=seeding, seed=seed,
        normalize_centroids=normalize_centroids, device=device, compile=compile, cuda_graph=cuda_graph))
    return router(k)


class StaticOVQRouter:
    """Static-shape OVQ routing of one input shape ``[B, H, T, D]``, its buffers allocated once.

    A call copies the complete chunks of k into the chunk-major fp32 key buffer ``kf [n, B, H, L,
    D]`` (:func:`~recurrences.compiling.chunks_first`, ``n = T // L``) and runs :meth:`run`: zero the
    dictionary (``sums [B, H, R+1, D]``, ``counts [B, H, R+1]``, ``R = static_rows(S)`` with ``S =
    max(sizes)``: row ``R`` the spare, the rows ``S..R-1`` dead), route the leading
    chunks that read an empty dictionary (``N_c = 0``: chunk 0, the first seeding) with the loop's
    own :func:`ovq_route_chunk`, then every later chunk with one static step
    (:func:`route_chunks_static`) into ``routes [n, B, H, L]``. The random-seeding draws are the
    loop's (one ``[B, H, L]`` per complete chunk from a CPU generator seeded with ``seed``), drawn once.

    ``cuda_graph=True`` (CUDA only): :meth:`run` is warmed up (which compiles the step) and
    captured in one CUDA graph at construction; a call is then a copy, one replay and a copy.
    """

    def __init__(self, shape: tuple[int, int, int, int], *, chunk_size: int, sizes: list[int],
                 seeding: str = "spread", seed: int = 0, normalize_centroids: bool = False,
                 device: torch.device | str = "cpu", compile: bool = True, cuda_graph: bool = False):
        B, H, T, D = shape
        L, n_full = chunk_size, T // chunk_size
        device = torch.device(device)
        self.chunk_size, self.sizes, self.normalize_centroids, self.T = L, list(sizes), normalize_centroids, T
        n_slots = max(self.sizes[: n_full + 1] + [0])
        self.kf = torch.zeros(n_full, B, H, L, D, device=device)
        R = static_rows(n_slots)
        self.sums = torch.zeros(B, H, R + 1, D, device=device)  # row R the spare
        self.counts = torch.zeros(B, H, R + 1, device=device)
        self.means = torch.zeros_like(self.sums)  # the rows' read form, kept by the steps
        self.routes = torch.full((n_full, B, H, L), -1, dtype=torch.long, device=device)
        self.bounds = chunk_bounds(self.sizes, n_full, device)
        gen = torch.Generator().manual_seed(seed) if seeding == "random" else None
        draws = [] if gen is None else [seeding_draw(gen, B, H, L, "cpu") for _ in range(n_full)]
        self.u = torch.stack(draws).to(device) if draws else None  # [n_full, B, H, L]
        self.step = functools.partial(compiled_static_step if compile else ovq_static_step,
                                      normalize_centroids=normalize_centroids)
        with torch.no_grad():  # as a call runs it: the warm-up compiles the step for no-grad calls
            self.graph = capture_cuda_graph(self.run, device) if cuda_graph else None

    def __call__(self, k: Tensor) -> Tensor:
        """Routes ``[B, H, T]`` int64 of keys k ``[B, H, T, D]`` (a new tensor: the buffers are reused)."""
        with torch.no_grad(), no_autocast(k):
            self.kf.copy_(chunks_first(k.detach(), self.kf.shape[0], self.chunk_size))
            replay_or_run(self.graph, self.run)
            return tokens_from_chunks(self.routes, self.T, -1)

    def run(self) -> None:
        """Routes ``self.kf`` into ``self.routes`` in place: fixed buffers, no host sync (the captured work)."""
        sizes = self.sizes
        self.sums.zero_()
        self.counts.zero_()
        first, n_full = 0, self.kf.shape[0]  # every chunk's row of self.routes is written below
        while first < n_full and sizes[first] == 0:  # an empty dictionary: the loop's own chunk step
            route = ovq_route_chunk(self.kf[first], self.sums, self.counts, 0, sizes[first + 1],
                                    None if self.u is None else self.u[first], self.normalize_centroids)
            ovq_absorb(self.sums, self.counts, self.kf[first], route)
            self.routes[first] = route
            first += 1
        self.means.copy_(dictionary_means(self.sums, self.counts, self.normalize_centroids))
        route_chunks_static(self.routes, self.kf, self.sums, self.counts, self.means, self.bounds, self.u,
                            first=first, step=self.step)


def route_chunks_static(routes: Tensor, kf: Tensor, sums: Tensor, counts: Tensor, means: Tensor, bounds: Tensor,
                        u: Tensor | None, *, first: int, step) -> None:
    """Routes and absorbs the complete chunks ``first..n - 1`` in place.

    routes ``[n, B, H, L]`` int64 (chunk ``c``'s row written), kf ``[n, B, H, L, D]`` fp32 unit keys
    (chunk-major: every chunk the same strides), sums ``[B, H, R+1, D]`` / counts ``[B, H, R+1]`` fp32
    and their read form means ``[B, H, R+1, D]`` (:func:`dictionary_means`; all updated), bounds
    ``[n, 2]`` int64 ``(N_c, N_{c+1})`` on kf's device (``N_first > 0``), u ``[n,
    B, H, L]`` random-seeding draws or None (spread); ``step(kc, sums, counts, bounds_c, u_c, means=, out=)``:
    :func:`ovq_static_step` (or ``compiled_static_step``) with ``normalize_centroids`` bound, writing
    chunk ``c``'s routes into ``routes[c]`` itself (no copy launched per chunk). Every launch reads
    and writes fixed buffers at fixed offsets, with no host sync.
    """
    for c in range(first, kf.shape[0]):
        step(kf[c], sums, counts, bounds[c], None if u is None else u[c], means=means, out=routes[c])


def ovq_static_step(kc: Tensor, sums: Tensor, counts: Tensor, bounds: Tensor, u: Tensor | None, *,
                    normalize_centroids: bool, means: Tensor | None = None, value_sums: Tensor | None = None,
                    vc: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """One chunk against a dictionary with ``N_c = bounds[0] > 0`` live rows: routes ``[B, H, L]``, then absorbs them.

    kc ``[B, H, L, D]`` fp32 unit keys; sums ``[B, H, R+1, D]``, counts ``[B, H, R+1]`` fp32 (rows
    ``0..R-1`` read, row ``R`` the spare, never read; updated in place by :func:`absorb_in_place`);
    bounds ``[2]`` int64 ``(N_c, N_{c+1})``; u ``[B, H, L]`` random-seeding draws (None: spread); means
    ``[B, H, R+1, D]`` fp32: what the rows are read as (``sums / counts``, unit with
    ``normalize_centroids``; 0 for an empty row: :func:`dictionary_means`), kept by the caller across
    steps (the rows this chunk writes are derived again by the absorb), or None: derived here from
    every row; value_sums ``[B, H, R+1, Dv]`` and vc ``[B, H, L, Dv]`` fp32: the values absorbed too
    (a static decode cache); out ``[B, H, L]`` int64: the routes written there too (compiled, by the
    step's own kernels). The
    ``N_{c+1} - N_c`` tokens first in the stable order of their best similarity (or of u) found
    slots ``N_c, N_c + 1, …``; the others join their best live slot (first index on ties).
    """
    R = sums.shape[2] - 1
    n_old, n_new = bounds[0], bounds[1] - bounds[0]
    live = torch.arange(R, device=kc.device) < n_old                        # [R]
    d = (dictionary_means(sums, counts, normalize_centroids) if means is None else means)[:, :, :R]
    sim = (kc @ d.transpose(-1, -2)).masked_fill(~live, float("-inf"))       # [B, H, L, R]
    best_sim, route = sim.max(dim=-1)
    rank = stable_rank(best_sim if u is None else u)
    route = torch.where(rank < n_new, n_old + rank, route)
    fused = torch.compiler.is_compiling() and FUSED_ABSORB.get(kc.device.type, False)
    (absorb_fused if fused else absorb_in_place)(sums, counts, means, kc, route, value_sums, vc, normalize_centroids)
    if out is not None:
        out.copy_(route)
    return route


@torch.library.custom_op("ovqflex::ovq_absorb_", mutates_args=("sums", "counts", "means", "value_sums"))
def absorb_in_place(sums: Tensor, counts: Tensor, means: Tensor | None, kc: Tensor, route: Tensor,
                    value_sums: Tensor | None, vc: Tensor | None, normalize_centroids: bool) -> None:
    """The loop's absorb (:func:`~recurrences.ovq.routing.add_to_rows`, the write of
    :func:`~recurrences.ovq.routing.ovq_absorb`) as an opaque op that writes its buffers in place,
    and with ``means`` (``[B, H, R+1, D]``, :func:`ovq_static_step`'s kept read form) the rows it
    wrote derived again by :func:`dictionary_means`, the formula and kernels that
    derive every row (a row's result does not depend on the others; a repeated route writes the same
    values twice). Compiled code would otherwise functionalize these writes into the step's inputs:
    a copy of the whole dictionary before them and another back after, two passes over ``[B, H, R+1,
    D]`` per chunk step where the writes touch ``L`` rows. The absorb's kernels are the loop's own,
    without ``ovq_absorb``'s clamp of the routes to the spare row (four launches per step: a step's
    routes always name a row ``< R``)."""
    add_to_rows(sums, counts, kc, route, value_sums, vc)  # a step's routes are rows < R: no clamp to the spare
    if means is not None:
        idx = route[..., None].expand_as(kc)
        means.scatter_(2, idx, dictionary_means(sums.gather(2, idx), counts.gather(2, route), normalize_centroids))


@absorb_in_place.register_fake
def _(sums, counts, means, kc, route, value_sums, vc, normalize_centroids):
    return None


def absorb_fused(sums: Tensor, counts: Tensor, means: Tensor | None, kc: Tensor, route: Tensor,
                 value_sums: Tensor | None, vc: Tensor | None, normalize_centroids: bool) -> None:
    """:func:`absorb_in_place`'s writes (same arguments) as traced code, for a compiled step on a
    device of :data:`FUSED_ABSORB`: ``index_put_`` on each token's ``(b, h, row)``, which inductor
    writes into the buffers in place and fuses with the step's other kernels (on the CPU the whole
    step becomes the product and one kernel). A traced ``scatter_add_`` would instead run as an eager
    fallback on a copy of the whole dictionary, copied back after. The adds are atomic, in no fixed
    order; the counts (whole numbers) and each row's ``means`` from its sums are exact."""
    rows = row_index(route)  # each token's (b, h, row) index
    sums.index_put_(rows, kc, accumulate=True)
    counts.index_put_(rows, torch.ones_like(route, dtype=counts.dtype), accumulate=True)
    if value_sums is not None:
        value_sums.index_put_(rows, vc, accumulate=True)
    if means is not None:
        means.index_put_(rows, dictionary_means(sums[rows], counts[rows], normalize_centroids))


def dictionary_means(sums: Tensor, counts: Tensor, normalize_centroids: bool) -> Tensor:
    """``[B, H, R+1, D]``: how :func:`ovq_static_step` reads every row of a dictionary (``sums [B, H,
    R+1, D]``, ``counts [B, H, R+1]``): ``sums / counts`` (unit with ``normalize_centroids``), 0 for
    an empty row."""
    d = sums / counts.clamp_min(1.0)[..., None]  # counts are whole numbers: a live row's own count, 1 for an empty one
    return _eager_unit_rows(d) if normalize_centroids else d


@eager_kernels("ovqflex::ovq_unit_rows")
def _eager_unit_rows(d: Tensor) -> Tensor:
    """``F.normalize(d, dim=-1)`` by the eager kernel: inductor's own sum of squares rounds
    differently, and routing must read the loop's normalised means bit for bit."""
    return F.normalize(d, dim=-1)


# compiled once per input shape, seeding (u or None) and normalize_centroids: one graph serves every chunk
compiled_static_step = compile_fixed_shapes(ovq_static_step)
