"""``OVQAttention``: the OVQ-attention layer (docs/design.md §4.2). NoPE; per-head learned ``beta``."""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from masks.program import AttentionProgram
from recurrences.checks import options_of
from recurrences.precision import routing_keys, to_compute_dtype

from ..cache.base import check_cache
from ..cache.ovq import OVQCache
from ..ops.ovq import OVQOptions, ovq_attention, ovq_program
from ..ops.ovq_decode import ovq_decode, ovq_prefill
from ..profiling import stage
from .heads import MultiHeadProjection
from .options import OptionAttributes


class OVQAttention(OptionAttributes, MultiHeadProjection):
    """x ``[B, T, hidden]`` -> ``[B, T, hidden]``.

    Options: an :class:`~ovqflex.ops.ovq.OVQOptions` (``options=``), or its fields as keywords
    (``chunk_size``, ``max_centroids``, ``growth``, ``growth_horizon``, ``seeding``, ``seed``,
    ``normalize_centroids``, ``state_layout``, ``checkpoint_every``, ``block_size``); each reads and
    sets as an attribute. ``max_centroids`` is the training dictionary cap; it may be raised at
    inference (the paper trains N=2k and tests up to 20k) by setting ``layer.max_centroids`` or
    passing ``forward(x, max_centroids=...)`` — no parameter depends on it.
    """

    supports_cache = True  # forward(x, cache=None, use_cache=False): docs/design.md §6
    options_type = OVQOptions

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

    def forward(self, x: Tensor, cache: OVQCache | None = None, use_cache: bool = False, *,
                max_centroids: int | None = None):
        """x ``[B, T, hidden]`` -> y ``[B, T, hidden]``; ``(y, cache)`` with ``use_cache=True`` or
        a ``cache`` (:class:`~ovqflex.cache.OVQCache`) to continue from: prefill any length,
        then decode one or more tokens per call."""
        check_cache(cache, OVQCache, self)
        options = self._options(max_centroids)
        with stage("proj"):
            q, k, v, tail = self.split_heads_cached(x, None if cache is None else cache.conv)
        if cache is None and not use_cache:
            o = ovq_attention(q, k, v, self.beta, backend=self.backend, options=options)
            new_cache = None
        else:
            q, k, v = to_compute_dtype(q, k, v)
            kr = routing_keys(k)  # the cache routes and attends on the fp32 unit keys the op routes on
            if cache is None:
                o, state = ovq_attention(q, k, v, self.beta, backend=self.backend, return_state=True, options=options)
                new_cache = ovq_prefill(kr, v, state.routes, options, tail)
            else:
                qn = F.normalize(q, dim=-1)
                o, new_cache = ovq_decode(cache, qn * self.beta.to(qn.dtype).view(1, -1, 1, 1), kr, v, options, tail)
        with stage("proj"):
            y = self.merge(o)
        return y if new_cache is None else (y, new_cache)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"chunk_size={self.chunk_size}, max_centroids={self.max_centroids}, growth={self.growth!r}, "
                f"seeding={self.seeding!r}, state_layout={self.state_layout!r}, backend={self.backend!r}")
