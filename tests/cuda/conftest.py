"""The ``cuda`` tier's fixtures (tests/cuda/cuda_cases.py says what the tier is)."""
import pytest

from recurrences import versioned

from tests.cuda.cuda_cases import DEVICE


@pytest.fixture(autouse=True)
def _cuda_layout_costs_in_a_dry_run(monkeypatch):
    """A CPU dry run (``OVQFLEX_CUDA_TIER_DEVICE=cpu``) chooses state layouts as CUDA does: ``auto``
    weighs a versioned row at CUDA's cost (``versioned.LAYOUT_ROW_COST``), so the dry run builds and
    compiles the layouts the GPU run will, not the CPU's (at 4k tokens OVQ's and KVM's no-grad ops take
    snapshots on CUDA, versions on the CPU)."""
    if DEVICE.type == "cpu":
        monkeypatch.setitem(versioned.LAYOUT_ROW_COST, "cpu", versioned.LAYOUT_ROW_COST["cuda"])
