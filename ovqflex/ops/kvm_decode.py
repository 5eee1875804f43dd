"""KVM's decode path (docs/design.md §4.3, §6): the :class:`~ovqflex.cache.KVMCache` after a prefill,
and decode steps from it.

The prefill rebuilds the routing state by replaying the op's routes through the same write routing
uses (:func:`recurrences.kvm.kvm_absorb`). When a query chunk ``c >= Nb`` starts, the oldest window
chunk (``c - Nb``) is absorbed into the state (chunk 0 founds the initial rows) and dropped; a query
then reads the state and its window causally, as the full forward does.

The static form (:class:`~ovqflex.cache.kvm.StaticKVMCache`, docs/design.md §6 "Static decode"): a
step (:func:`kvm_decode_static`) writes the token into the window ring and reads every state row,
the dead ones masked; when a query chunk ``c >= Nb`` is next, :func:`kvm_static_boundary` (called by
the host) absorbs chunk ``c - Nb`` from the ring in place: the initial state (``c = Nb``, once) with
the same :func:`_absorb`, every later chunk with the static routing step
(:func:`recurrences.kvm.routing_static.kvm_static_step`: fixed shapes, the ring's slots and the
state sizes looked up on the device, no host sync).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from masks.regions import BlockWindow, token_visibility
from recurrences.kvm import kvm_absorb, kvm_route_chunk
from recurrences.kvm.routing_static import compiled_static_step, kvm_static_step
from recurrences.kvm.state import readout_rows
from recurrences.precision import no_autocast

from ..attention import attend_rows
from ..cache.base import current_view, kept, tensor_key
from ..cache.kvm import KVMCache, StaticKVMCache
from .decode import chunk_segments, positions, slot_positions, slot_visibility, slotted
from .kvm import KVMOptions


class KVMReadout(NamedTuple):
    """The layer's state-readout parameters (the op's keyword tensors of the same names): ``LN_s``
    ``ln_s_weight``, ``ln_s_bias`` ``[D]``; temperatures ``tau_state``, ``tau_bswa`` ``[H]`` (None: 1)."""

    ln_s_weight: Tensor
    ln_s_bias: Tensor
    tau_state: Tensor | None
    tau_bswa: Tensor | None


def _size(opts: KVMOptions, c: int) -> int:
    """State rows query chunk ``c`` reads."""
    return opts.schedule.size(c)


def _capacity(opts: KVMOptions, rows: int) -> int:
    """Rows to allocate for a state of ``rows`` rows: the cap at once when the budget is capped (a cap is at
    least one chunk: :class:`~recurrences.kvm.budget.KVMBudget` refuses less)."""
    cap = opts.max_state_chunks
    return rows if cap is None else max(rows, opts.chunk_size * cap)


def _grow(cache_rows: dict, need: int) -> dict:
    """Pad the state tensors (dim 2) with empty rows up to ``need``."""
    have = cache_rows["state"].shape[2]
    if need <= have:
        return cache_rows
    pad = need - have
    return {name: F.pad(t, (0, 0, 0, pad) if t.dim() == 4 else (0, pad)) for name, t in cache_rows.items()}


def _absorb(st: dict, c: int, opts: KVMOptions, readout: KVMReadout, ok: Tensor, og: Tensor, vc: Tensor,
            target: Tensor | None = None, appended: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """State for query chunk ``c`` from the one before: chunk ``c - Nb`` (keys ``ok``, gates
    ``og``, values ``vc``, all fp32 ``[B, H, C, *]``) is absorbed in place. ``target``/``appended``
    given (a prefill replay) skip the routing decision."""
    B, H, C, D = ok.shape
    if c == opts.n_bswa_chunks:  # the initial state: one founder row per token of chunk 0
        target = torch.arange(C, device=ok.device).expand(B, H, C)
        appended = torch.ones(B, H, C, dtype=torch.bool, device=ok.device)
        st["state"][:, :, :C] = ok
    else:
        m, n_app = _size(opts, c - 1), _size(opts, c) - _size(opts, c - 1)
        if target is None:
            target, appended = kvm_route_chunk(st["state"], m, n_app, ok, og, readout.ln_s_weight.float(),
                                               readout.ln_s_bias.float(), opts.sink_len, opts.ln_eps)
        kvm_absorb(st["state"], ok, og, target, appended, n_app)
    _absorb_values(st, og, vc, target, appended)
    return target, appended


def _absorb_values(st: dict, og: Tensor, vc: Tensor, target: Tensor, appended: Tensor) -> None:
    """The rest of an absorb once the routing state holds the chunk: values ``vc [B, H, C, Dv]`` (a
    founder's with weight 1, the others' with their gate ``og [B, H, C]``), founder radii and counts."""
    weight = torch.where(appended, 1.0, og)
    st["value_sums"].scatter_add_(2, target[..., None].expand(*target.shape, vc.shape[-1]), weight[..., None] * vc)
    st["radius"].scatter_add_(2, target, torch.linalg.vector_norm(vc, dim=-1) * appended)
    st["counts"].scatter_add_(2, target, torch.ones_like(weight))


def _state_rows(st: dict, rows: int, opts: KVMOptions, readout: KVMReadout) -> tuple[Tensor, Tensor]:
    """What queries read from the first ``rows`` state rows: keys ``LN_s(state) * tau_state``
    ``[B, H, rows, D]`` and values ``[B, H, rows, Dv]`` (``radius``-scaled directions with
    ``use_vlens``, else means), fp32."""
    rho = st["radius"][:, :, :rows] if opts.use_vlens else None
    tau = None if readout.tau_state is None else readout.tau_state.float()
    return readout_rows(st["state"][:, :, :rows], st["value_sums"][:, :, :rows], st["counts"][:, :, :rows],
                        rho, torch.float32, readout.ln_s_weight.float(), readout.ln_s_bias.float(), opts.ln_eps, tau)


def _window_keys(win_k: Tensor, readout: KVMReadout) -> Tensor:
    """Window keys ``[B, H, w, D]`` as scored: times ``tau_bswa``."""
    tau = readout.tau_bswa
    return win_k if tau is None else win_k * tau.view(1, -1, 1, 1).to(win_k.dtype)


def _empty_state(B: int, H: int, D: int, Dv: int, device) -> dict:
    return dict(state=torch.zeros(B, H, 0, D, device=device), value_sums=torch.zeros(B, H, 0, Dv, device=device),
                radius=torch.zeros(B, H, 0, device=device), counts=torch.zeros(B, H, 0, device=device))


def kvm_prefill(k: Tensor, v: Tensor, kbar32: Tensor, gate: Tensor, routes: Tensor, founder: Tensor,
                opts: KVMOptions, readout: KVMReadout, conv: Tensor | None) -> KVMCache:
    """The cache after a full forward over k (normalized, rotated), v, kbar32 (fp32 memory
    keys), gate ``[B, H, T]`` with the op's routes/founder ``[B, H, T]``, replayed."""
    B, H, T, D = k.shape
    C, Nb = opts.chunk_size, opts.n_bswa_chunks
    last = (T - 1) // C  # the last query chunk of the prefill
    st = _empty_state(B, H, D, v.shape[-1], k.device)
    vf, gf = v.detach().float(), gate.detach().float()
    for c in range(Nb, last + 1):
        st = _grow(st, _capacity(opts, _size(opts, c)))
        sl = slice((c - Nb) * C, (c - Nb + 1) * C)
        _absorb(st, c, opts, readout, kbar32[:, :, sl], gf[:, :, sl], vf[:, :, sl], routes[:, :, sl], founder[:, :, sl])
    start = max(0, (last - Nb + 1) * C)
    return KVMCache(position=T, conv=conv, rows=_size(opts, last) if last >= Nb else 0, state_chunk=last,
                    win_k=k.detach()[:, :, start:], win_v=v.detach()[:, :, start:], win_kbar=kbar32[:, :, start:],
                    win_gate=gf[:, :, start:], **st)


def kvm_decode(cache: KVMCache, q: Tensor, k: Tensor, v: Tensor, kbar32: Tensor, gate: Tensor,
               opts: KVMOptions, readout: KVMReadout, conv: Tensor | None) -> tuple[Tensor, KVMCache]:
    """New tokens' q, k (normalized, rotated), v, fp32 memory keys and gates -> outputs
    ``[B, H, T2, Dv]`` and the cache after them."""
    B, H, T2, D = q.shape
    C, Nb = opts.chunk_size, opts.n_bswa_chunks
    st = {name: getattr(cache, name) for name in ("state", "value_sums", "radius", "counts")}
    copied = False  # the given cache stays valid: copy the state before the first write of this call
    win = dict(k=cache.win_k, v=cache.win_v, kbar=cache.win_kbar, gate=cache.win_gate)
    rows, state_chunk, pos, outs, view = cache.rows, cache.state_chunk, cache.position, [], cache.view
    window = (BlockWindow(Nb, C),)
    for off, take in chunk_segments(pos, T2, C):
        c = pos // C
        if c > state_chunk and c >= Nb:  # a new query chunk: absorb the oldest window chunk
            st = _grow(st, _capacity(opts, _size(opts, c)))
            if not copied:
                st, copied = {name: t.clone() for name, t in st.items()}, True
            _absorb(st, c, opts, readout, win["kbar"][:, :, :C], win["gate"][:, :, :C], win["v"][:, :, :C].float())
            win = {name: t[:, :, C:] for name, t in win.items()}
            rows, view = _size(opts, c), None
        state_chunk = c
        new = dict(k=k, v=v, kbar=kbar32, gate=gate.float())
        win = {name: torch.cat([win[name], new[name][:, :, off:off + take].detach()], dim=2) for name in win}
        w = win["k"].shape[2]
        q_pos, kv_pos = positions(pos, take, q.device), positions(pos + take - w, w, q.device)
        visible = token_visibility(window, q_pos, kv_pos)
        keys, values = [_window_keys(win["k"], readout).float()], [win["v"].float()]
        if rows:
            with_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in readout)
            key = (rows, opts.use_vlens, opts.ln_eps, with_grad, *map(tensor_key, readout))
            view = current_view(view, key, lambda: (*_state_rows(st, rows, opts, readout), None))
            keys, values = [view.keys, *keys], [view.values, *values]
            visible = torch.cat([torch.ones(take, rows, dtype=torch.bool, device=q.device), visible], dim=1)
        outs.append(attend_rows(q[:, :, off:off + take], keys, values, visible, scale=D ** -0.5))
        pos += take
    new_cache = KVMCache(position=pos, conv=conv, rows=rows, state_chunk=state_chunk, win_k=win["k"],
                         win_v=win["v"], win_kbar=win["kbar"], win_gate=win["gate"], **st, view=kept(view))
    return torch.cat(outs, dim=2).to(v.dtype), new_cache


_STATE = ("state", "value_sums", "radius", "counts")
_WINDOW = ("win_k", "win_v", "win_kbar", "win_gate")


def kvm_static(cache: KVMCache, opts: KVMOptions, readout: KVMReadout, capacity: int) -> StaticKVMCache:
    """The static cache continuing ``cache`` (not changed) for sequences of at most ``capacity``
    tokens (state rows: the most any chunk reads, plus the static routing step's spare); if the next
    token starts a query chunk ``>= Nb``, its absorb is done here."""
    C, Nb = opts.chunk_size, opts.n_bswa_chunks
    W, n_chunks = Nb * C, -(-capacity // C)
    sizes = opts.schedule.sizes(n_chunks)
    # new tensors: the spare row makes them a row longer than any functional cache's, so _grow always pads
    st = _grow({name: getattr(cache, name) for name in _STATE}, _capacity(opts, max(sizes)) + 1)
    w = cache.win_k.shape[2]
    pos = positions(cache.position - w, w, cache.win_k.device)
    ring = {name: slotted(getattr(cache, name), W, pos % W) for name in _WINDOW}
    static = StaticKVMCache(position=torch.tensor(cache.position, device=pos.device),
                            conv=None if cache.conv is None else cache.conv.clone(),
                            rows=torch.tensor(sizes, device=pos.device), **st, **ring,
                            win_pos=slot_positions(pos, W, pos % W))
    kvm_static_boundary(static, opts, readout, cache.position)
    return static


def kvm_decode_static(cache: StaticKVMCache, q: Tensor, k: Tensor, v: Tensor, kbar32: Tensor, gate: Tensor,
                      opts: KVMOptions, readout: KVMReadout, conv: Tensor | None) -> Tensor:
    """One new token's q, k (normalized, rotated), v ``[B, H, 1, *]``, fp32 memory key and gate
    ``[B, H, 1]`` (at ``cache.position``) written into the ring, then reading the live state rows
    and its block window -> ``[B, H, 1, Dv]``. Fixed shapes, no host sync; the caller advances
    ``cache.position`` and calls :func:`kvm_static_boundary`."""
    C, Nb = opts.chunk_size, opts.n_bswa_chunks
    p = cache.position.view(1)
    slot = p % cache.win_pos.shape[0]
    for name, t in zip(_WINDOW, (k, v, kbar32, gate.float())):
        getattr(cache, name).index_copy_(2, slot, t.detach())
    cache.win_pos.index_copy_(0, slot, p)
    cache.write_conv(conv)
    st = {name: getattr(cache, name) for name in _STATE}
    s_keys, s_vals = _state_rows(st, st["state"].shape[2], opts, readout)
    live = torch.arange(s_keys.shape[2], device=p.device) < cache.rows.index_select(0, p // C)
    window = slot_visibility((BlockWindow(Nb, C),), p, cache.win_pos)
    keys = torch.cat([s_keys, _window_keys(cache.win_k, readout).float()], dim=2)
    values = torch.cat([s_vals, cache.win_v.float()], dim=2)
    out = attend_rows(q, keys, values, torch.cat([live, window]), scale=q.shape[-1] ** -0.5)
    return out.to(v.dtype)


def kvm_static_boundary(cache: StaticKVMCache, opts: KVMOptions, readout: KVMReadout, position: int, *,
                        compile: bool = False) -> None:
    """After a static step left ``position`` tokens (``cache.position``, counted on the host): if the next
    token starts a query chunk ``c >= Nb``, absorb window chunk ``c - Nb`` (still whole in the ring) in
    place; nothing once the cache is full (``position`` = its capacity at a chunk end). The initial state
    (``c = Nb``, once) is :func:`_absorb`'s copy; a later chunk is routed by the static step (``compile``:
    its compiled form, one graph for every chunk) on the ring's slots of the chunk and
    ``(rows[c-1], rows[c])``, both looked up from ``cache.position``."""
    C, Nb = opts.chunk_size, opts.n_bswa_chunks
    c = position // C
    if position % C or c < Nb or c >= cache.rows.shape[0]:  # (the last: the cache is full, chunk c never comes)
        return
    st = {name: getattr(cache, name) for name in _STATE}
    if c == Nb:  # chunk 0, in ring slots 0..C-1
        _absorb(st, c, opts, readout, cache.win_kbar[:, :, :C], cache.win_gate[:, :, :C],
                cache.win_v[:, :, :C].float())
        return
    chunk, offsets = cache.position // C, torch.arange(C, device=cache.position.device)  # c as a device scalar
    slots = ((chunk - Nb) * C + offsets) % cache.win_pos.shape[0]                       # [C]
    ok, og = cache.win_kbar.index_select(2, slots), cache.win_gate.index_select(2, slots)
    bounds = cache.rows.index_select(0, chunk - 1 + offsets[:2])                         # (rows[c-1], rows[c])
    step = compiled_static_step if compile else kvm_static_step
    with no_autocast(ok):  # as routing: the caller's autocast would multiply the fp32 keys and rows in bf16
        target, appended = step(ok, og, st["state"], bounds, readout.ln_s_weight.detach().float(),
                                readout.ln_s_bias.detach().float(), sink_len=opts.sink_len, ln_eps=opts.ln_eps)
    _absorb_values(st, og, cache.win_v.index_select(2, slots).float(), target, appended)
