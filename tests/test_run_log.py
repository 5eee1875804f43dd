"""tests/run_log.py: a failure's traceback is in OVQFLEX_FAILURE_LOG, and every test's time and outcome in
OVQFLEX_DURATION_LOG, as soon as the test ends."""
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

CASES = '''
import pytest

def test_passes():
    import time
    time.sleep(0.2)

def test_skips():
    pytest.skip("not here")

def test_fails():
    assert 1 + 1 == 3, "arithmetic is off"

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_errors_in_setup(broken):
    pass

def test_kills_the_run():
    import os
    assert open(LOG).read().count("\\n=== ") == 1  # both failures above are in the log already
    os._exit(3)  # as a time limit would: no summary, no tracebacks printed
'''


def test_each_failure_and_each_tests_time_are_logged_when_the_test_ends(tmp_path):
    log, times = tmp_path / "failures.txt", tmp_path / "durations.txt"
    (tmp_path / "test_cases.py").write_text(f"LOG = {str(log)!r}\n" + CASES)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OVQFLEX_FAILURE_LOG": str(log),
           "OVQFLEX_DURATION_LOG": str(times)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.run_log", "-p", "no:cacheprovider",
                          str(tmp_path / "test_cases.py")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 3 and "arithmetic is off" not in run.stdout, run.stdout
    text = log.read_text()
    heads = re.findall(r"^=== (\S+) \((\w+), [0-9.]+ s\)$", text, re.M)
    assert heads == [("test_cases.py::test_fails", "call"), ("test_cases.py::test_errors_in_setup", "setup")], text
    fails, setup = text.split("\n=== ")
    assert "arithmetic is off" in fails and "assert 1 + 1 == 3" in fails
    assert "fixture broke" in setup and "arithmetic" not in setup
    lines = [line.split(maxsplit=1) for line in times.read_text().splitlines()]
    assert [rest for _, rest in lines] == [  # the killed test never reached its teardown
        "passed test_cases.py::test_passes", "skipped test_cases.py::test_skips",
        "failed in call test_cases.py::test_fails", "failed in setup test_cases.py::test_errors_in_setup"]
    assert float(lines[0][0]) >= 0.2
