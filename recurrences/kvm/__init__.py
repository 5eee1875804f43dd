"""Key-Value Means (KVM paper, arXiv 2605.09877): state budgets, no-grad routing, snapshot state build."""
from ..compiling import ROUTING_IMPLS
from .budget import BUDGETS, KVMBudget, KVMSchedule, check_sink_len, kvm_state_sizes
from .routing import kvm_absorb, kvm_route_chunk, route_kvm
from .state import build_kvm_snapshots, build_kvm_versioned, memory_keys, routing_memory_keys

__all__ = ["BUDGETS", "ROUTING_IMPLS", "KVMBudget", "KVMSchedule", "build_kvm_snapshots", "build_kvm_versioned",
           "check_sink_len", "kvm_absorb", "kvm_route_chunk", "kvm_state_sizes", "memory_keys", "route_kvm",
           "routing_memory_keys"]
