"""The ``cuda`` tier's fixtures (tests/cuda/cuda_cases.py says what the tier is)."""
import pytest

from recurrences import versioned
from recurrences.ovq import routing_static as ovq_routing_static

from tests.cuda.cuda_cases import DEVICE
from tests.helpers import sum_narrow_as_on_cuda


@pytest.fixture(autouse=True)
def _cuda_choices_in_a_dry_run(monkeypatch):
    """A CPU dry run (``OVQFLEX_CUDA_TIER_DEVICE=cpu``) compiles what the GPU run will, not the CPU's
    choices: ``auto`` weighs a versioned row at CUDA's cost (``versioned.LAYOUT_ROW_COST``: at 4k tokens
    OVQ's and KVM's no-grad ops take snapshots on CUDA, versions on the CPU), OVQ's compiled static
    step fuses its absorb as on CUDA (``FUSED_ABSORB``), and bf16 state sums are summed as on CUDA
    (:func:`~tests.helpers.sum_narrow_as_on_cuda`)."""
    if DEVICE.type == "cpu":
        monkeypatch.setitem(versioned.LAYOUT_ROW_COST, "cpu", versioned.LAYOUT_ROW_COST["cuda"])
        monkeypatch.setitem(ovq_routing_static.FUSED_ABSORB, "cpu", ovq_routing_static.FUSED_ABSORB["cuda"])
        sum_narrow_as_on_cuda(monkeypatch)
