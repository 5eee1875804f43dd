"""Stopping a training run cleanly on SIGINT (Ctrl-C) or SIGTERM (``kill``, a batch scheduler's
time limit, ``timeout``).

The first signal asks the loop to stop: the step in flight finishes, a checkpoint of it is
written (atomically, like every checkpoint) and :class:`TrainingInterrupted` is raised, so that
``--resume`` continues exactly where the run stopped. The handlers are restored at once, so a
second signal acts as it would without them (a second Ctrl-C raises ``KeyboardInterrupt``
immediately, a second SIGTERM terminates the process). A single process stops after the step in
flight; in a distributed run the ranks agree on the request at every logging step (one tiny
all-reduce where the loop syncs with the host anyway), so all of them stop after the same step.
"""
from __future__ import annotations

import signal
import threading
from pathlib import Path

import torch

from .distributed import DistInfo, all_reduce_sum_

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped on a signal after ``step``, with that step's checkpoint at ``checkpoint``
    (``None`` on the ranks that do not write); ``complete``: that was the last step (a signal
    during it still stops what called ``train``). A ``KeyboardInterrupt``, so code that lets
    Ctrl-C through lets this through too. ``exit_code``: the shell's ``128 + signal number``."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, complete: bool = False):
        self.signum, self.step, self.checkpoint, self.complete = signum, step, checkpoint, complete
        name = signal.Signals(signum).name
        where = f": checkpoint {checkpoint}" if checkpoint is not None else ""
        then = "the run is complete" if complete else "continue with --resume"
        super().__init__(f"stopped by {name} after {'its last ' if complete else ''}step {step:,}{where}; {then}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopRequest:
    """Context manager that turns the first SIGINT/SIGTERM into a request the loop polls with
    :meth:`requested` after each step. Installs nothing outside the main thread (Python delivers
    signals there only); ``requested`` then reports only the other ranks' requests."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        self._restore()  # a second signal is not caught: Ctrl-C twice stops at once

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def requested(self, info: DistInfo, device: torch.device, sync_point: bool) -> int | None:
        """The signal that asked to stop, else None. A single process answers with its own request
        after any step; a distributed run only at ``sync_point`` steps (the same on every rank),
        where it answers with any rank's request."""
        if not info.enabled:
            return self.signum
        if not sync_point:
            return None
        flags = torch.zeros(len(STOP_SIGNALS), device=device)
        if self.signum is not None:
            flags[STOP_SIGNALS.index(self.signum)] = 1
        all_reduce_sum_([flags], info)
        asked = flags.nonzero().flatten().tolist()
        return None if not asked else int(STOP_SIGNALS[asked[0]])
