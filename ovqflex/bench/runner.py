"""Load a benchmark profile (TOML), run its scenarios, print a table, write JSON.

Every run also measures the machine's fp32 matmul rate (``meta.matmul_gflops``, the
denominator of the scenarios' FLOP-based efficiency), fits log-log slopes of time and
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
profile loads: unknown keys (with the nearest valid one), missing keys and wrong types are
refused by name before anything runs.
"""
from __future__ import annotations

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
from .measure import matmul_gflops
from .scenarios import KINDS, parse_scenario

PROFILE_KEYS = ("name", "description", "scenario")


def load_profile(path: str | Path) -> dict:
    """The profile at ``path`` with its ``scenario`` tables parsed into their kinds' schemas."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"profile {str(path)!r} does not exist")
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


def run_profile(path: str | Path, *, device: str = AUTO, out_dir: str | Path = "bench-out",
                only: str | None = None) -> list[dict]:
    """Run the profile at ``path`` on ``device`` (:func:`ovqflex.devices.resolve_device`), the scenarios
    whose name contains ``only`` (all by default); print the table and slopes, write JSON and plot
    to ``out_dir``; returns the rows."""
    prof = load_profile(path)
    device = str(resolve_device(device))
    rows: list[dict] = []
    gflops = matmul_gflops(device)
    for sc in prof["scenario"]:
        name = sc.name or sc.kind
        if only and only not in name:
            continue
        series = {"series": sc.series} if sc.series is not None else {}
        rows += [{"scenario": name, **series, **r} for r in KINDS[sc.kind][1](sc, device)]
    print(f"profile {prof['name']}: {prof.get('description', '')}".rstrip(": "))
    print(f"torch {torch.__version__}, device {device}, {os.cpu_count()} cpu threads={torch.get_num_threads()}, "
          f"measured fp32 matmul {gflops:.1f} GFLOP/s")
    print(tabulate(rows, headers="keys", floatfmt=".4g"))
    fits = fit_rows(rows)
    if fits:
        print("\nlog-log slopes vs T (1 = linear, 2 = quadratic):")
        print(tabulate(fits, headers="keys", floatfmt=".3f", missingval="-"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dest = out / f"{prof['name']}.json"
    tmp = dest.with_suffix(".json.tmp")
    meta = {"profile": prof["name"], "torch": torch.__version__, "device": device, "machine": platform.machine(),
            "threads": torch.get_num_threads(), "matmul_gflops": gflops}
    tmp.write_text(json.dumps({"meta": meta, "rows": rows, "fits": fits}, indent=2))
    tmp.replace(dest)
    print(f"wrote {dest}")
    plot = plot_loglog(rows, out / f"{prof['name']}.png", title=f"{prof['name']} ({device})")
    if plot is not None:
        print(f"wrote {plot}")
    return rows
