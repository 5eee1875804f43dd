"""Schedules: the learning rate and the length warm-up, pure functions of the step."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ovqflex.training.schedule import length_at, lr_at


def test_lr_warms_up_linearly_then_decays_to_min_lr():
    """Steps 0-3 warm up to the peak; the 10 steps after them follow half a cosine from the peak (step 4)
    towards min_lr, which step ``total`` (one past the last) reaches: step 9, half way, is the mean."""
    lrs = [lr_at(s, lr=1.0, min_lr=0.1, warmup=4, total=14) for s in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert lrs[4:] == pytest.approx([0.1 + 0.9 * (1 + math.cos(math.pi * j / 10)) / 2 for j in range(10)])
    assert lrs[4] == 1.0 and lrs[9] == pytest.approx(0.55)
    assert lr_at(14, lr=1.0, min_lr=0.1, warmup=4, total=14) == pytest.approx(0.1)
    assert [lr_at(s, lr=1.0, min_lr=0.1, warmup=4, total=14) for s in (15, 20, 24)] == [0.1] * 3  # stays there


def test_length_warmup_text():
    from ovqflex.training.schedule import length_warmup_text

    assert length_warmup_text((), 0) == ""
    assert length_warmup_text((256, 512, 1024), 1500) == " (first 256, 512, 1,024 tokens over 1,500 steps)"


def test_length_warmup_takes_each_length_in_turn_then_seq_len():
    lengths = [length_at(s, seq_len=1024, lengths=(128, 256, 512), warmup_steps=10) for s in range(12)]
    assert lengths == [128] * 4 + [256] * 3 + [512] * 3 + [1024] * 2
    assert [length_at(s, seq_len=64, lengths=(), warmup_steps=0) for s in range(3)] == [64] * 3


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 6), extra=st.integers(0, 50), after=st.integers(1, 5))
def test_length_warmup_shares_are_equal_to_within_a_step(n, extra, after):
    """Every warm-up length gets ``floor`` or ``ceil`` of ``warmup_steps / n`` consecutive steps, in
    increasing order, and every step after the warm-up is at ``seq_len``."""
    lengths, warmup_steps = tuple(16 * 2**i for i in range(n)), n + extra
    seq_len = 16 * 2**n
    got = [length_at(s, seq_len=seq_len, lengths=lengths, warmup_steps=warmup_steps)
           for s in range(warmup_steps + after)]
    counts = [got.count(v) for v in lengths]
    assert got == sorted(got) and got[warmup_steps:] == [seq_len] * after
    assert sum(counts) == warmup_steps and max(counts) - min(counts) <= 1 and min(counts) >= 1
