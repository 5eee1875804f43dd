"""VQ-attention (Transformer-VQ; the OVQ paper's sw-vq, OVQ paper, arXiv 2602.03922, §2.2 / appendix 8.1):
codebook quantizer (nearest code, straight-through or DiVeQ estimator, commitment loss,
EMA k-means updates with dead-code revival, metrics) and the snapshot state build."""
from .codebook import (ESTIMATORS, assign_codes, code_histogram, codebook_metrics, commitment_loss, ema_update_,
                       quantize)
from .state import LAG, build_vq_snapshots, build_vq_versioned, vq_state_sizes

__all__ = ["ESTIMATORS", "LAG", "assign_codes", "build_vq_snapshots", "build_vq_versioned", "code_histogram",
           "codebook_metrics", "commitment_loss", "ema_update_", "quantize", "vq_state_sizes"]
