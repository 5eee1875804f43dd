"""ovqflex: compressed-memory attention as FlexAttention programs.

Functional ops take ``[B, H, T, D]`` tensors; layers take ``x [B, T, hidden]``.
"""
from masks.program import AttentionProgram, build_program

from .attention import attend, resolve_backend
from .layers import CausalAttention, OVQAttention, SlidingWindowAttention
from .ops import OVQState, causal_attention, ovq_attention, sliding_window_attention

__version__ = "0.1.0"

__all__ = [
    "AttentionProgram",
    "CausalAttention",
    "OVQAttention",
    "OVQState",
    "SlidingWindowAttention",
    "attend",
    "build_program",
    "causal_attention",
    "ovq_attention",
    "resolve_backend",
    "sliding_window_attention",
]
