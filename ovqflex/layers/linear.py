"""Non-softmax recurrent layers (docs/design.md §4.6): ``forward(x [B, T, hidden]) -> [B, T, hidden]``.

Like every attention layer they decode from a cache (docs/design.md §6): ``forward(x, use_cache=True)``
returns ``(y, cache)`` after a prefill of any length and ``forward(x, cache=cache)`` continues;
the caches (``ovqflex.cache.recurrent``) hold the recurrence's state, constant in size. Their
static forms (``layer.static_cache(cache, capacity)``, docs/design.md §6 "Static decode") hold it in
buffers a one-token step runs the same op on and writes in place.

Each owns the shared q/k/v/output projections (:class:`MultiHeadProjection`, with the
optional causal q/k convolution) and calls one op of ``ovqflex.ops.linear``; ``out_norm=True``
adds a per-head RMSNorm (learned ``[head_dim]`` gain shared by the heads) on the op's output
before the output projection, as flash-linear-attention's layers do:

- :class:`LinearAttention`: ELU+1 linear attention (``linear_attention``).
- :class:`DeltaNetAttention`: unit q/k, ``β = sigmoid(x W_β)`` per token and head (``delta_rule``).
- :class:`VLAAttention`: penalty directions ``u = f_θ(k)`` from a learned ``[head_dim, head_dim]``
  map of the raw key shared by the heads (VLA paper, arXiv 2605.11196, eq. 8), then ``vla_attention``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recurrences.checks import check_int, check_number, options_of
from recurrences.vla import VLAOptions, VLAState

from ..cache.recurrent import (DeltaNetCache, LinearAttentionCache, StaticDeltaNetCache, StaticLinearAttentionCache,
                               StaticRecurrentCache, StaticVLACache, VLACache)
from ..ops.linear import delta_rule, linear_attention, vla_attention
from .heads import MultiHeadProjection


class _Recurrent(MultiHeadProjection):
    """The recurrent layers' hooks: the full forward runs the op, a prefill or decode step runs it with
    ``output_final_state=True`` from the cache's state, a static step the same on one token, writing
    the state back in place; subclasses give ``cache_type``, ``static_cache_type`` and ``recur``."""

    overrides = ()  # no attention program, so no backend (None)

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int | None, qk_conv: int, out_norm: bool):
        super().__init__(hidden_size, num_heads, head_dim, None, qk_conv)
        self.out_norm = nn.RMSNorm(self.head_dim) if out_norm else None

    # forward(x, cache=None, use_cache=False, *, return_aux=False): AttentionLayer

    def _project(self, x: Tensor, cache, use_cache: bool = False):
        """x and its q, k, v ``[B, H, T, head_dim]`` and conv tail (``recur`` takes per-token gates from x)."""
        return (x, *self.split_heads_cached(x, None if cache is None else cache.conv))

    def _output(self, o: Tensor, inputs) -> Tensor:
        """op output ``[B, H, T, head_dim]`` -> ``[B, T, hidden]``."""
        return self.merge(o if self.out_norm is None else self.out_norm(o))

    def _full(self, inputs) -> tuple[Tensor, dict]:
        x, q, k, v, _ = inputs
        return self.recur(x, q, k, v), {}

    def _prefill(self, inputs):
        return self._decode_step(inputs, None)

    def _decode_step(self, inputs, cache):
        """The op from ``cache``'s state (None: a prefill) -> (o, the cache after x)."""
        x, q, k, v, tail = inputs
        o, state = self.recur(x, q, k, v, decoding=cache is not None, output_final_state=True,
                              initial_state=None if cache is None else cache.recurrence_state())
        position = (0 if cache is None else cache.position) + x.shape[1]
        return o, self.cache_type.of(state, position, tail)

    def _static_cache(self, cache, capacity: int) -> StaticRecurrentCache:
        return self.static_cache_type.of(cache)  # constant size: capacity does not matter

    def _decode_static(self, inputs, cache: StaticRecurrentCache) -> Tensor:
        """One token's step of the op from the buffers' state, then its new state written into them."""
        x, q, k, v, tail = inputs
        o, state = self.recur(x, q, k, v, decoding=True, output_final_state=True,
                              initial_state=cache.recurrence_state())
        cache.write_state(state, tail)
        return o

    def recur(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, *, decoding: bool = False, **state_options):
        """The layer's op on q, k, v ``[B, H, T, head_dim]`` (x ``[B, T, hidden]`` for per-token
        gates); ``state_options``: ``initial_state`` / ``output_final_state`` of the op; ``decoding``:
        a continuation from a cache (the op may take a smaller chunk)."""
        raise NotImplementedError


class LinearAttention(_Recurrent):
    """Multi-head causal linear attention (ELU+1 features, normalised read-out).

    x ``[B, T, hidden]`` -> ``[B, T, hidden]``; q, k, v ``[B, H, T, head_dim]`` inside.
    """

    cache_type = LinearAttentionCache
    static_cache_type = StaticLinearAttentionCache

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None = None, chunk_size: int = 64,
                 eps: float = 1e-6, qk_conv: int = 0, out_norm: bool = False):
        super().__init__(hidden_size, num_heads, head_dim, qk_conv, out_norm)
        self.chunk_size, self.eps = check_int("chunk_size", chunk_size), check_number("eps", eps)

    def recur(self, x, q, k, v, *, decoding=False, **state_options):
        # decoding: chunks of at most the new tokens (linear attention does not depend on where chunks fall)
        chunk = min(self.chunk_size, x.shape[1]) if decoding else self.chunk_size
        return linear_attention(q, k, v, chunk_size=chunk, eps=self.eps, **state_options)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"chunk_size={self.chunk_size}, out_norm={self.out_norm is not None}")


class DeltaNetAttention(_Recurrent):
    """Multi-head DeltaNet: L2-normalised q and k, write strength ``β = sigmoid(x W_β)``
    ``[B, H, T]`` (``W_β``: ``hidden -> num_heads``, no bias), the delta rule.

    x ``[B, T, hidden]`` -> ``[B, T, hidden]``.
    """

    cache_type = DeltaNetCache
    static_cache_type = StaticDeltaNetCache

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None = None, chunk_size: int = 64,
                 qk_conv: int = 0, out_norm: bool = False):
        super().__init__(hidden_size, num_heads, head_dim, qk_conv, out_norm)
        self.chunk_size = check_int("chunk_size", chunk_size)
        self.beta_proj = nn.Linear(hidden_size, num_heads, bias=False)

    def recur(self, x, q, k, v, *, decoding=False, **state_options):
        beta = torch.sigmoid(self.beta_proj(x)).transpose(1, 2)      # [B, H, T]
        chunk = min(self.chunk_size, x.shape[1]) if decoding else self.chunk_size  # as LinearAttention
        return delta_rule(F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, beta.to(q.dtype), chunk_size=chunk,
                          **state_options)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"chunk_size={self.chunk_size}, out_norm={self.out_norm is not None}")


class VLAAttention(_Recurrent):
    """Multi-head Variational Linear Attention (VLA paper, arXiv 2605.11196).

    x ``[B, T, hidden]`` -> ``[B, T, hidden]``. ``u = f_θ(k)`` ``[B, H, T, head_dim]`` with
    ``f_θ`` (``penalty_proj``) a bias-free ``head_dim -> head_dim`` linear map shared by the
    heads; ``vla_attention`` unit-normalises k and u. Keyword options are the fields of
    :class:`recurrences.vla.VLAOptions` (``lambda0``, ``refresh_every``, ``refresh_eps``,
    ``eps``, ``chunk_size``), or pass ``options=VLAOptions(...)``.
    """

    cache_type = VLACache
    static_cache_type = StaticVLACache

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None = None, qk_conv: int = 0,
                 out_norm: bool = False, options: VLAOptions | None = None, **option_kwargs):
        super().__init__(hidden_size, num_heads, head_dim, qk_conv, out_norm)
        self.options = options_of(VLAOptions, options, option_kwargs, "VLA options")
        self.penalty_proj = nn.Linear(self.head_dim, self.head_dim, bias=False)

    def recur(self, x, q, k, v, *, decoding=False, **state_options):
        # a one-token decode step runs with chunk_size=1 (one Sherman-Morrison step; 1 divides
        # every refresh period); longer continuations keep the layer's chunk, aligned by the op
        options = self._option_fields()
        if decoding and x.shape[1] == 1:
            options["chunk_size"] = 1
        return vla_attention(q, k, v, self.penalty_proj(k), **options, **state_options)

    def _option_fields(self) -> dict:
        # the fields as they are (dataclasses.asdict deep-copies them, which torch 2.11's dynamo cannot trace)
        return {f.name: getattr(self.options, f.name) for f in dataclasses.fields(self.options)}

    def _decode_static(self, inputs, cache: StaticVLACache) -> Tensor:
        """The op's one-token step without its own refresh (its schedule reads an int position), then
        the refresh due after this token (``A += refresh_eps I`` when ``position + 1`` is a multiple
        of ``refresh_every``, the op's arithmetic) chosen on the device from the position tensor."""
        x, q, k, v, tail = inputs
        options = {**self._option_fields(), "chunk_size": 1, "refresh_every": 0}
        o, state = vla_attention(q, k, v, self.penalty_proj(k), **options, output_final_state=True,
                                 initial_state=VLAState(cache.state, cache.penalty, cache.key_sum, 0))
        A, every = state.A, self.options.refresh_every
        if every:
            eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
            A = torch.where((cache.position + 1) % every == 0, A + self.options.refresh_eps * eye, A)
        cache.write_state(state._replace(A=A), tail)
        return o

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"out_norm={self.out_norm is not None}, options={self.options}")
