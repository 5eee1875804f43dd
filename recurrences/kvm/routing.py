"""KVM routing (docs/design.md §4.3): which state row each overflow token founds or joins. No grad.

Loops over overflow chunks only; each is vectorized over batch, heads and its
tokens. The routing state is kept as fp32 sums of the memory keys, exactly the
sums the differentiable state build produces from the same routes.

Overflow chunk ``u >= 1`` (tokens ``[u*C, (u+1)*C)``) is absorbed after query chunk
``u + Nb - 1``:
1. append: each token's score is ``max_i kbar_j . LN_s(s_i)`` over the current rows;
   the ``n_append`` lowest (stable) found new rows, in temporal order;
2. merge: the others join ``argmax_{i >= sink_len} g_j (kbar_j . LN_s(s+_i))`` over the
   rows *after* appending; row sums gain ``g_j kbar_j`` (and ``g_j v_j``).
Chunk 0 founds rows ``0..C-1`` (the initial state).

The merge logits are the paper's ``(g_j kbar_j) . LN_s(s+_i)`` with the scalar gate applied to
the products instead of the key: the same argmax (the KVM paper, arXiv 2605.09877, §4 "Merge",
writes it equal to the ungated one; ``g = 1 + elu >= 0``, and a gate that underflows to 0 ties
every row, as before, to the first after the sinks), so the append's product of the chunk's keys
against the state's rows serves the merge too: one ``[C, m]`` product a chunk instead of two,
and on the founders' rows a ``[C, C]`` one (docs/design.md §4.3).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..compiling import resolve_routing
from ..precision import no_autocast
from .budget import KVMBudget, KVMSchedule, check_sink_len


def route_kvm(kbar: Tensor, gate: Tensor, ln_weight: Tensor, ln_bias: Tensor, *, schedule: KVMSchedule,
              sink_len: int, ln_eps: float = 1e-5, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """Routes of every token.

    kbar ``[B, H, T, D]`` memory keys ``LN_s(k with the rope dims zeroed)``; gate ``[B, H, T]``
    merge gates; ``ln_weight, ln_bias [D]`` of ``LN_s``; ``schedule``: the chunk size, the block
    window and the state budget (:class:`~recurrences.kvm.budget.KVMSchedule`).
    Returns ``routes [B, H, T]`` int64 (state row; -1: not absorbed) and
    ``founder [B, H, T]`` bool (the token created its row: weight 1, radius ``||v||``).
    ``impl``: ``"loop"``, the chunk loop below; ``"static"``, the same routes from a compiled
    static-shape chunk step (:func:`~recurrences.kvm.routing_static.route_kvm_static`; on CUDA the
    whole run replayed from one CUDA graph); ``"auto"`` (default): ``"static"`` on CUDA, ``"loop"``
    elsewhere (:func:`~recurrences.compiling.resolve_routing`).

    An opaque custom op: ``torch.compile`` keeps it as one call, run eagerly without grad. It takes the
    schedule, not the list of sizes, and computes the sizes inside from the length of ``kbar``, so a
    graph compiled with a symbolic length holds for every length.
    """
    resolve_routing(impl, kbar.device)  # checks impl here, where the error names the caller's argument
    check_sink_len(sink_len, schedule.chunk_size)
    return _route_op(kbar.detach(), gate.detach(), ln_weight.detach(), ln_bias.detach(), *schedule.args(), sink_len,
                     ln_eps, impl)


@torch.library.custom_op("ovqflex::route_kvm", mutates_args=())
def _route_op(kbar: Tensor, gate: Tensor, ln_weight: Tensor, ln_bias: Tensor, chunk_size: int, n_bswa_chunks: int,
              budget: str, state_min_len: int | None, growth_factor: float, growth_exponent: float, round_down: int,
              saturation_n: int, max_state_chunks: int | None, sink_len: int, ln_eps: float,
              impl: str) -> tuple[Tensor, Tensor]:
    budget_args = (budget, state_min_len, growth_factor, growth_exponent, round_down, saturation_n, max_state_chunks)
    sizes = KVMSchedule(chunk_size, n_bswa_chunks, KVMBudget(*budget_args)).sizes(-(-kbar.shape[2] // chunk_size))
    if resolve_routing(impl, kbar.device) == "static":
        from .routing_static import route_kvm_static  # routing_static builds on this module

        return route_kvm_static(kbar, gate, ln_weight, ln_bias, chunk_size=chunk_size, n_bswa_chunks=n_bswa_chunks,
                                sizes=sizes, sink_len=sink_len, ln_eps=ln_eps)
    with torch.no_grad():
        return _route(kbar, gate, ln_weight, ln_bias, chunk_size, n_bswa_chunks, sizes, sink_len, ln_eps)


@_route_op.register_fake
def _(kbar, gate, ln_weight, ln_bias, chunk_size, n_bswa_chunks, *budget_sink_eps_impl):
    return kbar.new_empty(kbar.shape[:3], dtype=torch.long), kbar.new_empty(kbar.shape[:3], dtype=torch.bool)


def kvm_route_chunk(state: Tensor, m: int, n_app: int, ok: Tensor, og: Tensor, ln_weight: Tensor,
                    ln_bias: Tensor, sink_len: int, ln_eps: float) -> tuple[Tensor, Tensor]:
    """Routes of one overflow chunk against the routing state (fp32 row sums ``[B, H, S, D]``,
    ``m`` live rows): ``ok [B, H, C, D]`` fp32 memory keys, ``og [B, H, C]`` gates; ``n_app``
    tokens found rows ``m..m+n_app-1``. Returns ``target [B, H, C]`` and ``appended [B, H, C]``
    bool. Reads the state only; :func:`kvm_absorb` writes the chunk in. No grad (a decode step with
    gradients on passes ``LN_s`` parameters that require them)."""
    with no_autocast(ok), torch.no_grad():
        return _route_chunk(state, m, n_app, ok, og, ln_weight, ln_bias, sink_len, ln_eps)


def _route_chunk(state, m, n_app, ok, og, ln_weight, ln_bias, sink_len, ln_eps):
    B, H, C, D = ok.shape
    appended = torch.zeros(B, H, C, dtype=torch.bool, device=ok.device)
    sim = ok @ F.layer_norm(state[:, :, :m], (D,), ln_weight, ln_bias, ln_eps).transpose(-1, -2)  # [B, H, C, m]
    # merge logits over the m + n_app rows after the append: the gate times the products
    logits = sim.new_empty(B, H, C, m + n_app)
    torch.mul(og[..., None], sim, out=logits[..., :m])
    if n_app > 0:
        chosen = torch.sort(sim.amax(-1), dim=-1, stable=True).indices[..., :n_app].sort(dim=-1).values
        appended.scatter_(2, chosen, True)
        # the founders' new rows are LN_s of their keys: every token's key against every token's row
        # ([C, C], the static step's product), the founders' columns taken
        own = ok @ F.layer_norm(ok, (D,), ln_weight, ln_bias, ln_eps).transpose(-1, -2)   # [B, H, C, C]
        torch.mul(og[..., None], own.gather(3, chosen[:, :, None].expand(B, H, C, n_app)), out=logits[..., m:])
    logits[..., :sink_len] = float("-inf")
    target = logits.argmax(-1)  # [B, H, C]
    if n_app > 0:
        target = target.scatter(2, chosen, m + torch.arange(n_app, device=ok.device).expand(B, H, n_app))
    return target, appended


def kvm_absorb(state: Tensor, ok: Tensor, og: Tensor, target: Tensor, appended: Tensor, n_app: int) -> None:
    """Write a routed chunk into the routing state in place: founders (``appended``, in
    temporal order, ``n_app`` per head) fill their fresh rows, the others add ``g * kbar`` to their target. The
    one write both routing and decode caches use, so a cache rebuilt from routes holds bit
    for bit the state routing saw."""
    B, H, C, D = ok.shape
    if n_app > 0:
        founders = torch.sort((~appended).to(torch.uint8), dim=-1, stable=True).indices[..., :n_app]
        state.scatter_(2, target.gather(2, founders)[..., None].expand(B, H, n_app, D),
                       ok.gather(2, founders[..., None].expand(B, H, n_app, D)))
    kvm_merge_add(state, ok, og, target, appended)


def kvm_merge_add(state: Tensor, ok: Tensor, og: Tensor, target: Tensor, appended: Tensor) -> None:
    """The merge half of :func:`kvm_absorb`, after the founders' rows are written: every token of
    the chunk (``ok [B, H, C, D]``) adds ``g * kbar`` to its target row of ``state [B, H, S, D]``,
    a founder ``0 * kbar`` (in token order, so the sums round as the loop's)."""
    state.scatter_add_(2, target[..., None].expand(*target.shape, ok.shape[-1]), merge_keys(ok, og, appended))


def merge_keys(ok: Tensor, og: Tensor, appended: Tensor) -> Tensor:
    """What each token of a chunk adds to its target row in the merge: ``g * kbar``, a founder
    ``0 * kbar`` (``ok [B, H, C, D]``, ``og``/``appended [B, H, C]`` -> ``[B, H, C, D]``)."""
    return torch.where(appended, 0.0, og)[..., None] * ok


def found_first_chunk(state: Tensor, routes: Tensor, founder: Tensor, kf: Tensor, chunk_size: int) -> None:
    """The initial state in place: the ``C = chunk_size`` tokens of chunk 0 (``kf [B, H, T, D]``
    fp32) found rows ``0..C-1`` of ``state [B, H, S, D]`` (routes ``[B, H, T]``, founder ``[B, H, T]``)."""
    C = chunk_size
    state[:, :, :C] = kf[:, :, :C]
    routes[:, :, :C] = torch.arange(C, device=kf.device)
    founder[:, :, :C] = True


def _route(kbar, gate, ln_weight, ln_bias, chunk_size, n_bswa, sizes, sink_len, ln_eps):
    B, H, T, D = kbar.shape
    C, dev = chunk_size, kbar.device
    routes = torch.full((B, H, T), -1, dtype=torch.long, device=dev)
    founder = torch.zeros((B, H, T), dtype=torch.bool, device=dev)
    if max(sizes, default=0) == 0:
        return routes, founder
    kf, gf = kbar.float(), gate.float()
    w, b = ln_weight.float(), ln_bias.float()
    state = kf.new_zeros(B, H, max(sizes), D)  # fp32 row sums of (gated) memory keys
    found_first_chunk(state, routes, founder, kf, C)
    for c in range(n_bswa + 1, len(sizes)):
        u, m = c - n_bswa, sizes[c - 1]
        ok, og = kf[:, :, u * C:(u + 1) * C], gf[:, :, u * C:(u + 1) * C]  # [B, H, C, D], [B, H, C]
        target, appended = kvm_route_chunk(state, m, sizes[c] - m, ok, og, w, b, sink_len, ln_eps)
        kvm_absorb(state, ok, og, target, appended, sizes[c] - m)
        routes[:, :, u * C:(u + 1) * C] = target
        founder[:, :, u * C:(u + 1) * C] = appended
    return routes, founder
