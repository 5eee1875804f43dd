"""Load a benchmark profile (TOML), run its scenarios, print a table, write JSON.

Every run also measures the machine's fp32 matmul rate once (``meta.matmul_gflops``, the
denominator of every scenario's FLOP-based efficiency: :func:`~.measure.matmul_gflops`), fits log-log slopes of time and
peak memory vs T for every series with two or more lengths (a series: rows of one
scenario and case, or of scenarios sharing a ``series = "..."`` key) (printed, ``fits`` in the
JSON) and plots them (``<name>.png``). A profile::

    name = "blockmask"
    description = "..."
    [[scenario]]
    kind = "blockmask"      # a key of ovqflex.bench.scenarios.KINDS
    seq_len = 65536
    ...

Each scenario table is checked against its kind's schema (``ovqflex.bench.scenarios``) when the
profile loads: unknown keys (with the nearest valid one), missing keys, wrong types and bad values
(a size of 0, a chunk size the method refuses, an unknown mixer or backend: each kind builds the
options, layers and configs its run will build) are refused by name before anything runs.

Progress goes to stderr, a line per scenario and per measured case (a GPU profile compiles and
runs for minutes); after each scenario but the last the rows so far are written to the JSON with
``meta.partial = true``, so a run cut short keeps what it measured.

A run may replace the lengths of its scenarios (``seq_lens``, ``ovqflex bench --seq-lens 65536``): every
chosen scenario must have a ``seq_lens`` list, and ``meta.seq_lens`` records the override. A GPU
profile's scenario that compiles and measures four lengths for ten minutes can so run one length at a
time, under a job's time limit, each run's JSON complete.

Compile times (the ``first_call_s`` of compiled cases) depend on the compile caches on disk: by default
the run uses them as it finds them (``meta.compile_cache = "as found"``); with
``fresh_compile_cache=True`` (``ovqflex bench --fresh-compile-cache``) inductor's and Triton's caches
are an empty temporary directory for the run, so every graph compiles as in a user's first run.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
from pathlib import Path

import torch
from tabulate import tabulate

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from recurrences.checks import check_keys

from ..devices import AUTO, resolve_device
from .fit import fit_rows, plot_loglog
from .measure import matmul_gflops, progress
from .scenarios import KINDS, parse_scenario
from .scenarios.base import check_sizes

PROFILE_KEYS = ("name", "description", "scenario")


def load_profile(path: str | Path) -> dict:
    """The profile at ``path`` with its ``scenario`` tables parsed into their kinds' schemas."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a TOML file" if path.is_dir() else "does not exist"
        raise FileNotFoundError(f"profile {str(path)!r} {what}")
    try:
        prof = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"profile {str(path)!r} is not valid TOML: {e}") from e
    check_keys(f"profile {str(path)!r}", prof, PROFILE_KEYS)
    scenarios = prof.get("scenario")
    if not isinstance(scenarios, list) or not scenarios:
        raise ValueError(f"profile {str(path)!r} has no [[scenario]] tables")
    prof["scenario"] = [parse_scenario(sc, f"scenario {i} ({sc.get('name', sc.get('kind'))!r}) of {str(path)!r}")
                        for i, sc in enumerate(scenarios)]
    prof.setdefault("name", path.stem)
    return prof


def fresh_compile_caches():
    """A context in which inductor's and Triton's caches are a new empty temporary directory (removed
    after) and inductor's in-memory caches are cleared on entry and exit, so what compiles in it
    compiles from nothing: torch's own ``torch._inductor.utils.fresh_cache`` (``fresh_inductor_cache``
    before torch 2.8)."""
    from torch._inductor import utils

    return (getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache)()


def run_profile(path: str | Path, *, device: str = AUTO, out_dir: str | Path = "bench-out",
                only: str | None = None, fresh_compile_cache: bool = False,
                seq_lens: list[int] | None = None) -> list[dict]:
    """Run the profile at ``path`` on ``device`` (:func:`ovqflex.devices.resolve_device`), the scenarios
    whose name contains ``only`` (all by default; ``ValueError`` if none does); print the table and
    slopes, write JSON and plot to ``out_dir``; returns the rows. ``fresh_compile_cache``: compile with
    empty caches (:func:`fresh_compile_caches`), so compiled cases' ``first_call_s`` is a cold compile.
    ``seq_lens``: these lengths, in this order, in place of each chosen scenario's ``seq_lens``
    (:func:`with_seq_lens`)."""
    prof = load_profile(path)
    chosen = [sc for sc in prof["scenario"] if not only or only in (sc.name or sc.kind)]
    if not chosen:  # before anything runs: an empty run would overwrite the profile's JSON with no rows
        names = ", ".join(sc.name or sc.kind for sc in prof["scenario"])
        raise ValueError(f"only (--only) {only!r} is in no scenario name of profile {prof['name']!r}; "
                         f"its scenarios: {names}")
    if seq_lens is not None:
        chosen = with_seq_lens(chosen, seq_lens)
    with fresh_compile_caches() if fresh_compile_cache else contextlib.nullcontext():
        return _run_profile(prof, chosen, device, out_dir, {
            "compile_cache": "fresh" if fresh_compile_cache else "as found",
            **({} if seq_lens is None else {"seq_lens": list(seq_lens)})})


def with_seq_lens(scenarios: list, seq_lens: list[int]) -> list:
    """``scenarios`` with their ``seq_lens`` replaced by ``seq_lens`` (positive ints); ``ValueError``
    naming a scenario that has no ``seq_lens`` list (a fixed ``seq_len``, a training run), since its
    rows would silently keep their lengths."""
    check_sizes("seq_lens", list(seq_lens))
    for sc in scenarios:
        if "seq_lens" not in {f.name for f in dataclasses.fields(sc)}:
            raise ValueError(f"seq_lens (--seq-lens) replaces a scenario's seq_lens list; scenario "
                             f"{sc.name or sc.kind!r} (kind {sc.kind!r}) has none: leave it out with only (--only)")
    return [dataclasses.replace(sc, seq_lens=list(seq_lens)) for sc in scenarios]


def _run_profile(prof: dict, chosen: list, device: str, out_dir, run_meta: dict) -> list[dict]:
    device = str(resolve_device(device))
    rows: list[dict] = []
    gflops = matmul_gflops(device)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dest = out / f"{prof['name']}.json"
    meta = {"profile": prof["name"], "torch": torch.__version__, "device": device, "machine": platform.machine(),
            "threads": torch.get_num_threads(), "matmul_gflops": gflops, **run_meta}
    for i, sc in enumerate(chosen):
        name = sc.name or sc.kind
        progress(f"scenario {name} ({i + 1} of {len(chosen)})")
        series = {"series": sc.series} if sc.series is not None else {}
        rows += [{"scenario": name, **series, **r} for r in KINDS[sc.kind][1](sc, device)]
        if i + 1 < len(chosen):  # the scenarios so far, in case a later one is cut short
            _write_json(dest, {"meta": {**meta, "partial": True}, "rows": rows, "fits": []})
    print(f"profile {prof['name']}: {prof.get('description', '')}".rstrip(": "))
    print(f"torch {torch.__version__}, device {device}, {os.cpu_count()} cpu threads={torch.get_num_threads()}, "
          f"measured fp32 matmul {gflops:.1f} GFLOP/s")
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    fits = fit_rows(rows)
    if fits:
        print("\nlog-log slopes vs T (1 = linear, 2 = quadratic):")
        print(tabulate(fits, headers="keys", floatfmt=".3f", missingval="-"))
    _write_json(dest, {"meta": meta, "rows": rows, "fits": fits})
    print(f"wrote {dest}")
    plot = plot_loglog(rows, out / f"{prof['name']}.png", title=f"{prof['name']} ({device})")
    if plot is not None:
        print(f"wrote {plot}")
    return rows


def _write_json(dest: Path, result: dict) -> None:
    """Write ``result`` to ``dest`` atomically (a temporary file, then a rename)."""
    tmp = dest.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(dest)
