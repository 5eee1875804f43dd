"""tests/failure_log.py: a failure's traceback is in OVQFLEX_FAILURE_LOG as soon as the test ends."""
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

CASES = '''
import pytest

def test_passes():
    assert True

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


def test_each_failure_is_logged_with_its_traceback_when_it_happens(tmp_path):
    log = tmp_path / "failures.txt"
    (tmp_path / "test_cases.py").write_text(f"LOG = {str(log)!r}\n" + CASES)
    env = {**os.environ, "OVQFLEX_FAILURE_LOG": str(log), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.failure_log", "-p", "no:cacheprovider",
                          str(tmp_path / "test_cases.py")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 3 and "arithmetic is off" not in run.stdout, run.stdout
    text = log.read_text()
    heads = re.findall(r"^=== (\S+) \((\w+), [0-9.]+ s\)$", text, re.M)
    assert heads == [("test_cases.py::test_fails", "call"), ("test_cases.py::test_errors_in_setup", "setup")], text
    fails, setup = text.split("\n=== ")
    assert "arithmetic is off" in fails and "assert 1 + 1 == 3" in fails
    assert "fixture broke" in setup and "arithmetic" not in setup
