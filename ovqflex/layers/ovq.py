"""``OVQAttention``: the OVQ-attention layer (docs/design.md §4.2). NoPE; per-head learned ``beta``."""
from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor, nn

from masks.program import AttentionProgram, scaled_unit_queries
from recurrences.checks import options_of
from recurrences.precision import routing_keys, to_compute_dtype

from ..cache.ovq import OVQCache, StaticOVQCache
from ..ops.ovq import OVQOptions, ovq_attention, ovq_program
from ..ops.ovq_decode import ovq_decode, ovq_decode_static, ovq_prefill, ovq_static, ovq_static_boundary
from ..profiling import stage
from .heads import MultiHeadProjection
from .options import OptionAttributes


class OVQAttention(OptionAttributes, MultiHeadProjection):
    """x ``[B, T, hidden]`` -> ``[B, T, hidden]``.

    Options: an :class:`~ovqflex.ops.ovq.OVQOptions` (``options=``), or its fields as keywords
    (``chunk_size``, ``max_centroids``, ``growth``, ``growth_horizon``, ``seeding``, ``seed``,
    ``normalize_centroids``, ``state_layout``, ``checkpoint_every``, ``block_size``, ``routing``); each reads and
    sets as an attribute. ``max_centroids`` is the training dictionary cap; it may be raised at
    inference (the paper trains N=2k and tests up to 20k) by setting ``layer.max_centroids`` or
    passing ``forward(x, max_centroids=...)`` — no parameter depends on it.
    """

    cache_type = OVQCache  # forward(x, cache=None, use_cache=False): docs/design.md §6
    static_cache_type = StaticOVQCache
    options_type = OVQOptions
    call_options = ("max_centroids",)

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None = None, qk_conv: int = 0,
                 backend: str = "auto", options: OVQOptions | None = None, **option_kwargs):
        super().__init__(hidden_size, num_heads, head_dim, backend, qk_conv)
        self.options = options_of(OVQOptions, options, option_kwargs, "OVQ options")
        self.beta = nn.Parameter(torch.full((num_heads,), math.sqrt(self.head_dim)))

    def _options(self, max_centroids: int | None) -> OVQOptions:
        """The options of one call: ``max_centroids`` (None: the layer's) overrides the cap."""
        return self.options if max_centroids is None else replace(self.options, max_centroids=max_centroids)

    def program(self, x: Tensor, *, max_centroids: int | None = None) -> AttentionProgram:
        """The layer's attention program for x ``[B, T, hidden]`` (what the visualizer draws)."""
        with stage("proj"):
            q, k, v = self.split_heads(x)
        return ovq_program(q, k, v, self.beta, options=self._options(max_centroids))[0]

    # forward(x, cache=None, use_cache=False, *, return_aux=False, max_centroids=None): AttentionLayer

    def _full(self, inputs, *, max_centroids: int | None = None) -> tuple[Tensor, dict]:
        q, k, v, _ = inputs
        return ovq_attention(q, k, v, self.beta, backend=self.backend, options=self._options(max_centroids)), {}

    def _prefill(self, inputs, *, max_centroids: int | None = None) -> tuple[Tensor, OVQCache]:
        q, k, v, tail = inputs
        q, k, v = to_compute_dtype(q, k, v)
        options = self._options(max_centroids)
        o, state = ovq_attention(q, k, v, self.beta, backend=self.backend, return_state=True, options=options)
        return o, ovq_prefill(routing_keys(k), v, state.routes, options, tail)

    def _decode_inputs(self, inputs) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """q_scaled ``beta * q̂``, the fp32 unit keys the op routes on (the cache routes and attends
        on them), v ``[B, H, T, *]`` and the conv tail."""
        q, k, v, tail = inputs
        q, k, v = to_compute_dtype(q, k, v)
        return scaled_unit_queries(q, self.beta), routing_keys(k), v, tail

    def _decode_step(self, inputs, cache: OVQCache, *, max_centroids: int | None = None) -> tuple[Tensor, OVQCache]:
        q_scaled, kn, v, tail = self._decode_inputs(inputs)
        return ovq_decode(cache, q_scaled, kn, v, self._options(max_centroids), tail)

    def _static_cache(self, cache: OVQCache, capacity: int) -> StaticOVQCache:
        return ovq_static(cache, self.options, capacity)

    def _decode_static(self, inputs, cache: StaticOVQCache, *, max_centroids: int | None = None) -> Tensor:
        q_scaled, kn, v, tail = self._decode_inputs(inputs)
        return ovq_decode_static(cache, q_scaled, kn, v, self._options(max_centroids), tail)

    def _static_boundary(self, cache: StaticOVQCache, position: int, *, compile: bool = False) -> None:
        """At a chunk end, route and absorb the chunk in place (:func:`~ovqflex.ops.ovq_decode.ovq_static_boundary`)."""
        ovq_static_boundary(cache, self.options, position, compile=compile)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"chunk_size={self.chunk_size}, max_centroids={self.max_centroids}, growth={self.growth!r}, "
                f"seeding={self.seeding!r}, state_layout={self.state_layout!r}, backend={self.backend!r}")
