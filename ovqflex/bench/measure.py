"""Time and peak-memory measurement shared by benchmarks.

Peak memory: on CUDA the allocator's peak; on CPU the peak resident-set growth
over the run, sampled from ``/proc/self/statm`` by a background thread (large
torch CPU buffers are mmap-backed, so frees return to the OS and RSS follows
the live tensors). Both are reported in MB above the level before the run.
"""
from __future__ import annotations

import gc
import os
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from ..compile_watch import compile_counts
from ..devices import failure_line, sync

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_RSS_MMAP = 128 * 1024  # while RSS is sampled: every buffer above this in its own mapping
# afterwards: glibc's own dynamic maxima (64-bit), what a warmed-up process converges to
_WARM_MMAP, _WARM_TRIM = 32 * 2**20, 64 * 2**20


def _glibc(name: str, *args: int) -> None:
    """Call glibc's malloc tuning function ``name`` (``mallopt``, ``malloc_trim``); elsewhere
    nothing (not glibc: RSS is what it is)."""
    try:
        import ctypes

        getattr(ctypes.CDLL("libc.so.6"), name)(*args)
    except (OSError, AttributeError):
        pass


def _mallopt(param: int, value: int) -> None:
    _glibc("mallopt", param, value)


def _allocator_for_rss() -> None:
    """glibc raises its mmap threshold after large frees, after which big buffers come from the
    heap and reuse pages already resident — RSS would then under-report. While RSS is sampled the
    threshold is fixed at 128 KiB, so every large tensor has its own mapping (and its free returns
    the pages), and the heap's free pages (kept by the timed runs) go back to the system first, so
    the small buffers' pages count too."""
    _mallopt(_M_MMAP_THRESHOLD, _RSS_MMAP)
    _mallopt(_M_TRIM_THRESHOLD, _RSS_MMAP)
    _glibc("malloc_trim", 0)


def _allocator_for_timing() -> None:
    """Undo :func:`_allocator_for_rss` for what is timed next. Its fixed threshold is costly: every
    large buffer is mapped and faulted in anew (a decode step of one small layer ran up to 3.5x
    slower, a tiny model trains ~1/3 slower), and glibc cannot go back to its dynamic threshold
    once one is set, so the thresholds go to the values the dynamic one reaches in a warmed-up
    process (mmap 32 MiB, trim twice that)."""
    _mallopt(_M_MMAP_THRESHOLD, _WARM_MMAP)
    _mallopt(_M_TRIM_THRESHOLD, _WARM_TRIM)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:  # not Linux: fall back to the (monotone) max RSS
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _RssSampler:
    def __init__(self, interval: float = 0.001):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def __enter__(self):
        _allocator_for_rss()
        gc.collect()
        self.base = self.peak = _rss_bytes()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_bytes())
        _allocator_for_timing()

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / 2**20


@dataclass
class Measurement:
    seconds: float  # median over repeats
    seconds_min: float
    peak_mb: float  # peak memory growth during one run
    first_s: float | None = None  # the first call (a compiled case's compile, when the process has not compiled it)
    first_graphs: int = 0  # graphs dynamo compiled during the first call (0: every graph it ran was compiled before)
    timed_graphs: int = 0  # graphs dynamo compiled during the timed runs after the first call (0 unless a case is wrong)


def measure(fn, *, device: torch.device | str = "cpu", repeats: int = 3, warmup: int = 1) -> Measurement:
    """Median wall time of ``fn()`` over ``repeats`` runs (after ``warmup``), its peak memory, and the wall
    time of its first call (synchronized: the first warm-up, or with ``warmup=0`` the first timed run)
    with the number of graphs dynamo compiled in it (a new length that a compiled op serves without
    recompiling shows 0). Graphs compiled in the timed runs after the first call (``timed_graphs``)
    mean the times include compiles: a line on stderr says so."""
    device = torch.device(device)
    first, graphs_before = None, _compiled_graphs()
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        if first is None:
            sync(device)
            first, first_graphs = time.perf_counter() - t0, _compiled_graphs() - graphs_before
    sync(device)
    times, graphs_timed = [], None
    not_first = 0 if warmup else 1  # with no warm-up the first timed run is the first call
    for i in range(repeats):
        if i == not_first:
            graphs_timed = _compiled_graphs()
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    timed_graphs = 0 if graphs_timed is None else _compiled_graphs() - graphs_timed
    if timed_graphs:
        progress(f"warning: {timed_graphs} graph(s) compiled during the timed runs: these times include compiles")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        with _RssSampler() as s:
            fn()
        peak = s.growth_mb
    if first is None:  # no warm-up: the first timed run (graphs counted over the timed runs: a repeat compiles none)
        first, first_graphs = times[0], _compiled_graphs() - graphs_before
    return Measurement(statistics.median(times), min(times), peak, first, first_graphs, timed_graphs)


def _compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return compile_counts().graphs


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` (Frobenius norms, computed in float64): how far a scenario's output is from its
    reference (a loop, a full forward, an fp32 model)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def saved_for_backward_mb(fn, inputs=()) -> float:
    """MB that autograd keeps for the backward of what ``fn()`` builds (run once, grad enabled): the
    distinct storages of the tensors its graph saves, less those of ``inputs`` (alive anyway). What each
    such op adds to a model's peak in training, layer after layer, whatever the device's transients."""
    keep = {x.untyped_storage().data_ptr() for x in inputs}
    saved: dict[int, int] = {}

    def pack(x):
        storage = x.untyped_storage()
        if storage.data_ptr() not in keep:
            saved[storage.data_ptr()] = storage.nbytes()
        return x

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn()
    del out
    return sum(saved.values()) / 2**20


#: matmul rates measured so far in this process: (device, n) -> GFLOP/s
_MATMUL_GFLOPS: dict[tuple[str, int], float] = {}


def matmul_gflops(device: torch.device | str = "cpu", n: int | None = None) -> float:
    """The machine's fp32 matmul rate (GFLOP/s): the best of 7 timed ``n x n`` products (``n``: 2,048 on a
    CPU, 8,192 on a GPU, large enough to run near the peak), the denominator of every FLOP efficiency.
    Measured once per process, device and ``n`` (the first call): a bench run's header and all its
    tables share one figure, where measuring again per scenario gave figures up to 1.7x apart on a
    2-core machine (an efficiency of 142% "of the peak")."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 2048)
    key = (str(device), n)
    if key not in _MATMUL_GFLOPS:
        a = torch.randn(n, n, device=device)
        b = torch.randn(n, n, device=device)
        m = measure(lambda: a @ b, device=device, repeats=7, warmup=2)
        _MATMUL_GFLOPS[key] = 2 * n**3 / m.seconds_min / 1e9
    return _MATMUL_GFLOPS[key]


_STARTED = time.perf_counter()


def progress(what: str, seconds: float | None = None) -> None:
    """One line on stderr as a benchmark case finishes: a GPU profile compiles and runs for minutes,
    and a run cut short still shows how far it got (``seconds``: the case's measured time)."""
    took = "" if seconds is None else f": {seconds * 1e3:.4g} ms"
    print(f"[bench {time.perf_counter() - _STARTED:7.1f} s] {what}{took}", file=sys.stderr, flush=True)


def compare_cases(T: int, cases: list[tuple], device: torch.device, repeats: int, *, peak_gflops: float | None = None,
                  reference_of=lambda name: "reference loop fwd",
                  baseline_of=lambda name: "sdpa causal fwd") -> list[dict]:
    """Time ``cases`` — ``(name, fn)`` or ``(name, fn, model FLOPs)`` — in this process, one row each.

    Every row carries its speed-up over its baseline case ``baseline_of(name)`` (``x_vs_sdpa``) and
    over its reference case ``reference_of(name)`` (``x_vs_reference``; None where that case is absent or
    None), the wall time of its first call (``first_call_s``: a compiled case's compile) and the graphs
    compiled in it (``graphs_first_call``); with FLOPs
    and ``peak_gflops`` (the matmul rate measured on the spot) also its GFLOP/s and FLOP efficiency. A
    case that fails (e.g. a compile error) is a row with its ``error`` (one line:
    :func:`~ovqflex.devices.failure_line`), not a crash; its whole traceback goes to stderr, the run's log."""
    results, failed, rows = {}, {}, []
    for name, fn, *_ in cases:
        try:
            results[name] = measure(fn, device=device, repeats=repeats)
        except Exception as e:  # a compile failure is a result to report, not a crash
            failed[name] = failure_line(e)
            progress(f"T={T} {name}: {failed[name]}")
            traceback.print_exception(e, file=sys.stderr)  # the whole of it in the run's log
        else:
            progress(f"T={T} {name}", results[name].seconds)
    for name, _, *flops in cases:
        if name in failed:
            rows.append({"T": T, "case": name, "error": failed[name]})
            continue
        m, ref, base = results[name], results.get(reference_of(name)), results.get(baseline_of(name))
        row = {"T": T, "case": name, "time_s": m.seconds, "first_call_s": m.first_s,
               "graphs_first_call": m.first_graphs, "peak_mb": m.peak_mb,
               "x_vs_reference": ref.seconds / m.seconds if ref else None,
               "x_vs_sdpa": base.seconds / m.seconds if base else None}
        if flops and peak_gflops:
            gflops = flops[0] / m.seconds / 1e9
            row.update(gflops=gflops, pct_matmul_peak=100 * gflops / peak_gflops)
        rows.append(row)
    return rows
