"""What the ``cuda`` test tier shares: its marks, the device, and comparisons.

Every test module of ``tests/cuda/`` sets ``pytestmark = CUDA_TIER``: marked ``cuda`` (``python -m
pytest -m cuda`` selects the tier) and skipped, with the reason, where ``torch.cuda.is_available()``
is False. The README test command collects the tier, so on a GPU machine it runs with the rest.

``OVQFLEX_CUDA_TIER_DEVICE=cpu`` runs the same bodies on the CPU (a dry run of the tier's own
code where no GPU is at hand): ``TRAIN_BACKEND`` is then ``blocked``, since CPU flex has no
backward, and ``auto`` chooses state layouts with CUDA's costs (tests/cuda/conftest.py). Results on
the CPU say nothing about CUDA.
"""
import os

import pytest
import torch

from ovqflex.attention import training_backend
from tests.helpers import OLD_TORCH, UNDECLARED_FAULT, VECMASK_FAULT

DEVICE = torch.device(os.environ.get("OVQFLEX_CUDA_TIER_DEVICE", "cuda"))
CUDA_TIER = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(),
                       reason="needs a CUDA device: torch.cuda.is_available() is False"),
]
# a CPU dry run under torch < 2.13: the compiled trainings its inductor kills or cannot compile, and 2.13
# compiles, skip with the fault named (tests/helpers.py)
OLD_CPU_INDUCTOR = DEVICE.type == "cpu" and OLD_TORCH
OLD_CPU_INDUCTOR_FAULTS = {  # (test, mixer, dtype) -> the fault
    ("model", "kvm", "bf16"): "inductor's compiled kvm bf16 training corrupts the heap (process abort)",
    ("model", "vq", "fp32"): UNDECLARED_FAULT, ("model", "vq", "bf16"): UNDECLARED_FAULT,
    ("layer", "longvq", "fp32"): VECMASK_FAULT, ("layer", "longvq", "bf16"): VECMASK_FAULT,
}


def skip_old_cpu_inductor_fault(test: str, mixer: str, dtype: str) -> None:
    """Skip this case of a CPU dry run under torch < 2.13 if its inductor has a fault here."""
    fault = OLD_CPU_INDUCTOR_FAULTS.get((test, mixer, dtype))
    if OLD_CPU_INDUCTOR and fault:
        pytest.skip(f"torch < 2.13 on the CPU: {fault}")
# the backend whose training path the tier checks: flex on CUDA (blocked in a CPU dry run)
TRAIN_BACKEND = training_backend(DEVICE)

# fp32 forward / gradient bounds of flex on CUDA against the references: every op met them against
# fp64 references in the GPU measurements of the CUDA issue (H100, torch 2.11)
FWD_TOL_CUDA, GRAD_TOL_CUDA = 1e-4, 1e-3


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def loss_falls(losses: list[float], ratio: float = 0.8) -> bool:
    """The mean of the last three losses is below ``ratio`` times the first."""
    return sum(losses[-3:]) / 3 < ratio * losses[0]
