"""The run lock: one writer per run directory; a dead holder's lock is taken over, by exactly one taker."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ovqflex.training.lock import LOCK_FILE, RunLock, RunLockError

LOCK_PY = Path(__file__).parents[3] / "ovqflex" / "training" / "lock.py"
# a process that imports lock.py alone (no torch: starts in well under a second), waits for the file
# GO (when given), tries the lock, prints "won" or "lost: <error>", and holds what it won for HOLD seconds
TAKER = f"""
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("lock", {str(LOCK_PY)!r})
lock = importlib.util.module_from_spec(spec); spec.loader.exec_module(lock)
run_dir, go, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
while go != "-" and not os.path.exists(go):
    time.sleep(0.001)
try:
    held = lock.RunLock(run_dir).acquire()
    print("won", flush=True)
except lock.RunLockError as e:
    print("lost:", e, flush=True)
time.sleep(hold)
"""


def _taker(run_dir, go="-", hold=0.0):
    return subprocess.Popen([sys.executable, "-c", TAKER, str(run_dir), str(go), str(hold)], stdout=subprocess.PIPE,
                            text=True)


def test_second_writer_is_refused_with_the_holder_named(tmp_path):
    holder = _taker(tmp_path, hold=60)
    try:
        assert holder.stdout.readline() == "won\n"
        refused = RunLock(tmp_path)
        named = (f"{tmp_path} is in use by another writer: pid {holder.pid} on host {socket.gethostname()}, "
                 f"started .* \\(-c {re.escape(str(tmp_path))} - 60\\) \\(lock file .*{LOCK_FILE}")  # its argv
        with pytest.raises(RunLockError, match=named):
            refused.acquire()
        refused.release()  # what train's cleanup does after a refusal: the holder's lock file stays
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_lock_of_a_killed_holder_is_taken_over_and_released(tmp_path):
    holder = _taker(tmp_path, hold=60)
    assert holder.stdout.readline() == "won\n"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    stale = json.loads((tmp_path / LOCK_FILE).read_text())
    assert stale["pid"] == holder.pid  # the file outlives its process ...
    with RunLock(tmp_path):  # ... but not its lock
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists()
    RunLock(tmp_path).acquire().release()
    # a stale record longer than the new holder's is replaced whole, not overwritten in part
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": "h", "started": "x", "argv": ["a" * 9999]}))
    with RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_of_many_takers_of_a_stale_lock_exactly_one_wins(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": socket.gethostname(), "started": "x"}))
    go = tmp_path / "go"
    takers = [_taker(tmp_path, go, hold=2.0) for _ in range(6)]
    time.sleep(1.0)  # all started and waiting
    go.touch()
    results = [t.communicate(timeout=60)[0] for t in takers]
    assert sum(r == "won\n" for r in results) == 1, results
    assert all(r == "won\n" or r.startswith("lost:") and "in use by another writer" in r for r in results)


def test_a_holder_still_writing_its_record_is_named_once_it_has(tmp_path):
    """A second writer that finds the lock taken but the record not yet written waits for it briefly."""
    import fcntl
    import threading

    path = tmp_path / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, the record not written yet
        record = {"pid": 4242, "host": "elsewhere", "started": "now", "argv": ["ovqflex", "train"]}
        threading.Timer(0.2, lambda: os.write(fd, json.dumps(record).encode())).start()
        with pytest.raises(RunLockError, match="pid 4242 on host elsewhere, started now \\(ovqflex train\\)"):
            RunLock(tmp_path).acquire()
    finally:
        os.close(fd)


def test_a_lock_file_unlinked_between_open_and_flock_is_not_the_lock(tmp_path, monkeypatch):
    """The holder releases (unlinks) the file after a taker opened it and before it locked it: the taker
    holds a lock on a file no one else can find, so it must try again with a new file."""
    import fcntl

    real_flock, calls = fcntl.flock, []

    def flock(fd, op):
        calls.append(op)
        if len(calls) == 1:
            os.unlink(tmp_path / LOCK_FILE)  # the holder's release
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    (tmp_path / LOCK_FILE).write_text("{}")
    lock = RunLock(tmp_path).acquire()
    try:
        assert len(calls) == 2 and os.path.samestat(os.fstat(lock._fd), os.stat(tmp_path / LOCK_FILE))
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        lock.release()
