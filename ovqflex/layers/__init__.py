"""Thin ``nn.Module`` layers: they own parameters and call the functional ops."""
from .kvm import KVMAttention
from .linear import DeltaNetAttention, LinearAttention, VLAAttention
from .ovq import OVQAttention
from .plain import CausalAttention, SlidingWindowAttention

__all__ = ["CausalAttention", "DeltaNetAttention", "KVMAttention", "LinearAttention", "OVQAttention",
           "SlidingWindowAttention", "VLAAttention"]
