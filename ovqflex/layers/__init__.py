"""Thin ``nn.Module`` layers: they own parameters and call the functional ops."""
from .plain import CausalAttention, SlidingWindowAttention

__all__ = ["CausalAttention", "SlidingWindowAttention"]
