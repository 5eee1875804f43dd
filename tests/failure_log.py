"""A failed test's report written to a file the moment the test ends (pytest plugin, loaded by
tests/conftest.py): with ``OVQFLEX_FAILURE_LOG=PATH`` each failure (its node id, phase and traceback)
is appended to PATH. pytest prints tracebacks at the end of a run; a run stopped by a time limit (the
GPU tier under ``tools/gpu_check.sh``) never gets there, and would name its failures without saying why.
Each test process (pytest-xdist's workers too) appends its own reports with one write each."""
import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    path = os.environ.get("OVQFLEX_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"=== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")
