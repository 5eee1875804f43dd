"""``compare_cases``: the one timing table of the op and recurrent scenarios."""
import os

import pytest
import torch

import ovqflex.bench.measure as measure_mod
from ovqflex.bench.measure import Measurement, compare_cases

REAL_MEASURE = measure_mod.measure  # (the autouse fixture below replaces it in the other tests)
SECONDS = {"op fwd": 0.01, "op reference loop fwd": 0.04, "sdpa causal fwd": 0.02, "a": 0.5}


@pytest.fixture(autouse=True)
def fixed_times(monkeypatch):
    """``measure`` runs the case once and reports its time from SECONDS (no clock in the test), its
    fastest run half that."""
    def fake(fn, *, device, repeats):
        fn()
        return Measurement(seconds=SECONDS[fn.__name__], seconds_min=SECONDS[fn.__name__] / 2, peak_mb=1.0)
    monkeypatch.setattr(measure_mod, "measure", fake)


def _case(name):
    def fn():
        pass
    fn.__name__ = name
    return fn


def _broken():
    raise RuntimeError("lowering failed: no valid choices\n  target: flex_attention\n\n"
                       "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace")


def test_rows_carry_ratios_to_their_reference_and_the_baseline(capsys):
    cases = [("op fwd", _case("op fwd"), 2e9), ("op reference loop fwd", _case("op reference loop fwd"), 2e9),
             ("sdpa causal fwd", _case("sdpa causal fwd"), 1e9), ("op bwd", _broken)]
    rows = compare_cases(64, cases, torch.device("cpu"), repeats=2, peak_gflops=100.0,
                         reference_of=lambda name: "op reference loop fwd" if name == "op fwd" else None)
    by = {r["case"]: r for r in rows}
    assert [r["case"] for r in rows] == [c[0] for c in cases]
    fwd = by["op fwd"]  # ratios and rates of the median times
    assert fwd["x_vs_reference"] == pytest.approx(4.0) and fwd["x_vs_sdpa"] == pytest.approx(2.0)
    assert fwd["gflops"] == pytest.approx(200.0) and fwd["pct_matmul_peak"] == pytest.approx(200.0)
    assert by["op reference loop fwd"]["x_vs_reference"] is None and by["sdpa causal fwd"]["x_vs_sdpa"] == 1.0
    assert by["op bwd"] == {"T": 64, "case": "op bwd", "error": "RuntimeError: lowering failed: no valid choices"}
    err = capsys.readouterr().err  # the failed case's whole traceback is in the log
    assert "Traceback" in err and "in _broken" in err and "target: flex_attention" in err


def test_rows_without_flops_or_baseline_have_no_rates():
    rows = compare_cases(8, [("a", _case("a"))], torch.device("cpu"), repeats=1)
    assert rows[0]["x_vs_sdpa"] is None and rows[0]["x_vs_reference"] is None and "gflops" not in rows[0]


def test_the_memory_run_hands_timing_back_a_warmed_up_allocator(monkeypatch):
    """``measure``'s CPU memory run fixes glibc's mmap threshold at 128 KiB while it samples RSS
    (so RSS follows the live tensors) and then sets the thresholds a warmed-up process reaches:
    the 128 KiB threshold once stayed for the rest of the process, and every later timed run
    faulted its large buffers in anew (a decode step after a profile's first memory measurement
    ran up to 3.5x slower). Before sampling, the heap's free pages go back to the system (the warm
    thresholds keep them, and reused resident pages would not show in RSS). The timed runs come
    first and set nothing."""
    calls = []
    monkeypatch.setattr(measure_mod, "_glibc", lambda name, *args: calls.append((name, *args)))
    timed = []
    m = REAL_MEASURE(lambda: timed.append(list(calls)) or torch.ones(1 << 18).sum(), device="cpu", repeats=2,
                     warmup=1)
    assert timed[:3] == [[], [], []]
    mmap, trim = measure_mod._M_MMAP_THRESHOLD, measure_mod._M_TRIM_THRESHOLD
    assert calls == [("mallopt", mmap, 128 * 1024), ("mallopt", trim, 128 * 1024), ("malloc_trim", 0),
                     ("mallopt", mmap, measure_mod._WARM_MMAP), ("mallopt", trim, measure_mod._WARM_TRIM)]
    assert m.peak_mb >= 0 and m.seconds > 0


@pytest.mark.parametrize("warmup", [0, 1, 2], ids=["no-warmup", "one-warmup", "two-warmups"])
def test_the_first_call_is_timed_apart(warmup):
    """``first_s`` is the first call (a compiled case's compile), kept out of the median: a first call
    0.2 s slower than the others shows there and not in ``seconds`` once a warm-up absorbs it."""
    import time

    calls = []

    def fn():
        calls.append(None)
        if len(calls) == 1:
            time.sleep(0.2)

    m = REAL_MEASURE(fn, device="cpu", repeats=3, warmup=warmup)
    assert len(calls) == warmup + 3 + 1  # warm-ups, timed runs, the memory run
    assert m.first_s >= 0.2
    if warmup:
        assert m.seconds < 0.2


def test_seconds_is_the_median_of_the_timed_runs():
    """One timed run 0.3 s slower than the others moves the median not at all (the mean by 0.1 s)."""
    import time

    calls = []

    def fn():
        calls.append(None)
        if len(calls) == 3:  # the warm-up, then the second of three timed runs
            time.sleep(0.3)

    m = REAL_MEASURE(fn, device="cpu", repeats=3, warmup=1)
    assert m.seconds < 0.1 and m.seconds_min <= m.seconds
    calls.clear()
    spread = REAL_MEASURE(lambda: calls.append(None) or time.sleep(0.1 * max(len(calls) - 2, 0)), device="cpu",
                          repeats=3, warmup=1)  # timed runs of 0, 0.1 and 0.2 s: the median, not the fastest
    assert 0.1 <= spread.seconds < 0.2 and spread.seconds_min < 0.1


@pytest.mark.parametrize("warmup", [0, 1], ids=["no-warmup", "one-warmup"])
def test_the_first_call_counts_the_graphs_it_compiled(warmup):
    """``first_graphs``: the graphs dynamo compiled during the first call. A static compiled function compiles
    one per new shape and none for a shape it has met; with dynamic shapes the second length compiles the
    symbolic graph and the third reuses it (what a bench row's ``graphs_first_call`` shows)."""
    torch._dynamo.reset()
    static = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    firsts = [REAL_MEASURE(lambda: static(torch.ones(n)), device="cpu", repeats=1, warmup=warmup).first_graphs
              for n in (3, 5, 3)]
    assert firsts == [1, 1, 0]
    default = torch.compile(lambda x: x * 3 - 1, backend="eager")
    firsts = [REAL_MEASURE(lambda: default(torch.ones(n)), device="cpu", repeats=1, warmup=warmup).first_graphs
              for n in (3, 5, 7)]
    assert firsts == [1, 1, 0]


@pytest.mark.parametrize("warmup", [0, 1], ids=["no-warmup", "one-warmup"])
def test_graphs_compiled_in_the_timed_runs_are_counted_and_reported(warmup, capsys):
    """``timed_graphs``: graphs compiled after the first call, in the runs whose median is reported (a
    case whose later runs meet new shapes times compiles); 0 for a function compiled in its first call."""
    torch._dynamo.reset()
    static = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    sizes = iter(range(1, 10))
    growing = REAL_MEASURE(lambda: static(torch.ones(next(sizes))), device="cpu", repeats=3, warmup=warmup)
    assert growing.timed_graphs == 3 - (warmup == 0)  # one graph per new shape, the first call's apart
    assert "graph(s) compiled during the timed runs" in capsys.readouterr().err
    same = REAL_MEASURE(lambda: static(torch.ones(20)), device="cpu", repeats=3, warmup=warmup)
    assert same.first_graphs == 1 and same.timed_graphs == 0
    assert "compiled during the timed runs" not in capsys.readouterr().err


def test_fresh_compile_caches_point_inductor_at_an_empty_directory_and_restore_it(monkeypatch):
    """Inside the block inductor writes what it compiles under a new temporary directory (so a compile
    there is cold); after it the directory is gone and the caches are back where they were (inductor's
    own default when none was set)."""
    from ovqflex.bench.runner import fresh_compile_caches

    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with fresh_compile_caches():
        root = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert os.environ["TRITON_CACHE_DIR"].startswith(root) and not os.listdir(root)
        fn = torch.compile(lambda x: x * 3.0 + 1.0, fullgraph=True, dynamic=False)
        torch.testing.assert_close(fn(torch.arange(7.0)), torch.arange(7.0) * 3 + 1)
        assert any(files for _, _, files in os.walk(root))
    assert not os.path.exists(root)
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/else"
    assert not os.environ.get("TORCHINDUCTOR_CACHE_DIR", "").startswith(root)


def test_saved_for_backward_counts_what_the_graph_keeps_beyond_the_inputs():
    """``exp`` keeps its (new) result and ``sin`` its input: 1 MB of 256k fp32 kept beyond the input; under
    no_grad as under grad; a tensor saved twice counts once."""
    from ovqflex.bench.measure import saved_for_backward_mb

    x = torch.randn(1 << 18, requires_grad=True)
    with torch.no_grad():
        assert saved_for_backward_mb(lambda: (x * 2).exp().sin(), [x]) == pytest.approx(1.0)
    assert saved_for_backward_mb(lambda: x.sin() + x.cos(), [x]) == 0.0
    assert saved_for_backward_mb(lambda: x.sin() + x.cos()) == pytest.approx(1.0)
    assert saved_for_backward_mb(lambda: x.sin() + x.view(-1).cos()) == pytest.approx(1.0)  # one storage, two views


def test_peak_memory_is_the_growth_over_the_run():
    """On the CPU: the resident set's growth above its level before the run, about 64 MB for a run that holds
    a 64 MB tensor for 50 ms and about 0 for one that allocates nothing (not the process's whole RSS)."""
    import time

    def hold():
        t = torch.ones(16 * 2**20)  # 64 MB of fp32, every page written
        time.sleep(0.05)
        return t.sum()

    held = REAL_MEASURE(hold, device="cpu", repeats=1, warmup=0)
    idle = REAL_MEASURE(lambda: None, device="cpu", repeats=1, warmup=0)
    assert 60 <= held.peak_mb < 100 and idle.peak_mb < 8


def test_the_matmul_rate_is_measured_once_per_device_and_size(monkeypatch):
    """A run's header and every table's efficiency share one denominator (the first measurement)."""
    calls = []

    def fake(fn, *, device, repeats, warmup):
        calls.append((str(device), repeats))
        return Measurement(seconds=0.2, seconds_min=0.1, peak_mb=0.0)

    monkeypatch.setattr(measure_mod, "measure", fake)
    monkeypatch.setattr(measure_mod, "_MATMUL_GFLOPS", {})
    rate = measure_mod.matmul_gflops("cpu", n=64)
    assert rate == pytest.approx(2 * 64**3 / 0.1 / 1e9)  # from the best of the timed products
    assert measure_mod.matmul_gflops(torch.device("cpu"), n=64) == rate and len(calls) == 1
    measure_mod.matmul_gflops("cpu", n=32)
    assert len(calls) == 2


def test_relative_error_is_the_norm_of_the_difference_over_the_references():
    from ovqflex.bench.measure import relative_error

    ref = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    assert relative_error(ref * 1.5, ref) == 0.5 and relative_error(ref, ref) == 0.0
    assert relative_error(ref + torch.tensor([[0.0, 1.0], [0.0, 0.0]]), ref.to(torch.bfloat16)) == 0.2  # mixed dtypes
