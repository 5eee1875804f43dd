"""``AttentionLayer``: the one layer contract and forward template (docs/design.md §2, §6).

Every sequence layer — the softmax layers, the recurrences, the LongVQ block, a plugged-in method —
derives from :class:`AttentionLayer` and maps x ``[B, T, hidden]`` to y ``[B, T, hidden]``. Its
:meth:`~AttentionLayer.forward` owns the fork between a full forward, a prefill and a decode step,
once; the return type depends only on the arguments, never on the layer:

- ``layer(x)`` -> y;
- ``layer(x, return_aux=True)`` -> ``(y, aux)``: ``aux`` a dict, ``{}`` for layers without an
  auxiliary loss, else ``aux["loss"]`` a 0-d tensor (VQ's commitment loss) and detached metrics;
- ``layer(x, use_cache=True)`` (prefill) or ``layer(x, cache=cache)`` (decode) -> ``(y, cache)``:
  a new cache of the layer's ``cache_type``; the given one is never mutated;
- ``layer(x, cache=static)`` with a :class:`~ovqflex.cache.base.StaticLayerCache` from
  ``layer.static_cache(cache, capacity)`` (x ``[B, 1, hidden]``, one token) -> ``(y, static)``:
  the same cache, written in place, so the step has fixed shapes (docs/design.md §6, "Static decode").

A layer implements hooks; ``inputs`` is whatever its ``_project`` returns (q, k, v ``[B, H, T, D]``,
the q/k conv tail, gates …) and is passed on unchanged:

- ``_project(x, cache, use_cache)``: the projections of x, continuing after ``cache`` (None: a
  sequence start); ``use_cache``: a cache is returned (prefill or decode);
- ``_full(inputs, **call)`` -> ``(o, aux)``: the fused op (training and plain inference);
- ``_prefill(inputs, **call)`` -> ``(o, cache)``: the fused op plus the cache after it;
- ``_decode_step(inputs, cache, **call)`` -> ``(o, cache)``: new tokens from a cache;
- ``_output(o, inputs)`` -> y ``[B, T, hidden]``: the output projection;
- with a ``static_cache_type``: ``_static_cache(cache, capacity)`` -> the static cache of a
  functional one, ``_decode_static(inputs, static, **call)`` -> o ``[B, H, 1, Dv]`` (writes the
  token into ``static``; the template then advances its position) and, optionally,
  ``_static_boundary(static, position)`` (host-side work at some positions, e.g. OVQ's chunk end),
  which the public :meth:`~AttentionLayer.static_boundary` runs after checking the capacity.

``cache_type`` (None: no decode cache) sets ``supports_cache``; ``call_options`` names the keyword
options a call may give (OVQ's ``max_centroids``), passed to the op hooks; ``overrides`` the attributes
a test-time override may set (``ovqflex eval --override``, :meth:`ovqflex.models.HybridLM.set_overrides`).
"""
from __future__ import annotations

import dataclasses
import types
from typing import ClassVar

from torch import Tensor, nn

from recurrences.checks import check_choice, check_int
from recurrences.compiling import prepare_compile

from ..attention import BACKENDS
from ..cache.base import LayerCache, StaticLayerCache, check_cache


class AttentionLayer(nn.Module):
    """Base of every layer: x ``[B, T, hidden]`` -> y ``[B, T, hidden]`` (see the module doc)."""

    cache_type: ClassVar[type[LayerCache] | None] = None
    static_cache_type: ClassVar[type[StaticLayerCache] | None] = None  # None: no in-place decode path
    supports_cache: ClassVar[bool] = False  # set from cache_type by __init_subclass__
    call_options: ClassVar[tuple[str, ...]] = ()
    #: the attributes a test-time override may set: each is read at every call and checked when set, and
    #: no parameter depends on it (an attribute read only when the layer is built would change nothing);
    #: every layer that runs an attention program takes its ``backend`` (:attr:`backend`)
    overrides: ClassVar[tuple[str, ...]] = ("backend",)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.supports_cache = cls.cache_type is not None
        if "forward" not in cls.__dict__:
            cls.forward = _forward_of(cls)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A layer is made to be compiled, alone or in a model (recurrences.compiling.prepare_compile):
        # each structure (pattern, options, dtype) is a graph of the same forward code, and past
        # dynamo's default 8 a process that builds many (an experiment, a sweep, the cuda tier)
        # would fall back to eager silently; inductor's CPU scatter-add is mended at the first compile.
        prepare_compile()

    @property
    def backend(self) -> str | None:
        """The attention backend, one of :data:`ovqflex.attention.BACKENDS` (None: a layer that runs no
        attention program, the linear recurrences); checked when set."""
        return self._backend

    @backend.setter
    def backend(self, value: str | None) -> None:
        self._backend = value if value is None else check_choice("backend", value, BACKENDS)

    def forward(self, x: Tensor, cache: LayerCache | None = None, use_cache: bool = False, *,
                return_aux: bool = False, **call):
        """x ``[B, T, hidden]`` -> y ``[B, T, hidden]``; ``(y, aux)`` with ``return_aux=True``;
        ``(y, cache)`` with ``use_cache=True`` (prefill) or a ``cache`` to continue from (decode
        one or more tokens; no tokens give an empty y and an unchanged copy of the cache); with a
        static cache, one token x ``[B, 1, hidden]`` and ``(y, the same cache, written in place)``."""
        unknown = sorted(set(call) - set(self.call_options))
        if unknown:
            raise TypeError(f"{type(self).__name__}.forward got unknown option(s) {unknown}; it takes "
                            f"{list(self.call_options) or 'none'}")
        cached = cache is not None or use_cache
        if cached and self.cache_type is None:
            raise NotImplementedError(f"{type(self).__name__} has no decode cache (cache_type is None): "
                                      "use_cache and cache need a layer with supports_cache=True")
        if cached and return_aux:
            raise ValueError("return_aux is for full (training) forwards; a cached (inference) forward "
                             "has no aux loss: give return_aux=False")
        check_cache(cache, self.cache_type, self, self.static_cache_type)
        if isinstance(cache, StaticLayerCache):
            if x.shape[1] != 1:
                raise ValueError(f"a static cache decodes one token per call: x must be [B, 1, hidden], got "
                                 f"{list(x.shape)}")
            inputs = self._project(x, cache, True)
            o = self._decode_static(inputs, cache, **call)
            cache.position.add_(1)
            return self._output(o, inputs), cache
        if cache is not None and x.shape[1] == 0:
            self.check_input(x)
            return x.new_zeros(x.shape[0], 0, self.hidden_size), dataclasses.replace(cache)
        inputs = self._project(x, cache, cached)
        if not cached:
            o, aux = self._full(inputs, **call)
            y = self._output(o, inputs)
            return (y, aux) if return_aux else y
        o, new_cache = self._prefill(inputs, **call) if cache is None else self._decode_step(inputs, cache, **call)
        return self._output(o, inputs), new_cache

    def static_cache(self, cache: LayerCache, capacity: int) -> StaticLayerCache:
        """The in-place (static) cache continuing ``cache`` (a functional cache of this layer, which
        stays valid): buffers allocated once for a sequence of at most ``capacity`` tokens."""
        if self.static_cache_type is None:
            raise NotImplementedError(f"{type(self).__name__} has no static (in-place) decode cache "
                                      "(static_cache_type is None): use the functional cache")
        check_cache(cache, self.cache_type, self)
        if cache is None:
            raise ValueError("cache must be a prefill's cache (forward(x, use_cache=True)), got None")
        check_int("capacity", capacity)
        if capacity <= cache.position:
            raise ValueError(f"capacity={capacity} must exceed the cache's position {cache.position} "
                             "(room for at least one more token)")
        static = self._static_cache(cache, capacity)
        static.capacity = capacity
        return static

    def static_boundary(self, cache: StaticLayerCache, position: int, *, compile: bool = False) -> None:
        """Host-side work after a static decode step left ``position`` tokens in ``cache`` (the
        caller counts them, so nothing is read back from the device; every caller of a static step
        calls this after it); ``compile``: run it compiled where it has a compiled form.

        Refuses a ``position`` past the cache's capacity: the step that passed it found no room (full
        attention's slots are a ring of ``capacity`` tokens: it overwrote the oldest one), so its output
        is wrong; nothing on the device checks, which would cost a host sync at every step."""
        if cache.capacity is not None and position > cache.capacity:
            raise ValueError(f"a static decode cache of capacity {cache.capacity} was stepped to position "
                             f"{position}: the last step had no room and its output is wrong; make the cache "
                             f"with a larger capacity (layer.static_cache(cache, capacity))")
        self._static_boundary(cache, position, compile=compile)

    def _static_boundary(self, cache: StaticLayerCache, position: int, *, compile: bool = False) -> None:
        """The layer's host-side work of :meth:`static_boundary` (the capacity checked). Default: none."""

    # --- hooks -----------------------------------------------------------------------------------

    def check_input(self, x: Tensor) -> None:
        """Refuse an x that is not ``[B, T, hidden]`` in the layer's dtype."""
        raise NotImplementedError

    def _project(self, x: Tensor, cache: LayerCache | None, use_cache: bool):
        raise NotImplementedError

    def _full(self, inputs, **call) -> tuple[Tensor, dict]:
        raise NotImplementedError

    def _prefill(self, inputs, **call) -> tuple[Tensor, LayerCache]:
        raise NotImplementedError

    def _decode_step(self, inputs, cache: LayerCache, **call) -> tuple[Tensor, LayerCache]:
        raise NotImplementedError

    def _output(self, o: Tensor, inputs) -> Tensor:
        raise NotImplementedError

    def _static_cache(self, cache: LayerCache, capacity: int) -> StaticLayerCache:
        raise NotImplementedError

    def _decode_static(self, inputs, cache: StaticLayerCache, **call) -> Tensor:
        raise NotImplementedError


def _forward_of(cls: type) -> types.FunctionType:
    """``AttentionLayer.forward`` with a code object of ``cls``'s own (named ``<cls>.forward``).
    torch.compile (dynamo) keeps its frame state — automatic dynamic shapes, the recompile limit —
    per code object; one shared template would let compiling one layer class with a second shape
    make every other class's shapes dynamic."""
    template = AttentionLayer.forward
    code = template.__code__.replace(co_name=f"{cls.__name__}.forward", co_qualname=f"{cls.__qualname__}.forward")
    forward = types.FunctionType(code, template.__globals__, "forward", template.__defaults__, template.__closure__)
    forward.__kwdefaults__, forward.__doc__ = template.__kwdefaults__, template.__doc__
    forward.__qualname__, forward.__module__ = f"{cls.__qualname__}.forward", cls.__module__
    forward.__annotations__ = template.__annotations__
    return forward
