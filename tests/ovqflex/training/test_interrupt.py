"""``StopRequest`` and ``TrainingInterrupted`` (``ovqflex/training/interrupt.py``): the first signal is a
request the loop polls; in a distributed run every rank gets the same answer at the same steps. How a run
stops on one is tested with the trainer (``test_trainer.py``)."""
import signal
import threading
from pathlib import Path

import pytest
import torch

import ovqflex.training.interrupt as interrupt
from ovqflex.training.distributed import DistInfo
from ovqflex.training.interrupt import STOP_SIGNALS, StopRequest, TrainingInterrupted

CPU = torch.device("cpu")


def test_stop_request_restores_the_handlers_after_the_first_signal():
    """The first signal is caught and recorded; the handlers before it are back at once (a second
    Ctrl-C interrupts), and after the block."""
    before = signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        assert signal.getsignal(signal.SIGINT) == stop._handle and signal.getsignal(signal.SIGTERM) == stop._handle
        stop._handle(signal.SIGTERM, None)
        assert stop.signum == signal.SIGTERM and signal.getsignal(signal.SIGINT) is before
    assert signal.getsignal(signal.SIGINT) is before
    e = TrainingInterrupted(signal.SIGTERM, 7, Path("run/checkpoints/step_00000007"))
    assert isinstance(e, KeyboardInterrupt) and e.exit_code == 143
    assert str(e) == "stopped by SIGTERM after step 7: checkpoint run/checkpoints/step_00000007; continue with --resume"


def test_outside_the_main_thread_nothing_is_installed():
    """Python runs signal handlers in the main thread only (and refuses to install one elsewhere): a run
    trained from another thread keeps the handlers as they are and has no request of its own."""
    before = signal.getsignal(signal.SIGINT)
    seen, errors = [], []

    def run():
        try:
            with StopRequest() as stop:
                seen.append((signal.getsignal(signal.SIGINT), stop.requested(DistInfo(), CPU, True)))
        except Exception as e:  # (a thread's exception would not reach the test)
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not errors and seen == [(before, None)]


def test_a_single_process_answers_with_its_own_request_after_any_step():
    stop = StopRequest()
    assert stop.requested(DistInfo(), CPU, sync_point=False) is None
    stop.signum = signal.SIGINT
    assert stop.requested(DistInfo(), CPU, sync_point=False) == signal.SIGINT


@pytest.mark.parametrize("own, other, want", [
    (None, None, None),
    (signal.SIGINT, None, signal.SIGINT),
    (None, signal.SIGTERM, signal.SIGTERM),
    (signal.SIGTERM, signal.SIGINT, signal.SIGINT),
    (signal.SIGTERM, signal.SIGTERM, signal.SIGTERM),
], ids=["none", "own", "other-rank", "both-differ", "both-same"])
def test_a_distributed_run_answers_with_any_rank_s_request_at_sync_points_only(monkeypatch, own, other, want):
    """Between sync points no rank stops (each would stop after a different step); at one, the ranks' flags
    are summed and every rank answers the same signal: two different ones give the first of
    ``STOP_SIGNALS`` (SIGINT), so all ranks report the same exit status."""
    summed = []

    def all_reduce_with_another_rank(tensors, info):
        (flags,) = tensors
        assert flags.tolist() == [float(own == s) for s in STOP_SIGNALS] and info.world_size == 2
        if other is not None:
            flags[STOP_SIGNALS.index(other)] += 1
        summed.append(flags.tolist())

    monkeypatch.setattr(interrupt, "all_reduce_sum_", all_reduce_with_another_rank)
    stop = StopRequest()
    stop.signum = own
    info = DistInfo(rank=1, world_size=2)
    assert stop.requested(info, CPU, sync_point=False) is None and summed == []
    answer = stop.requested(info, CPU, sync_point=True)
    assert answer == want and len(summed) == 1 and (answer is None or type(answer) is int)
