"""Int8 weight-only quantization for CPU inference (torchao), ``ovqflex generate --quantize int8``.

Every ``nn.Linear`` of the model gets int8 weights with per-channel scales (torchao's
``Int8WeightOnlyConfig``); activations, norms, the embedding (and the head tied to
it) and the attention state stay in floating point. Outputs agree with the float
model to about 1e-2 relative error on the logits (at most 2e-2 on a trained tiny model:
``tests/ovqflex/test_generate_cli.py::test_int8_model_agrees_with_fp32_within_stated_tolerance``);
decoding is memory-bound, and int8 weights read a quarter of the bytes.
"""
from __future__ import annotations

from torch import nn

QUANTIZE_MODES = ("none", "int8")


def quantize_model(model: nn.Module, mode: str = "int8") -> nn.Module:
    """Quantize ``model``'s linear layers in place (``mode="int8"``; ``"none"`` returns it as is)."""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {list(QUANTIZE_MODES)}, got {mode!r}")
    if mode == "none":
        return model
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("quantize='int8' needs torchao: pip install 'ovqflex[quant]'") from e
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, _: isinstance(m, nn.Linear))
    return model
