"""KVM routing with static shapes (docs/design.md §4.3): the overflow-chunk loop of
:func:`~recurrences.kvm.routing.route_kvm`, every chunk step on tensors of one shape.

The loop's routing state is one fixed buffer (fp32 row sums ``[B, H, S, D]``, ``S = max(sizes)``);
what changes per chunk is the number of live rows ``m`` it reads and the number ``n_app`` of
tokens that found new rows. Here the state is padded to ``R = static_rows(S)`` rows (a power of
two, the rows past ``S`` dead) with a spare after them (``R + 1`` rows), and a step reads all ``R``
rows, not the spare: one product of the chunk's keys against ``LN_s`` of every row (``[C, R]``),
append scores over the live rows (``arange(R) < m``, the others ``-inf``), ``m, m + n_app`` from a
device tensor, the founders the tokens whose rank in the stable sort of their scores is below
``n_app`` (a mask, not a slice) on rows ``m, m+1, …`` in temporal order, merge logits (the gate
times the same products, as in the loop) over the rows ``sink_len..m-1`` and, from a ``[C, C]``
product against the chunk's own ``LN_s(kbar)``, over the founders' new rows. So
``torch.compile(fullgraph=True, dynamic=False)`` compiles the step once for every chunk and every
length whose state falls in the same bucket, and the loop over chunks
(:func:`route_overflow_static`) has no host sync and no data-dependent shape: the target of one
CUDA-graph capture (:class:`StaticKVMRouter`, ``cuda_graph=True``), which ``route_kvm(impl="static")``
and the op's default ``routing="auto"`` use on CUDA, one cached router per input shape and options
(:func:`~recurrences.compiling.static_router`).

What a step moves is kept to the chunk's rows, since on a GPU a step's time is its passes over the
state: the router keeps ``LN_s`` of the state's rows in a second buffer, which the absorb refreshes
on the rows it wrote, instead of normalizing all ``R`` every step; it normalizes every chunk's keys
before the steps, in one launch where each step launched its own; and the writes are one opaque op
(:func:`kvm_absorb_static`) that mutates the buffers in place, where compiled code would copy the
whole state in and out around a functional scatter.

Same routes as the loop: ``LN_s`` is the eager kernel (:func:`_ln_rows`; a row's result does not
depend on the other rows), dead scores are ``-inf`` (they never win a max; the max and the argmax's
first index over the live logits are the loop's: the founders' rows follow the state's and their
columns are in the same order), the founders are the loop's ``sort(stable)[:n_app]`` and get the
loop's rows (``m`` + their count among the founders before them: the loop's ascending ``chosen``),
and the write is the loop's founder write and merge add (its summands
:func:`~recurrences.kvm.routing.merge_keys`: the state bit for bit). What remains are the
products: the padded ``[C, R]`` one may round a logit differently from the loop's ``[C, m]`` one
where the library picks another kernel by shape (the ``[C, C]`` one is the loop's). On
the CPU (MKL) a product against a padded matrix gives the exact one's bits on its first ``n``
columns from ``n = 12`` (``L >= 8``, ``D >= 4``; tests/recurrences/test_ovq_routing_static.py), and
KVM's ``m >= C >= 16`` (``kvm_state_sizes`` wants a chunk that is a multiple of 16) is above that
(at ``D = 1`` a logit is one product, exact in either); on every shape tested
(tests/recurrences/test_kvm_routing_static.py, exact ties from duplicated keys included; the
``routing`` bench's ``same_routes`` at 2048 rows) routes and state are bit-identical, compiled or
not. On CUDA, cuBLAS picks its kernel by shape too, and the loop's ``scatter_add_`` is an unordered
atomic sum, so there near-ties can differ, as between two runs of the loop (§4.2 "Near ties").
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import check_int
from ..compiling import (capture_cuda_graph, chunk_bounds, chunks_first, compile_fixed_shapes, eager_kernels,
                         replay_or_run, row_index, stable_rank, static_router, static_rows, tokens_from_chunks)
from ..precision import no_autocast
from .budget import check_sink_len
from .routing import found_first_chunk, merge_keys


#: Whether a compiled static step writes its absorb as traced code that inductor fuses into the step's
#: kernels (:func:`kvm_absorb_fused`), per device type; otherwise (and always eager) it calls the opaque
#: :func:`kvm_absorb_static`, the loop's own kernels. As for OVQ (recurrences/ovq/routing_static.py): on
#: CUDA the loop's merge add is an unordered atomic sum already, so fusing costs no exactness, and the
#: opaque op's eager launches a step (five, in a run bound by launches) become fewer: compiled for CUDA
#: (torch 2.11) the step is 10 launches, 12 with the opaque op (``tools/cuda_codegen.py kvm``); on the
#: CPU the eager kernels add a row's tokens in token order, the loop's bits, where inductor's fused adds
#: may split a head's tokens over threads.
FUSED_ABSORB = {"cpu": False, "cuda": True}


def route_kvm_static(kbar: Tensor, gate: Tensor, ln_weight: Tensor, ln_bias: Tensor, *, chunk_size: int,
                     n_bswa_chunks: int, sizes: list[int], sink_len: int, ln_eps: float = 1e-5,
                     compile: bool = True, cuda_graph: bool | None = None) -> tuple[Tensor, Tensor]:
    """``routes [B, H, T]`` int64 and ``founder [B, H, T]`` bool: what ``route_kvm`` returns.

    kbar ``[B, H, T, D]`` memory keys, gate ``[B, H, T]``, ``ln_weight, ln_bias [D]`` (any float
    dtype; routing in fp32); ``sizes``: ``kvm_state_sizes(...)``; ``compile``: the step compiled
    (``compiled_static_step``, once per step shape — ``[B, H, C, D]`` keys against a state bucket,
    :func:`static_rows` — and ``(sink_len, ln_eps)``; at most
    :data:`~recurrences.compiling.RECOMPILE_LIMIT` such variants per process); ``cuda_graph`` (None:
    on CUDA): the run replayed from one CUDA graph (inside a capture of the caller's, run into that
    graph). One call of the :class:`StaticKVMRouter` cached for these arguments
    (:func:`~recurrences.compiling.static_router`). No grad.
    """
    device = kbar.device
    cuda_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
    key = ("kvm", tuple(kbar.shape), device, chunk_size, n_bswa_chunks, tuple(sizes), sink_len, ln_eps, compile,
           cuda_graph)
    router = static_router(key, lambda: StaticKVMRouter(
        tuple(kbar.shape), chunk_size=chunk_size, n_bswa_chunks=n_bswa_chunks, sizes=sizes, sink_len=sink_len,
        ln_eps=ln_eps, device=device, compile=compile, cuda_graph=cuda_graph))
    return router(kbar, gate, ln_weight, ln_bias)


class StaticKVMRouter:
    """Static-shape KVM routing of one input shape ``[B, H, T, D]``, its buffers allocated once.

    A call copies the chunks that are absorbed (chunk 0 and the overflow chunks ``u = 1..len(sizes)
    - Nb - 1``) of kbar and gate into chunk-major fp32 buffers ``kf [n, B, H, C, D]``, ``gf [n, B, H,
    C]`` (:func:`~recurrences.compiling.chunks_first`), the ``LN_s`` parameters into ``ln [2, D]``,
    and runs :meth:`run`: zero the state (``[B, H, R+1, D]``, ``R = static_rows(S)``, row ``R`` the
    spare), found rows ``0..C-1`` with chunk 0, then route every overflow chunk with one static
    step (:func:`route_overflow_static`) into ``routes``/``founder [n, B, H, C]``.

    ``cuda_graph=True`` (CUDA only): :meth:`run` is warmed up (which compiles the step) and
    captured in one CUDA graph at construction; a call is then four copies, one replay and two copies.
    """

    def __init__(self, shape: tuple[int, int, int, int], *, chunk_size: int, n_bswa_chunks: int, sizes: list[int],
                 sink_len: int, ln_eps: float = 1e-5, device: torch.device | str = "cpu", compile: bool = True,
                 cuda_graph: bool = False):
        B, H, T, D = shape
        C, Nb = chunk_size, check_int("n_bswa_chunks", n_bswa_chunks)
        check_sink_len(sink_len, C)
        device = torch.device(device)
        self.chunk_size, self.sizes, self.T = C, list(sizes), T
        if len(self.sizes) > -(-T // C):  # the overflow chunks, u <= len(sizes) - Nb - 1, must be whole
            raise ValueError(f"sizes must list at most ceil(T / chunk_size) = {-(-T // C)} chunks, "
                             f"got {len(self.sizes)}")
        n_overflow = max(len(self.sizes) - Nb - 1, 0)
        n = n_overflow + 1 if max(self.sizes, default=0) > 0 else 0  # chunks absorbed: 0..n_overflow
        self.kf = torch.zeros(n, B, H, C, D, device=device)
        self.gf = torch.zeros(n, B, H, C, device=device)
        self.ln = torch.zeros(2, D, device=device)  # LN_s weight, bias
        self.state = torch.zeros(B, H, static_rows(max(self.sizes, default=0)) + 1, D, device=device)  # spare last
        self.rows = torch.zeros_like(self.state)  # LN_s of the state's rows, kept by the steps
        self.ln_eps = ln_eps
        self.routes = torch.full((n, B, H, C), -1, dtype=torch.long, device=device)
        self.founder = torch.zeros(n, B, H, C, dtype=torch.bool, device=device)
        self.bounds = chunk_bounds(self.sizes[Nb:], n_overflow, device)  # [n_overflow, 2]: (m, m + n_app)
        self.step = functools.partial(compiled_static_step if compile else kvm_static_step, sink_len=sink_len,
                                      ln_eps=ln_eps)
        with torch.no_grad():  # as a call runs it: the warm-up compiles the step for no-grad calls
            self.graph = capture_cuda_graph(self.run, device) if cuda_graph else None

    def __call__(self, kbar: Tensor, gate: Tensor, ln_weight: Tensor, ln_bias: Tensor) -> tuple[Tensor, Tensor]:
        """``routes [B, H, T]`` int64 and ``founder [B, H, T]`` bool of memory keys kbar ``[B, H, T, D]``,
        gates ``[B, H, T]`` and ``LN_s`` parameters ``[D]`` (new tensors: the buffers are reused)."""
        with torch.no_grad(), no_autocast(kbar):
            n, C = self.kf.shape[0], self.chunk_size
            self.kf.copy_(chunks_first(kbar.detach(), n, C))
            self.gf.copy_(chunks_first(gate.detach(), n, C))
            self.ln[0].copy_(ln_weight.detach())
            self.ln[1].copy_(ln_bias.detach())
            replay_or_run(self.graph, self.run)
            return tokens_from_chunks(self.routes, self.T, -1), tokens_from_chunks(self.founder, self.T, False)

    def run(self) -> None:
        """Routes ``self.kf`` into ``self.routes``/``self.founder`` in place: fixed buffers, no host sync
        (the captured work)."""
        self.state.zero_()
        if self.kf.shape[0] == 0:  # T <= Nb * C: nothing is absorbed
            return
        # every chunk's row of self.routes / self.founder is written: chunk 0 here, the others by the steps
        found_first_chunk(self.state, self.routes[0], self.founder[0], self.kf[0], self.chunk_size)
        self.rows.copy_(_ln_rows(self.state, self.ln[0], self.ln[1], self.ln_eps))
        # LN_s of every chunk's keys in one launch, where each step would launch its own (rows are independent)
        key_rows = _ln_rows(self.kf, self.ln[0], self.ln[1], self.ln_eps)
        route_overflow_static(self.routes, self.founder, self.kf, key_rows, self.gf, self.state, self.rows, self.bounds,
                              self.ln, step=self.step)


def route_overflow_static(routes: Tensor, founder: Tensor, kf: Tensor, key_rows: Tensor, gf: Tensor, state: Tensor,
                          rows: Tensor, bounds: Tensor, ln: Tensor, *, step) -> None:
    """Routes and absorbs the overflow chunks ``u = 1..len(bounds)`` in place.

    routes ``[n, B, H, C]`` int64 and founder ``[n, B, H, C]`` bool (chunk ``u``'s row written), kf
    ``[n, B, H, C, D]`` fp32 memory keys, key_rows ``[n, B, H, C, D]`` fp32 ``LN_s`` of them, and gf ``[n, B,
    H, C]`` fp32 gates (chunk-major: every chunk the same strides), state ``[B, H, R+1, D]`` fp32 (updated;
    chunk 0 already founded) and rows ``[B, H, R+1, D]`` its ``LN_s`` (kept), bounds ``[n_overflow, 2]``
    int64 ``(m, m + n_app)`` of chunk ``u`` at row ``u - 1`` on kf's device, ln ``[2, D]`` fp32 ``LN_s``
    weight and bias; ``step(ok, og, state, bounds_u, ln_weight, ln_bias, rows=, key_rows=,
    out=)``: :func:`kvm_static_step` (or ``compiled_static_step``) with ``sink_len, ln_eps`` bound,
    writing chunk ``u``'s routes and founder flags into ``routes[u]``, ``founder[u]`` itself (no copies
    launched per chunk). Every launch reads and writes fixed buffers at fixed offsets, with no host sync.
    """
    for u in range(1, bounds.shape[0] + 1):
        step(kf[u], gf[u], state, bounds[u - 1], ln[0], ln[1], rows=rows, key_rows=key_rows[u],
             out=(routes[u], founder[u]))


def kvm_static_step(ok: Tensor, og: Tensor, state: Tensor, bounds: Tensor, ln_weight: Tensor, ln_bias: Tensor, *,
                    sink_len: int, ln_eps: float, rows: Tensor | None = None, key_rows: Tensor | None = None,
                    out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """One overflow chunk against a state of ``m = bounds[0]`` live rows: ``target [B, H, C]`` int64 and
    ``appended [B, H, C]`` bool (what :func:`~recurrences.kvm.routing.kvm_route_chunk` returns), then absorbed.

    ok ``[B, H, C, D]`` fp32 memory keys, og ``[B, H, C]`` fp32 gates; state ``[B, H, R+1, D]`` fp32
    (rows ``0..R-1`` read, row ``R`` the spare, never read; updated in place by :func:`kvm_absorb_static`,
    or compiled for a device of :data:`FUSED_ABSORB` by :func:`kvm_absorb_fused`);
    bounds ``[2]`` int64 ``(m, m + n_app)``; ``ln_weight, ln_bias [D]`` fp32 of ``LN_s``; rows
    ``[B, H, R+1, D]`` fp32: ``LN_s`` of every state row, kept by the caller across steps (updated here:
    the rows this chunk wrote are normalized again), or None: normalized here from the state; key_rows
    ``[B, H, C, D]`` fp32: ``LN_s(ok)`` (the router's, one launch for every chunk), or None: normalized here. The
    ``n_app`` tokens first in the stable order of their best score over the live rows found rows ``m,
    m+1, …`` in temporal order; the others join their argmax row ``>= sink_len`` over the ``m + n_app``
    rows (first index on ties).

    One product serves both decisions: the keys ``[C, D]`` against the state's rows (``[C, R]``: append
    scores over rows ``< m``, and times the gate the merge logits over rows ``sink_len..m-1``, as in
    the loop); the merge logits on the founders' rows are the gate times a ``[C, C]`` product against
    the chunk's own ``LN_s(kbar)``, one column per token, live where the token founds. Their argmax
    over ``[R + C]`` columns (state rows, then tokens) takes the loop's first index on ties: the
    founders' rows follow the state's and are in temporal order, as their columns are.
    """
    R, C = state.shape[2] - 1, ok.shape[2]
    m, n_rows = bounds[0], bounds[1]
    col = torch.arange(R, device=ok.device)                                                  # [R]
    kept = rows is not None
    if not kept:
        rows = _ln_rows(state, ln_weight, ln_bias, ln_eps)                                   # [B, H, R+1, D]
    sim = ok @ rows[:, :, :R].transpose(-1, -2)                                              # [B, H, C, R]
    score = sim.masked_fill(col >= m, float("-inf")).amax(-1)                                # [B, H, C]
    appended = stable_rank(score) < n_rows - m
    slot = torch.where(appended, m + appended.cumsum(-1) - 1, R)  # founders' new rows; the others the spare
    if key_rows is None:
        key_rows = _ln_rows(ok, ln_weight, ln_bias, ln_eps)                                  # [B, H, C, D]
    own = ok @ key_rows.transpose(-1, -2)                                                    # [B, H, C, C]
    gate = og[..., None]
    on_state = (gate * sim).masked_fill((col < sink_len) | (col >= m), float("-inf")).max(-1)
    on_own = (gate * own).masked_fill((~appended | (slot < sink_len))[..., None, :], float("-inf")).max(-1)
    # argmax over the state's columns, then the tokens' (first index on ties; NaN wins, as in argmax)
    later = (on_own.values > on_state.values) | (on_own.values.isnan() & ~on_state.values.isnan())
    joined = torch.where(later, slot.gather(-1, on_own.indices), on_state.indices)
    target = torch.where(appended, slot, joined)
    # the absorb writes every key to its slot (a founder's new row, the others' the spare R) and adds the
    # merge's summands, computed here where they fuse into the step's kernels
    fused = torch.compiler.is_compiling() and FUSED_ABSORB.get(ok.device.type, False)
    (kvm_absorb_fused if fused else kvm_absorb_static)(state, rows if kept else None, ok, slot,
                                                       merge_keys(ok, og, appended), target, ln_weight, ln_bias, ln_eps)
    if out is not None:
        out[0].copy_(target)
        out[1].copy_(appended)
    return target, appended


@torch.library.custom_op("ovqflex::kvm_absorb_", mutates_args=("state", "rows"))
def kvm_absorb_static(state: Tensor, rows: Tensor | None, ok: Tensor, founder_rows: Tensor, merged: Tensor,
                      target: Tensor, ln_weight: Tensor, ln_bias: Tensor, ln_eps: float) -> None:
    """:func:`~recurrences.kvm.routing.kvm_absorb` without its host int ``n_app`` (which slices the
    founders out of a sort), in place: every token writes its key ``ok [B, H, C, D]`` to its
    ``founder_rows [B, H, C]`` row (a founder's fresh row; the others the spare last row of ``state [B,
    H, R+1, D]``), then adds ``merged`` (:func:`~recurrences.kvm.routing.merge_keys`) to its ``target``
    row, the loop's merge add. The founders' rows get the keys bit for bit as in the loop (rows are
    distinct), and the spare is never read live. With ``rows`` (``LN_s`` of the state's rows, ``[B, H,
    R+1, D]``): the rows written (every target; a repeated one gets the same values twice) normalized
    again.

    An opaque op, run by the eager kernels: compiled code would otherwise functionalize these writes
    into the step's inputs, a copy of the whole state (and of ``rows``) before them and another back
    after, where the writes touch ``C`` rows. The founders' rows and the merge's summands come in
    computed (by the step's fused kernels, three launches fewer per step here)."""
    state.scatter_(2, founder_rows[..., None].expand_as(ok), ok)
    state.scatter_add_(2, target[..., None].expand_as(ok), merged)
    if rows is not None:
        written = target[..., None].expand_as(ok)
        rows.scatter_(2, written, F.layer_norm(state.gather(2, written), (ok.shape[-1],), ln_weight, ln_bias, ln_eps))


@kvm_absorb_static.register_fake
def _(state, rows, ok, founder_rows, merged, target, ln_weight, ln_bias, ln_eps):
    return None


def kvm_absorb_fused(state: Tensor, rows: Tensor | None, ok: Tensor, founder_rows: Tensor, merged: Tensor,
                     target: Tensor, ln_weight: Tensor, ln_bias: Tensor, ln_eps: float) -> None:
    """:func:`kvm_absorb_static`'s writes (same arguments) as traced code, for a compiled step on a device
    of :data:`FUSED_ABSORB`: one accumulating ``index_put_`` on each token's ``(b, h, target row)``, which
    inductor writes into the buffers in place and fuses with the step's kernels that compute the rows
    and summands, where the opaque op launches five eager kernels. A founder (its target is its own new
    row, ``founder_rows == target``; the others' is the spare) adds its key where the opaque op writes
    it: its row is still zero (rows past the live ones are never written), so the key is the row's
    first summand or, the adds being atomic and in no fixed order (as the loop's ``scatter_add_`` is
    on CUDA), is added among the merge's summands, which the loop adds after it. One launch where
    a write and then an add took two. ``LN_s`` of the rows written is still the eager kernel
    (:func:`_ln_rows`: routing reads the loop's bits), on their gathered sums."""
    written = row_index(target)  # each token's (b, h, target row)
    founds = (founder_rows == target)[..., None]  # a founder's target is its new row, the others' a live row
    state.index_put_(written, torch.where(founds, ok, merged), accumulate=True)
    if rows is not None:
        rows.index_put_(written, _ln_rows(state[written], ln_weight, ln_bias, ln_eps))


@eager_kernels("ovqflex::kvm_ln_rows")
def _ln_rows(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """``F.layer_norm(x, (D,), weight, bias, eps)`` by the eager kernel: inductor's own mean and
    variance round differently, and routing must read the loop's ``LN_s`` rows bit for bit."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


# compiled once per input shape and (sink_len, ln_eps): one graph serves every overflow chunk
compiled_static_step = compile_fixed_shapes(kvm_static_step)
