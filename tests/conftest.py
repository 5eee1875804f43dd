"""Shared test configuration: hypothesis profiles, seeding, comparison helpers."""
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, settings

# default: quick runs (README test command, CI); slow: more examples (`HYPOTHESIS_PROFILE=slow pytest -m slow`)
settings.register_profile(
    "default", deadline=None, max_examples=20, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile(
    "slow", deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    torch.manual_seed(0)
    yield
