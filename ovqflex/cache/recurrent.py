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
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from recurrences.linear import LinearState
from recurrences.vla import VLAState

from .base import LayerCache


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
