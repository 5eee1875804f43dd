"""What every decode cache shares (docs/design.md §6).

A cache is a small typed object a layer returns from ``forward(x, use_cache=True)``
and takes back with ``forward(x, cache=cache)``: the tokens seen so far
(``position``) and the q/k convolution tail, plus the method's own bounded state
(subclasses). Caches are inference objects: they hold no autograd graph and are
updated by the layer that owns them (a new object per call; the old one is not
mutated, so a prefix cache can be reused for several continuations).

A :class:`StaticLayerCache` is the other kind (docs/design.md §6, "Static decode"): buffers
allocated once at their bound and written in place, the position a device tensor, so one
decode step is a fixed-shape function (compiled once, capturable in a CUDA graph).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor


@dataclass
class LayerCache:
    """``position``: tokens seen; ``conv``: ``[B, 2*H*D, qk_conv-1]`` raw q/k projections of
    the last tokens (None without ``qk_conv``)."""

    position: int
    conv: Tensor | None

    def __post_init__(self):
        # inference objects: whatever produced the tensors, the cache keeps no autograd graph
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor) and value.requires_grad:
                setattr(self, f.name, value.detach())

    def tensors(self) -> list[Tensor]:
        """The cache's tensors: its tensor fields and the tensors of its tuple fields (a
        :class:`StateView`)."""
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            for t in value if isinstance(value, tuple) else (value,):
                if isinstance(t, Tensor):
                    out.append(t)
        return out

    def nbytes(self) -> int:
        """Bytes held by the cache's tensors (its own accounting; the bound each cache
        type documents is on this number)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


class StateView(NamedTuple):
    """What decode queries read from a compressed state — keys ``[B, H, n, D]``, values
    ``[B, H, n, Dv]`` and a score bias ``[B, H, n]`` (or None), fp32 — kept in a functional cache
    while the state does not change (between two absorbed chunks), so that a decode step does not
    re-derive it from the state's running sums (docs/design.md §6). ``key``: what it was derived
    with (rows, options, the versions of the parameters it read); a step whose own key differs
    derives a new one."""

    keys: Tensor
    values: Tensor
    bias: Tensor | None
    key: tuple


def current_view(view: StateView | None, key: tuple, derive) -> StateView:
    """``view`` when it was derived with ``key``, else ``StateView(*derive(), key)``."""
    if view is not None and view.key == key:
        return view
    return StateView(*derive(), key)


def tensor_key(t: Tensor | None) -> tuple | object:
    """A part of a view's key that changes whenever ``t`` (a parameter the view reads) is written:
    its storage, version counter and dtype. Inference tensors keep no version counter: their key
    is a new object each time, so a view that reads one is derived anew at every step."""
    if t is None:
        return None
    if t.is_inference():
        return object()
    return t.data_ptr(), t._version, t.dtype


def kept(view: StateView | None) -> StateView | None:
    """The view a new cache keeps: None for one that carries an autograd graph (a decode step run
    with gradients through parameters the view reads; caches hold no graph)."""
    if view is None or any(isinstance(t, Tensor) and t.requires_grad for t in view):
        return None
    return view


@dataclass
class StaticLayerCache(LayerCache):
    """A decode cache written in place: ``position`` is a 0-d int64 tensor on the cache's
    device (advanced by each step), every buffer keeps its shape for the cache's life. Made
    from a functional cache by ``layer.static_cache(cache, capacity)``; one token per call.
    ``capacity``: the most tokens it holds (set by ``static_cache``; None: unchecked), which
    ``layer.static_boundary`` enforces on the host."""

    position: Tensor
    capacity: int | None = dataclasses.field(default=None, kw_only=True, repr=False)

    def write_conv(self, conv: Tensor | None) -> None:
        """Copy a step's q/k conv tail (None without ``qk_conv``) into the buffer."""
        if conv is not None:
            self.conv.copy_(conv)


def check_cache(cache, kind: type, layer, static_kind: type | None = None) -> None:
    """A cache passed to ``layer`` must be the type that layer returns (or its static cache type)."""
    if cache is None or isinstance(cache, kind) or (static_kind is not None and isinstance(cache, static_kind)):
        return
    raise TypeError(f"cache for {type(layer).__name__} must be a {kind.__name__} (from forward(..., "
                    f"use_cache=True)), got {type(cache).__name__}")
