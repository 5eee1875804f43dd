"""Shared test configuration: hypothesis profiles, seeding, dynamo's shape memory cleared per test, failures
logged as they happen (tests/run_log.py)."""
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from torch._dynamo.pgo import reset_code_state  # torch 2.11 and 2.13: what torch._dynamo.reset calls

from tests.run_log import pytest_runtest_makereport  # noqa: F401 (a hook: OVQFLEX_FAILURE_LOG, _DURATION_LOG)

# default: quick runs (README test command, CI); slow: more examples (`HYPOTHESIS_PROFILE=slow pytest -m slow`);
# both derandomized, the same examples every run. fuzz: 200 new random examples every run, for hunting; a failure
# prints the `@reproduce_failure` blob that replays it (`HYPOTHESIS_PROFILE=fuzz pytest tests/ovqflex/ops`)
settings.register_profile(
    "default", deadline=None, max_examples=20, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile(
    "slow", deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile(
    "fuzz", deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow], derandomize=False,
    print_blob=True, database=None,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_configure(config):
    """Under pytest-xdist (``-n N``) each worker process takes its share of torch's intra-op threads:
    N workers with the default thread count each would run N times as many threads as there are
    cores, and OpenMP regions slow down badly when oversubscribed. Tests that need a thread count set
    their own and restore it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in xdist's workers only
    if workers > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _fresh_shape_memory():
    """Each test compiles as a fresh process would: dynamo remembers, per code object, the input sizes
    it compiled for, and on a recompile with other sizes it marks those dims dynamic ("automatic dynamic
    shapes"). A test that compiles a layer another test compiled at another length then gets a
    symbolic-shape graph it did not ask for (measured, the KVM layer's compiled training: 126 s instead of
    47 s cold). Clearing that memory (``torch._dynamo.pgo.reset_code_state``, which ``torch._dynamo.reset``
    calls too) keeps the compiled code that later tests share; within a test, a second length still
    makes dims dynamic as it does for a user."""
    reset_code_state()
    yield


@pytest.fixture
def eager_backend_compile(monkeypatch):
    """``torch.compile`` with the ``eager`` backend for this test, dynamo's caches reset first: dynamo
    traces and counts (graphs, graph breaks, recompiles) exactly as for inductor, without inductor's
    compile time. For tests of what compiling did (``ovqflex/compile_watch.py``) through the trainer,
    the experiment runner and the bench."""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch._dynamo.reset()
