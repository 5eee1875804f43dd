"""The ``program`` fixture: one small program of each region kind (see viz_cases)."""
import pytest
from tests.masks.viz.viz_cases import KINDS, make_program


@pytest.fixture(params=KINDS)
def program(request):
    return make_program(request.param)
