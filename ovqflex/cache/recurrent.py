"""Decode caches of the non-softmax recurrent layers (docs/design.md §4.6, §6).

A recurrence's past is entirely in its state, so the cache is that state (detached,
in the recurrence's work dtype: fp32, fp64 for fp64 layers) plus the q/k conv tail:

- :class:`LinearAttentionCache`: ``S = Σ v φ(k)^T`` and the normaliser ``z = Σ φ(k)``;
- :class:`DeltaNetCache`: ``S``;
- :class:`VLACache`: ``S``, the penalty inverse ``A`` and ``z``; ``position`` tells the
  recurrence where the identity-refresh schedule stands.

Bound, constant in the number of tokens seen (``Dk = Dv = head_dim``, 4-byte floats):
linear ``B*H*(Dv*Dk + Dk)``, DeltaNet ``B*H*Dv*Dk``, VLA ``B*H*(Dv*Dk + Dk*Dk + Dk)``
values, plus the conv tail ``B*2*H*Dk*(qk_conv-1)`` in the projections' dtype.
Decoding never mutates a cache: each call returns a new one.

Their in-place forms (docs/design.md §6, "Static decode") hold the same tensors, written by each
one-token step: :class:`StaticLinearAttentionCache`, :class:`StaticDeltaNetCache`,
:class:`StaticVLACache` (made by :meth:`StaticRecurrentCache.of`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from recurrences.linear import LinearState
from recurrences.vla import VLAState

from .base import LayerCache, StaticLayerCache


@dataclass
class LinearAttentionCache(LayerCache):
    """state ``[B, H, Dv, Dk]`` ``S = Σ_s v_s φ(k_s)^T`` and key_sum ``[B, H, Dk]`` ``z = Σ_s φ(k_s)``
    over the ``position`` tokens seen."""

    state: Tensor
    key_sum: Tensor

    @classmethod
    def of(cls, state: LinearState, position: int, conv: Tensor | None) -> LinearAttentionCache:
        """The cache holding ``state`` (:class:`recurrences.linear.LinearState`) after ``position`` tokens."""
        return cls(position=position, conv=conv, state=state.S, key_sum=state.z)

    def recurrence_state(self) -> LinearState:
        return LinearState(self.state, self.key_sum)


@dataclass
class DeltaNetCache(LayerCache):
    """state ``[B, H, Dv, Dk]``: the delta rule's ``S`` after ``position`` tokens."""

    state: Tensor

    @classmethod
    def of(cls, state: Tensor, position: int, conv: Tensor | None) -> DeltaNetCache:
        """The cache holding the delta rule's ``S`` after ``position`` tokens."""
        return cls(position=position, conv=conv, state=state)

    def recurrence_state(self) -> Tensor:
        return self.state


@dataclass
class VLACache(LayerCache):
    """state ``[B, H, Dv, Dk]`` (``S``), penalty ``[B, H, Dk, Dk]`` (``A``, the refreshes up to
    ``position`` applied) and key_sum ``[B, H, Dk]`` (``z = Σ_s φ(k_s)``)."""

    state: Tensor
    penalty: Tensor
    key_sum: Tensor

    @classmethod
    def of(cls, state: VLAState, position: int, conv: Tensor | None) -> VLACache:
        """The cache holding ``state`` (:class:`recurrences.vla.VLAState`) after ``position`` tokens."""
        if state.position != position:
            raise ValueError(f"VLA state is at position {state.position}, the cache at {position}")
        return cls(position=position, conv=conv, state=state.S, penalty=state.A, key_sum=state.z)

    def recurrence_state(self) -> VLAState:
        return VLAState(self.state, self.penalty, self.key_sum, self.position)


@dataclass
class StaticRecurrentCache(StaticLayerCache):
    """A recurrence's state in buffers written in place by each one-token step; the fields (besides
    ``position``, a 0-d int64 tensor) are the functional cache's of the same name and shape."""

    @classmethod
    def of(cls, cache: LayerCache) -> StaticRecurrentCache:
        """The static cache holding a copy of the functional ``cache``'s state (``cache`` is not changed)."""
        fields = {f.name: getattr(cache, f.name) for f in dataclasses.fields(cls)
                  if f.name not in ("position", "capacity")}
        device = cache.tensors()[0].device
        return cls(position=torch.tensor(cache.position, device=device),
                   **{name: None if t is None else t.clone() for name, t in fields.items()})

    def write(self, conv: Tensor | None, **state: Tensor) -> None:
        """Copy a step's new conv tail and state tensors (by field name) into the buffers."""
        self.write_conv(conv)
        for name, t in state.items():
            getattr(self, name).copy_(t)


@dataclass
class StaticLinearAttentionCache(StaticRecurrentCache):
    """state ``[B, H, Dv, Dk]``, key_sum ``[B, H, Dk]``, as :class:`LinearAttentionCache`."""

    state: Tensor
    key_sum: Tensor

    def recurrence_state(self) -> LinearState:
        return LinearState(self.state, self.key_sum)

    def write_state(self, state: LinearState, conv: Tensor | None) -> None:
        self.write(conv, state=state.S, key_sum=state.z)


@dataclass
class StaticDeltaNetCache(StaticRecurrentCache):
    """state ``[B, H, Dv, Dk]``, as :class:`DeltaNetCache`."""

    state: Tensor

    def recurrence_state(self) -> Tensor:
        return self.state

    def write_state(self, state: Tensor, conv: Tensor | None) -> None:
        self.write(conv, state=state)


@dataclass
class StaticVLACache(StaticRecurrentCache):
    """state ``[B, H, Dv, Dk]``, penalty ``[B, H, Dk, Dk]`` (the refreshes up to ``position``
    applied), key_sum ``[B, H, Dk]``, as :class:`VLACache`. The refresh schedule's position is
    the tensor ``position``: the layer's step applies a due refresh with ``torch.where``."""

    state: Tensor
    penalty: Tensor
    key_sum: Tensor

    def write_state(self, state: VLAState, conv: Tensor | None) -> None:
        """Copy a step's state (its refresh applied; ``state.position`` is not kept) into the buffers."""
        self.write(conv, state=state.S, penalty=state.A, key_sum=state.z)
