"""ovqflex: compressed-memory attention as FlexAttention programs.

Functional ops take ``[B, H, T, D]`` tensors; layers take ``x [B, T, hidden]``.
"""
from masks.program import AttentionProgram, build_program

from .attention import attend, resolve_backend
from .layers import CausalAttention, SlidingWindowAttention
from .ops import causal_attention, sliding_window_attention

__version__ = "0.1.0"

__all__ = [
    "AttentionProgram",
    "CausalAttention",
    "SlidingWindowAttention",
    "attend",
    "build_program",
    "causal_attention",
    "resolve_backend",
    "sliding_window_attention",
]
