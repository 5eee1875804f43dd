"""Functional attention ops: ``[B, H, T, D]`` tensors in, ``[B, H, T, Dv]`` out."""
from .plain import causal_attention, plain_regions, sliding_window_attention

__all__ = ["causal_attention", "plain_regions", "sliding_window_attention"]
from .ovq import OVQOptions, OVQState, ovq_attention, ovq_program

__all__ += ["OVQOptions", "OVQState", "ovq_attention", "ovq_program"]
from .kvm import KVMOptions, KVMState, kvm_attention, kvm_program

__all__ += ["KVMOptions", "KVMState", "kvm_attention", "kvm_program"]
from .linear import delta_rule, linear_attention, vla_attention

__all__ += ["delta_rule", "linear_attention", "vla_attention"]
from .vq import VQOptions, vq_attention, vq_program

__all__ += ["VQOptions", "vq_attention", "vq_program"]
