"""Thin ``nn.Module`` layers: they own parameters and call the functional ops."""
from .kvm import KVMAttention
from .ovq import OVQAttention
from .plain import CausalAttention, SlidingWindowAttention

__all__ = ["KVMAttention", "OVQAttention", "CausalAttention", "SlidingWindowAttention"]
