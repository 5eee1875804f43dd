"""Thin ``nn.Module`` layers: they own parameters and call the functional ops; every one is an
:class:`AttentionLayer` (``layers/base.py``: the one forward contract)."""
from .base import AttentionLayer
from .kvm import KVMAttention
from .longvq import LongVQBlock
from .linear import DeltaNetAttention, LinearAttention, VLAAttention
from .ovq import OVQAttention
from .plain import CausalAttention, SlidingWindowAttention
from .vq import VQAttention, VQCodebook

__all__ = ["AttentionLayer", "CausalAttention", "DeltaNetAttention", "KVMAttention", "LinearAttention", "LongVQBlock", "OVQAttention",
           "SlidingWindowAttention", "VLAAttention", "VQAttention", "VQCodebook"]
