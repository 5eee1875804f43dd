"""ovqflex: compressed-memory attention as FlexAttention programs.

Functional ops take ``[B, H, T, D]`` tensors; layers take ``x [B, T, hidden]``.
"""
from masks.program import AttentionProgram, build_program
from recurrences.checks import finite_checks

from .attention import attend, resolve_backend
from .layers import (AttentionLayer, CausalAttention, DeltaNetAttention, KVMAttention, LinearAttention, LongVQBlock, OVQAttention,
                     SlidingWindowAttention, VLAAttention, VQAttention, VQCodebook)
from .methods import METHODS, Method, get_method, register_method
from .ops import (KVMOptions, KVMState, OVQOptions, OVQState, VQOptions, causal_attention, delta_rule, kvm_attention,
                  kvm_program, linear_attention, ovq_attention, ovq_program, sliding_window_attention, vla_attention,
                  vq_attention, vq_program)

__version__ = "0.1.0"

__all__ = [
    "AttentionLayer",
    "AttentionProgram",
    "CausalAttention",
    "DeltaNetAttention",
    "KVMAttention",
    "KVMOptions",
    "KVMState",
    "LinearAttention",
    "LongVQBlock",
    "METHODS",
    "Method",
    "OVQAttention",
    "OVQOptions",
    "OVQState",
    "SlidingWindowAttention",
    "VLAAttention",
    "VQAttention",
    "VQCodebook",
    "VQOptions",
    "attend",
    "build_program",
    "causal_attention",
    "delta_rule",
    "finite_checks",
    "get_method",
    "kvm_attention",
    "kvm_program",
    "linear_attention",
    "ovq_attention",
    "ovq_program",
    "register_method",
    "resolve_backend",
    "sliding_window_attention",
    "vla_attention",
    "vq_attention",
    "vq_program",
]
