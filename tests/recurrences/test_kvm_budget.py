"""KVM state budgets (docs/design.md §4.3): the state length each query chunk reads."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from recurrences.kvm import KVMBudget, KVMSchedule, kvm_state_sizes
from recurrences.kvm.budget import _chunks_within


def test_front_and_initial_state():
    # T <= Nb*C: front only, no state; then the initial state is exactly one chunk
    assert kvm_state_sizes(100, 16, 7) == [0] * 7
    assert kvm_state_sizes(64, 16, 4) == [0] * 4
    assert kvm_state_sizes(65, 16, 4) == [0, 0, 0, 0, 16]
    assert kvm_state_sizes(0, 16, 2) == []


def test_fixed_budget_keeps_one_chunk_by_default_and_honours_state_min_len():
    assert kvm_state_sizes(16 * 10, 16, 2) == [0, 0] + [16] * 8
    # state_min_len 40, capped at 3 chunks = 48: grows by at most C per chunk, at most what has left the window
    sizes = kvm_state_sizes(16 * 8, 16, 2, KVMBudget("fixed", state_min_len=40, max_state_chunks=3))
    assert sizes == [0, 0, 16, 32, 40, 40, 40, 40]
    assert kvm_state_sizes(16 * 6, 16, 2, KVMBudget("fixed", state_min_len=100, max_state_chunks=2))[-1] == 32


def test_power_law_sqrt16_follows_the_budget_exactly_over_4096_tokens():
    C = 128
    sizes = kvm_state_sizes(4096 + C, C, 2, KVMBudget("power_law", growth_factor=16.0, growth_exponent=0.5,
                                                      max_state_chunks=None))
    assert sizes[:4] == [0, 0, 128, 256]  # initial chunk, then growth capped by the C tokens that overflowed
    for c in range(4, len(sizes)):  # from chunk 4 on, the state is exactly floor(16 sqrt(ctx)), ctx = c*C
        assert sizes[c] == math.floor(16 * math.sqrt(c * C)), c
    assert sizes[-1] == 1024  # ctx = 4096


def test_power_law_rounding_and_minimum():
    b = KVMBudget("power_law", growth_factor=16.0, growth_exponent=0.5, round_down=64, state_min_len=200,
                  max_state_chunks=None)
    assert b.rows(4096, 128) == 1024 and b.rows(3968, 128) == 960 and b.rows(100, 128) == 200


def test_saturation_budget():
    b = KVMBudget("saturation", saturation_n=1024, round_down=8, max_state_chunks=None)
    assert b.rows(1024, 128) == 512 and b.rows(3000, 128) == 760  # floor(1024*3000/4024)=763 -> 760
    sizes = kvm_state_sizes(128 * 40, 128, 2, b)
    assert sizes[-1] == (1024 * 39 * 128 // (1024 + 39 * 128)) // 8 * 8
    assert all(a <= b_ for a, b_ in zip(sizes, sizes[1:])), "the state never shrinks"


@pytest.mark.parametrize("kw, match", [
    (dict(budget="exp"), "budget"), (dict(round_down=0), "round_down"), (dict(saturation_n=0), "saturation_n"),
    (dict(max_state_chunks=0), "max_state_chunks"), (dict(growth_factor=-1.0), "growth_factor"),
    (dict(state_min_len=-1), "state_min_len"),
], ids=["budget", "round", "sat", "cap", "factor", "min"])
def test_bad_budget(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        KVMBudget(**kw)


SCHEDULE_BUDGETS = {
    "fixed": KVMBudget(),
    "fixed-min-uncapped": KVMBudget("fixed", state_min_len=40, max_state_chunks=None),
    "power_law": KVMBudget("power_law", growth_factor=4.0, max_state_chunks=None),
    "power_law-capped": KVMBudget("power_law", growth_factor=6.0, growth_exponent=0.6, round_down=8,
                                  max_state_chunks=3),
    "power_law-flat": KVMBudget("power_law", growth_factor=30.0, growth_exponent=0.0, max_state_chunks=None),
    "saturation": KVMBudget("saturation", saturation_n=100, round_down=4, max_state_chunks=None),
}


@settings(max_examples=60, deadline=None)
@given(budget=st.sampled_from(sorted(SCHEDULE_BUDGETS)), C=st.sampled_from([16, 32]), Nb=st.integers(1, 3),
       n=st.sampled_from([0, 1, 3, 63, 64, 65, 130, 300]))
def test_schedule_views_agree_with_the_recurrence(budget, C, Nb, n):
    """Every view of a schedule is the recurrence's list: ``sizes`` (read from a table of a power of two of
    chunks, of which every shorter schedule is a prefix), ``size(c)``, ``rows`` (the largest) and ``live``
    (the opaque op's tensor)."""
    b = SCHEDULE_BUDGETS[budget]
    schedule, sizes = KVMSchedule(C, Nb, b), kvm_state_sizes(n * C, C, Nb, b)
    long = kvm_state_sizes(1000 * C, C, Nb, b)
    assert len(sizes) == n and sizes == long[:n]
    assert schedule.sizes(n) == sizes and [schedule.size(c) for c in range(n)] == sizes
    assert schedule.rows(n) == max(sizes, default=0)
    live = schedule.live(n, "cpu")
    assert live.dtype == torch.long and live.tolist() == sizes


@pytest.mark.parametrize("budget", sorted(SCHEDULE_BUDGETS))
def test_bound_is_the_largest_size_any_length_reaches(budget):
    """``bound``: the sizes reach it and never pass it (None: they pass any number); below it,
    ``_chunks_within(r)`` counts the leading chunks that read at most ``r`` rows, what a bucket of a
    symbolic length compares the chunk count with."""
    C, Nb = 16, 2
    schedule = KVMSchedule(C, Nb, SCHEDULE_BUDGETS[budget])
    sizes = schedule.sizes(20000)
    if schedule.bound is None:
        assert budget == "power_law" and sizes[-1] > 500
    else:
        assert max(sizes) == schedule.bound == sizes[-1]
    for rows in (0, 1, 16, 17, 40, 64, 100):
        if schedule.bound is None or rows < schedule.bound:
            assert _chunks_within(rows, *schedule.args()) == sum(s <= rows for s in sizes), rows


def test_schedule_refuses_bad_arguments_by_name():
    with pytest.raises(ValueError, match="chunk_size must be a positive multiple of 16, got 10"):
        KVMSchedule(10, 2)
    with pytest.raises(ValueError, match="n_bswa_chunks must be >= 1, got 0"):
        KVMSchedule(16, 0)
    with pytest.raises(TypeError, match="budget must be a KVMBudget"):
        KVMSchedule(16, 2, "fixed")
