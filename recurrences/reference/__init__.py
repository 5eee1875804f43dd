"""Sequential reference implementations (the papers' loops), used as test oracles."""
from .ovq import OVQReferenceResult, ovq_attention_reference, ovq_schedule

__all__ = ["OVQReferenceResult", "ovq_attention_reference", "ovq_schedule"]
