"""ovqflex: compressed-memory attention as FlexAttention programs.

Functional ops take ``[B, H, T, D]`` tensors; layers take ``x [B, T, hidden]``.
"""
from masks.program import AttentionProgram, build_program

from .attention import attend, resolve_backend
from .layers import CausalAttention, KVMAttention, OVQAttention, SlidingWindowAttention
from .ops import KVMState, OVQState, causal_attention, kvm_attention, ovq_attention, sliding_window_attention

__version__ = "0.1.0"

__all__ = [
    "AttentionProgram",
    "CausalAttention",
    "KVMAttention",
    "KVMState",
    "OVQAttention",
    "OVQState",
    "SlidingWindowAttention",
    "attend",
    "build_program",
    "causal_attention",
    "kvm_attention",
    "ovq_attention",
    "resolve_backend",
    "sliding_window_attention",
]
