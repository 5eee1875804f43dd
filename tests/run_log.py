"""What a test run has done, written to files as each test ends (pytest plugin, loaded by
tests/conftest.py). pytest prints tracebacks and ``--durations`` at the end of a run; a run stopped by
a time limit (the GPU tier under ``tools/gpu_check.sh``) never gets there, and would name its failures
without saying why, and not say which tests took its time.

- ``OVQFLEX_FAILURE_LOG=PATH``: each failure (its node id, phase, seconds and traceback) is appended.
- ``OVQFLEX_DURATION_LOG=PATH``: one line per test, ``<seconds> <outcome> <node id>`` (setup, call and
  teardown summed; the outcome of the first phase that did not pass).

Each test process (pytest-xdist's workers too) appends its own lines, one write each."""
import os

import pytest

_SPENT = pytest.StashKey[list]()  # per test: [seconds so far, outcome of the first phase that did not pass]


def _append(var: str, text: str) -> None:
    path = os.environ.get(var)
    if path:
        with open(path, "a") as f:
            f.write(text)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        _append("OVQFLEX_FAILURE_LOG",
                f"=== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n\n")
    spent = item.stash.setdefault(_SPENT, [0.0, None])
    spent[0] += report.duration
    if spent[1] is None and not report.passed:
        spent[1] = "skipped" if report.skipped else f"failed in {report.when}"
    if report.when == "teardown":  # the last phase, run after a failed setup too
        _append("OVQFLEX_DURATION_LOG", f"{spent[0]:8.1f} {spent[1] or 'passed'} {report.nodeid}\n")

