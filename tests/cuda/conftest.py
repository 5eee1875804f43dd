"""The ``cuda`` tier's fixtures (tests/cuda/cuda_cases.py says what the tier is)."""
import pytest

from recurrences import versioned
from recurrences.kvm import routing_static as kvm_routing_static
from recurrences.ovq import routing_static as ovq_routing_static

from tests.cuda.cuda_cases import DEVICE
from tests.helpers import sum_narrow_as_on_cuda


@pytest.fixture(autouse=True)
def _cuda_choices_in_a_dry_run(monkeypatch):
    """A CPU dry run (``OVQFLEX_CUDA_TIER_DEVICE=cpu``) compiles what the GPU run will, not the CPU's
    choices: ``auto`` weighs a versioned row at CUDA's cost (``versioned.LAYOUT_ROW_COST``: at 4k tokens
    OVQ's and KVM's no-grad ops take snapshots on CUDA, versions on the CPU), OVQ's and KVM's compiled
    static steps fuse their absorbs as on CUDA (``FUSED_ABSORB``), and bf16 state sums are summed as on CUDA
    (:func:`~tests.helpers.sum_narrow_as_on_cuda`)."""
    if DEVICE.type == "cpu":
        monkeypatch.setitem(versioned.LAYOUT_ROW_COST, "cpu", versioned.LAYOUT_ROW_COST["cuda"])
        for routing_static in (ovq_routing_static, kvm_routing_static):
            monkeypatch.setitem(routing_static.FUSED_ABSORB, "cpu", routing_static.FUSED_ABSORB["cuda"])
        sum_narrow_as_on_cuda(monkeypatch)
