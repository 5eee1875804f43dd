"""Log-log fits and plots of benchmark rows: time and peak memory vs T.

Rows of one series share ``series`` (a scenario's ``series`` key, default its name), ``case``
and ``batch`` (rows without one: None); a series with at least two
lengths gets the least-squares slope of ``log y`` on ``log T`` (1: linear, 2: quadratic).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

METRICS = ("time_s", "peak_mb")


def _series(rows: list[dict]) -> dict[tuple[str, str, int | None], list[dict]]:
    out: dict[tuple[str, str, int | None], list[dict]] = {}
    for r in rows:
        if "T" in r and any(isinstance(r.get(m), (int, float)) for m in METRICS):
            key = (str(r.get("series", r.get("scenario", ""))), str(r.get("case", "")), r.get("batch"))
            out.setdefault(key, []).append(r)
    return out


def loglog_slope(xs, ys) -> float | None:
    """Slope of ``log y`` vs ``log x`` over the positive points; None with fewer than two lengths."""
    pts = [(x, y) for x, y in zip(xs, ys) if isinstance(y, (int, float)) and x > 0 and y > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    lx, ly = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    return float(np.polyfit(lx, ly, 1)[0])


def fit_rows(rows: list[dict]) -> list[dict]:
    """One row per series: series, case, batch (where the rows have one), lengths, slope of time
    and of peak memory."""
    fits = []
    for (series, case, batch), rs in _series(rows).items():
        ts = [r["T"] for r in rs]
        slopes = {f"slope_{m}": loglog_slope(ts, [r.get(m) for r in rs]) for m in METRICS}
        if any(v is not None for v in slopes.values()):
            fits.append({"series": series, "case": case, **({} if batch is None else {"batch": batch}),
                         "T": f"{min(ts)}..{max(ts)}", **slopes})
    return fits


def plot_loglog(rows: list[dict], path: str | Path, title: str = "") -> Path | None:
    """Two log-log panels (time, peak memory) vs T with the fitted slope in each label; None
    when no series has two lengths."""
    series = {k: v for k, v in _series(rows).items() if len({r["T"] for r in v}) >= 2}
    if not series:
        return None
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, metric, label in zip(axes, METRICS, ("time (s)", "peak memory (MB)")):
        for (scenario, case, batch), rs in series.items():
            pts = sorted((r["T"], r[metric]) for r in rs if isinstance(r.get(metric), (int, float)) and r[metric] > 0)
            if len(pts) < 2:
                continue
            slope = loglog_slope(*zip(*pts))
            name = " / ".join(s for s in (scenario, case, None if batch is None else f"batch {batch}") if s)
            ax.loglog(*zip(*pts), marker="o", label=f"{name} (slope {slope:.2f})")
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path

