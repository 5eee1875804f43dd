"""Sequential reference implementations (the papers' loops), used as test oracles."""
from .delta import delta_rule_reference
from .kvm import KVMReferenceResult, kvm_attention_reference
from .linear import RecurrentReferenceResult, linear_attention_reference
from .ovq import OVQReferenceResult, ovq_attention_reference, ovq_schedule
from .vla import vla_reference
from .vq import VQReferenceResult, vq_attention_reference

__all__ = ["KVMReferenceResult", "OVQReferenceResult", "RecurrentReferenceResult", "delta_rule_reference",
           "kvm_attention_reference", "linear_attention_reference", "ovq_attention_reference", "ovq_schedule",
           "vla_reference", "VQReferenceResult", "vq_attention_reference"]
