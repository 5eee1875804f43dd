"""One writer per run directory: ``DIR/run.lock``.

``ovqflex train`` (rank 0 under torchrun: the only rank that writes) holds an exclusive
``flock`` on ``DIR/run.lock`` for as long as it runs, and writes its pid, host name, start
time and command line into the file. A second writer finds the lock taken and is refused with
an error naming the holder. The kernel releases a ``flock`` when its process dies, however it
dies (``kill -9`` included), so a lock left by a dead process is taken over by the next run
atomically: of two processes that find the same stale file, exactly one gets the lock. A
released lock file is unlinked; a process that locked a file which was meanwhile unlinked (or
replaced) sees that its inode is no longer ``DIR/run.lock`` and tries again.

No torch here: the lock tests import this module alone in subprocesses.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

LOCK_FILE = "run.lock"
log = logging.getLogger("ovqflex")


class RunLockError(ValueError):
    """The run directory is in use by another writer."""


def _holder(path: Path) -> str:
    """Who holds ``path``, from what it wrote there (it may still be writing: retry briefly)."""
    for _ in range(20):
        try:
            info = json.loads(path.read_text())
            return (f"pid {info['pid']} on host {info['host']}, started {info['started']} "
                    f"({' '.join(info.get('argv', []))})")
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.05)
    return "a process that has not written its pid yet"


class RunLock:
    """The exclusive lock of one run directory; :meth:`release` (or ``with``) gives it back."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        try:
            import fcntl
        except ImportError:  # not POSIX: no flock; say so instead of pretending
            log.warning("ovqflex: no fcntl.flock on this platform: %s is not locked against a second writer",
                        self.path.parent)
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunLockError(f"run directory {self.path.parent} is in use by another writer: "
                                   f"{_holder(self.path)} (lock file {self.path}); wait for it to finish "
                                   f"or choose another --out") from None
            except OSError as e:  # a filesystem without flock
                os.close(fd)
                raise RunLockError(f"cannot lock {self.path}: {e} (a filesystem without flock?)") from None
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder released (unlinked) it between our open and flock: again
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(info) + "\n").encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink()  # while still locked: a waiter that opened it sees a stale inode
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
