"""Sequential reference implementations (the papers' loops), used as test oracles."""
from .kvm import KVMReferenceResult, kvm_attention_reference
from .ovq import OVQReferenceResult, ovq_attention_reference, ovq_schedule

__all__ = ["KVMReferenceResult", "OVQReferenceResult", "kvm_attention_reference", "ovq_attention_reference",
           "ovq_schedule"]
