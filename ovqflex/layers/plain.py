"""Plain attention layers: ``forward(x [B, T, hidden]) -> [B, T, hidden]``."""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from masks.program import DEFAULT_BLOCK, AttentionProgram, build_program, scaled_unit_queries, unit_rows
from recurrences.checks import check_block_size, check_number
from recurrences.precision import work_dtype

from ..attention import attend
from ..cache.plain import PlainCache, StaticPlainCache
from ..ops.decode import positions
from ..ops.plain import check_logn_len, logn_scale, plain_regions, window_regions
from ..ops.plain_decode import plain_decode, plain_decode_static, plain_prefill, plain_static
from ..profiling import stage
from .heads import MultiHeadProjection
from .rope import apply_rope


class _PlainAttention(MultiHeadProjection):
    """Shared body: fused qkv projection, optional RoPE, one program, output projection.

    ``qk_norm=True`` is the OVQ paper's baseline form (arXiv 2602.03922, §8.2): q and k are
    L2-normalized per head and scored as ``beta[h] * <q̂, k̂>`` with a learned ``beta``
    ``[H]`` initialised to ``sqrt(head_dim)``; otherwise scores are ``<q, k> / sqrt(head_dim)``.
    """

    cache_type = PlainCache  # forward(x, cache=None, use_cache=False): docs/design.md §6
    static_cache_type = StaticPlainCache

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None, rope: bool, rope_base: float,
                 qk_norm: bool, backend: str, block_size: int, regions, qk_conv: int = 0):
        super().__init__(hidden_size, num_heads, head_dim, backend, qk_conv)
        if self.head_dim % 2 and rope:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        self.rope, self.rope_base, self.regions = rope, check_number("rope_base", rope_base), regions
        self.block_size = check_block_size("block_size", block_size)
        self.qk_norm = qk_norm
        if qk_norm:
            self.beta = nn.Parameter(torch.full((num_heads,), math.sqrt(self.head_dim)))

    def _project(self, x: Tensor, cache: PlainCache | None, use_cache: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """x ``[B, T, hidden]`` -> q, k, v ``[B, H, T, head_dim]`` (RoPE applied to q, k at the
        absolute positions after ``cache``, ``0..T-1`` without one) and the q/k conv tail (see
        ``split_heads_cached``)."""
        start, conv_tail = (0, None) if cache is None else (cache.position, cache.conv)
        with stage("proj"):
            q, k, v, tail = self.split_heads_cached(x, conv_tail)
            if self.qk_norm:
                q = scaled_unit_queries(q, self.beta)
                k = unit_rows(k)
            if self.rope:
                pos = positions(start, x.shape[1], x.device)
                q = apply_rope(q, pos, base=self.rope_base)
                k = apply_rope(k, pos, base=self.rope_base)
        return q, k, v, tail

    @property
    def scale(self) -> float:
        return 1.0 if self.qk_norm else self.head_dim**-0.5

    def _program(self, q: Tensor, k: Tensor, v: Tensor) -> AttentionProgram:
        with stage("block_mask"):
            return build_program(q, k, v, self.regions, scale=self.scale, block_size=self.block_size)

    def program(self, x: Tensor) -> AttentionProgram:
        """The layer's attention program for x ``[B, T, hidden]`` (what the visualizer draws)."""
        q, k, v, _ = self._project(x, None)
        return self._program(q, k, v)

    # forward(x, cache=None, use_cache=False, *, return_aux=False): AttentionLayer

    def _full(self, inputs) -> tuple[Tensor, dict]:
        q, k, v, _ = inputs
        program = self._program(q, k, v)
        with stage("attention"):
            return attend(program, self.backend), {}

    def _prefill(self, inputs) -> tuple[Tensor, PlainCache]:
        _, k, v, tail = inputs
        return self._full(inputs)[0], plain_prefill(self.regions, k, v, tail)

    def _decode_step(self, inputs, cache: PlainCache) -> tuple[Tensor, PlainCache]:
        q, k, v, tail = inputs
        return plain_decode(cache, self.regions, q, k, v, scale=self.scale, conv=tail)

    def _static_cache(self, cache: PlainCache, capacity: int) -> StaticPlainCache:
        return plain_static(cache, self.regions, capacity)

    def _decode_static(self, inputs, cache: StaticPlainCache) -> Tensor:
        q, k, v, tail = inputs
        return plain_decode_static(cache, self.regions, q, k, v, scale=self.scale, conv=tail)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"rope={self.rope}, qk_norm={self.qk_norm}, regions={self.regions}, backend={self.backend!r}")


class CausalAttention(_PlainAttention):
    """Full causal multi-head attention, NoPE (``rope=False``) or RoPE.

    ``logn_len`` (default 0: off): the query at position ``t`` has its logits multiplied by
    ``max(1, ln(t + 1) / ln(logn_len))`` (:func:`~ovqflex.ops.plain.logn_scale`), so that past
    ``logn_len`` tokens a match does not lose its softmax weight to the growing number of keys.
    A test-time setting (``ovqflex eval --override logn_len=TRAIN_LEN``): no parameter depends
    on it, and it leaves contexts up to ``logn_len`` unchanged.
    """

    overrides = (*_PlainAttention.overrides, "logn_len")

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None = None, rope: bool = False,
                 rope_base: float = 10000.0, qk_norm: bool = False, qk_conv: int = 0, backend: str = "auto",
                 block_size: int = DEFAULT_BLOCK, logn_len: int = 0):
        super().__init__(hidden_size, num_heads, head_dim=head_dim, rope=rope, rope_base=rope_base,
                         qk_norm=qk_norm, backend=backend, block_size=block_size, regions=plain_regions(),
                         qk_conv=qk_conv)
        self.logn_len = logn_len

    @property
    def logn_len(self) -> int:
        return self._logn_len

    @logn_len.setter
    def logn_len(self, value: int) -> None:
        self._logn_len = check_logn_len(value)

    def _project(self, x: Tensor, cache: PlainCache | None, use_cache: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        q, k, v, tail = super()._project(x, cache, use_cache)
        if self.logn_len:  # scaling q scales every logit of its row
            pos = positions(0 if cache is None else cache.position, x.shape[1], x.device)
            q = q * logn_scale(pos, self.logn_len, work_dtype(q)).to(q.dtype).view(1, 1, -1, 1)
        return q, k, v, tail

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", logn_len={self.logn_len}" if self.logn_len else "")


class DefaultWindow(int):
    """A default ``window`` of :class:`SlidingWindowAttention` (the layer's, 512 tokens; a method's or a
    model config's), told apart from a window given: a ``block_window`` replaces a default window, and
    is refused beside a window given."""

    def __repr__(self) -> str:
        return str(int(self))


class SlidingWindowAttention(_PlainAttention):
    """Sliding-window attention with RoPE: a token window of ``window`` tokens (512 unless a block window is
    given), or a block window of ``block_window`` chunks of ``chunk_size`` (refused beside a ``window``
    given); ``n_sinks`` first tokens always visible (StreamingLLM).

    ``window``, ``block_window`` and ``n_sinks`` may be set on a built layer (no parameter depends on
    them; ``ovqflex eval --override window=1024``): setting one rebuilds the layer's regions, checked as
    the constructor checks them; a token window replaces a block window and the other way round."""

    overrides = (*_PlainAttention.overrides, "window", "block_window", "n_sinks")

    def __init__(self, hidden_size: int, num_heads: int, *, window: int | None = DefaultWindow(512),
                 block_window: int | None = None, chunk_size: int = 128, n_sinks: int = 0,
                 head_dim: int | None = None, rope: bool = True, rope_base: float = 10000.0,
                 qk_norm: bool = False, qk_conv: int = 0, backend: str = "auto", block_size: int = DEFAULT_BLOCK):
        if isinstance(window, DefaultWindow):
            window = None if block_window is not None else int(window)
        shape = dict(window=window, block_window=block_window, chunk_size=chunk_size, n_sinks=n_sinks)
        super().__init__(hidden_size, num_heads, head_dim=head_dim, rope=rope, rope_base=rope_base,
                         qk_norm=qk_norm, backend=backend, block_size=block_size, regions=self._regions(shape),
                         qk_conv=qk_conv)
        self._shape = shape

    @staticmethod
    def _regions(shape: dict) -> tuple:
        return window_regions("SlidingWindowAttention", "CausalAttention", **shape)

    def _reshape(self, **change) -> None:
        """The window's ``shape`` changed by ``change``, and the regions of it."""
        shape = {**self._shape, **change}
        self.regions, self._shape = self._regions(shape), shape

    window = property(lambda self: self._shape["window"],
                      lambda self, value: self._reshape(window=value, block_window=None))
    block_window = property(lambda self: self._shape["block_window"],
                            lambda self, value: self._reshape(block_window=value, window=None))
    n_sinks = property(lambda self: self._shape["n_sinks"], lambda self, value: self._reshape(n_sinks=value))
    chunk_size = property(lambda self: self._shape["chunk_size"])
