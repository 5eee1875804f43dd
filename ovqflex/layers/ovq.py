"""``OVQAttention``: the OVQ-attention layer (docs/design.md §4.2). NoPE; per-head learned ``beta``."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from masks.program import DEFAULT_BLOCK, AttentionProgram
from recurrences.checks import check_choice, check_chunk, check_int
from recurrences.ovq import GROWTHS, SEEDINGS
from recurrences.precision import routing_keys, to_compute_dtype
from recurrences.versioned import check_state_layout

from ..cache.base import check_cache
from ..cache.ovq import OVQCache, OVQDecodeOptions, ovq_decode, ovq_prefill
from ..ops.ovq import ovq_attention, ovq_program
from ..profiling import stage
from .heads import MultiHeadProjection


class OVQAttention(MultiHeadProjection):
    """x ``[B, T, hidden]`` -> ``[B, T, hidden]``.

    ``max_centroids`` is the training dictionary cap; it may be raised at inference
    (the paper trains N=2k and tests up to 20k) by setting ``layer.max_centroids`` or
    passing ``forward(x, max_centroids=...)`` — no parameter depends on it.

    ``state_layout`` ("auto" | "snapshot" | "versioned") and ``checkpoint_every``: how the
    dictionaries are laid out as kv rows (:func:`ovqflex.ovq_attention`, docs/design.md §5); same outputs.
    """

    supports_cache = True  # forward(x, cache=None, use_cache=False): docs/design.md §6

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None = None, chunk_size: int = 128,
                 max_centroids: int = 2048, growth: str = "plateau", growth_horizon: int | None = None,
                 seeding: str = "spread", seed: int = 0, normalize_centroids: bool = False,
                 qk_conv: int = 0, backend: str = "auto", state_layout: str = "auto",
                 checkpoint_every: int | None = None, block_size: int = DEFAULT_BLOCK):
        super().__init__(hidden_size, num_heads, head_dim, backend, qk_conv)
        check_chunk("chunk_size", chunk_size)
        check_state_layout(state_layout, checkpoint_every, block_size)
        self.state_layout, self.checkpoint_every = state_layout, checkpoint_every
        check_int("max_centroids", max_centroids)
        check_choice("growth", growth, GROWTHS)
        check_choice("seeding", seeding, SEEDINGS)
        self.chunk_size, self.max_centroids, self.growth, self.growth_horizon = chunk_size, max_centroids, growth, growth_horizon
        self.seeding, self.seed, self.normalize_centroids = seeding, seed, normalize_centroids
        self.block_size = block_size  # checked by check_state_layout
        self.beta = nn.Parameter(torch.full((num_heads,), math.sqrt(self.head_dim)))

    def _options(self, max_centroids: int | None) -> dict:
        return dict(chunk_size=self.chunk_size,
                    max_centroids=self.max_centroids if max_centroids is None else max_centroids,
                    growth=self.growth, growth_horizon=self.growth_horizon, seeding=self.seeding,
                    seed=self.seed, normalize_centroids=self.normalize_centroids, state_layout=self.state_layout,
                    checkpoint_every=self.checkpoint_every, block_size=self.block_size)

    def program(self, x: Tensor, *, max_centroids: int | None = None) -> AttentionProgram:
        """The layer's attention program for x ``[B, T, hidden]`` (what the visualizer draws)."""
        with stage("proj"):
            q, k, v = self.split_heads(x)
        return ovq_program(q, k, v, self.beta, **self._options(max_centroids))[0]

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
            o = ovq_attention(q, k, v, self.beta, backend=self.backend, **options)
            new_cache = None
        else:
            opts = OVQDecodeOptions(**{f: options[f] for f in OVQDecodeOptions.__dataclass_fields__})
            q, k, v = to_compute_dtype(q, k, v)
            kr = routing_keys(k)  # the cache routes and attends on the fp32 unit keys the op routes on
            if cache is None:
                o, state = ovq_attention(q, k, v, self.beta, backend=self.backend, return_state=True, **options)
                new_cache = ovq_prefill(kr, v, state.routes, opts, tail)
            else:
                qn = F.normalize(q, dim=-1)
                o, new_cache = ovq_decode(cache, qn * self.beta.to(qn.dtype).view(1, -1, 1, 1), kr, v, opts, tail)
        with stage("proj"):
            y = self.merge(o)
        return y if new_cache is None else (y, new_cache)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"chunk_size={self.chunk_size}, max_centroids={self.max_centroids}, growth={self.growth!r}, "
                f"seeding={self.seeding!r}, state_layout={self.state_layout!r}, backend={self.backend!r}")
