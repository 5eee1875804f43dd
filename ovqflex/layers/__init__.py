"""Thin ``nn.Module`` layers: they own parameters and call the functional ops."""
from .ovq import OVQAttention
from .plain import CausalAttention, SlidingWindowAttention

__all__ = ["OVQAttention", "CausalAttention", "SlidingWindowAttention"]
