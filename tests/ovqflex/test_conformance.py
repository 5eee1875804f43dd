"""Every registered method passes the conformance checks (``tests/ovqflex/conformance.py``)."""
import pytest

from ovqflex.methods import METHODS, method_names
from tests.ovqflex.conformance import CHECKS


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("name", method_names())
def test_method_conforms(name, check):
    CHECKS[check](METHODS[name])
