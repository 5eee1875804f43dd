"""Learning-rate pilots: the first steps of an experiment's runs at several learning rates, to pick
the scale's ``lr`` before paying for whole runs (e.g. on a GPU lent for minutes).

    ovqflex pilot icr --scale gpu --models sw-ovq --lrs 1e-3,3e-3 --stop-after 500 --device cuda

Each pilot run is one run of the plan (:func:`ovqflex.experiments.plan`) with its ``lr`` replaced,
trained with ``train(..., stop_after=N)``: its first ``N`` steps under the whole run's schedules
(the cosine decay over all the scale's steps, the length warm-up), so what a pilot shows is what
the real run would do in those steps. Layout of ``OUT``::

    OUT/<model>-s<seed>-lr<lr>/     an ``ovqflex train`` run directory (config.json, metrics.jsonl);
                                    its checkpoint is deleted once read (``keep_checkpoints`` keeps it);
                                    diverged.json if it diverged (the trainer's record)
    OUT/pilot.json, pilot.md        one row per pilot run (rewritten after each)

A pilot run whose ``metrics.jsonl`` already reaches ``N`` under the same training config is read,
not trained again, and one with a checkpoint (stopped by SIGTERM or Ctrl-C, which leave one) is
resumed, so a pilot cut off by a time limit continues where it stopped. A pilot run that diverges
(:class:`~ovqflex.training.TrainingDiverged`: a non-finite loss or weights) is a result, not a
failure: its row says at which step (``diverged_at``), and the pilot goes on with the next.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
from pathlib import Path

from tabulate import tabulate

from recurrences.checks import ConfigError

from ..files import write_atomic
from ..training import TrainConfig, TrainingDiverged, diverged_step, latest_checkpoint, train
from ..training.checkpoint import checkpoint_dir
from ..training.trainer import CONFIG_FILE, METRICS_FILE, check_stop_after
from .plan import Plan, Run

#: the training accuracy a pilot run must reach to count as "learned" (first step at which it did)
LEARNED = 0.5
#: columns of training accuracy in the table: at these fractions of ``stop_after``
COLUMNS = (0.25, 0.5, 0.75, 1.0)


def _lr_name(lr: float) -> str:
    return f"{lr:g}"


def _check_lrs(lrs) -> tuple[float, ...]:
    lrs = tuple(lrs)
    if not lrs or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not x > 0 for x in lrs):
        raise ValueError(f"lrs must be one or more numbers > 0, got {list(lrs)}")
    if len({_lr_name(x) for x in lrs}) != len(lrs):
        raise ValueError(f"lrs must be distinct, got {list(lrs)}")
    return lrs


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _done(run_dir: Path, cfg: TrainConfig, stop_after: int) -> bool:
    """Whether ``run_dir`` holds pilot run ``cfg`` already: its metrics to step ``stop_after``, or its
    divergence."""
    config = run_dir / CONFIG_FILE
    if not config.exists():
        return False
    try:
        if TrainConfig.from_dict(json.loads(config.read_text()).get("train_config")) != cfg:
            return False
    except (ValueError, ConfigError):  # another run's, or an older release's: trained again
        return False
    rows = _rows(run_dir)
    return (bool(rows) and rows[-1]["step"] == stop_after) or diverged_step(run_dir) is not None


def summarize(run: Run, lr: float, rows: list[dict], stop_after: int, diverged_at: int | None = None) -> dict:
    """One pilot run's row: its training accuracy near each of :data:`COLUMNS` of ``stop_after``
    (the last logged step at or before it), the first logged step with accuracy >= :data:`LEARNED`,
    the last loss, and tokens/s (median over the logged rows after the first, whose interval
    holds the compilation) with the seconds to the first logged row and to the end; ``diverged_at``:
    the step at which it diverged (None: it did not)."""
    accuracy = {}
    for fraction in COLUMNS:
        before = [r for r in rows if r["step"] <= round(fraction * stop_after)]
        accuracy[str(round(fraction * stop_after))] = before[-1]["accuracy"] if before else None
    learned = next((r["step"] for r in rows if r["accuracy"] >= LEARNED), None)
    speeds = [r["tokens_per_s"] for r in rows[1:]]
    return {"model": run.model.label, "seed": run.seed, "lr": lr, "steps": rows[-1]["step"] if rows else 0,
            "accuracy": accuracy, "learned_at": learned, "loss": rows[-1]["loss"] if rows else None,
            "tokens_per_s": statistics.median(speeds) if speeds else None,
            "first_row_s": rows[0]["elapsed_s"] if rows else None, "seconds": rows[-1]["elapsed_s"] if rows else None,
            "diverged_at": diverged_at}


def table(rows: list[dict]) -> str:
    """The pilot's table (GitHub markdown): a row per pilot run."""
    steps = list(rows[0]["accuracy"]) if rows else []
    # numbers, formatted per column (tabulate would parse strings such as "0.500" and print them as 0.5)
    body = [[r["model"], r["seed"], r["lr"], *(r["accuracy"][s] for s in steps), r["learned_at"], r["loss"],
             r["tokens_per_s"], r["first_row_s"], r["seconds"], r["diverged_at"]] for r in rows]
    head = ["model", "seed", "lr", *(f"acc @{s}" for s in steps), f"acc >= {LEARNED} at", "loss", "tokens/s",
            "first row s", "s", "diverged at"]
    floatfmt = ["", "", "g", *[".3f"] * len(steps), "", ".3f", ",.0f", ".0f", ".0f", ""]
    return tabulate(body, headers=head, tablefmt="github", floatfmt=floatfmt, missingval="-")


def lr_pilot(plan: Plan, lrs, stop_after: int, *, out: str | Path, log=print,
             keep_checkpoints: bool = False) -> list[dict]:
    """Train the first ``stop_after`` steps of each run of ``plan`` at each of ``lrs`` into ``out``
    (module docstring); returns the rows of :func:`summarize`, also written to ``out/pilot.json``
    and ``out/pilot.md`` after each pilot run."""
    lrs = _check_lrs(lrs)
    check_stop_after(stop_after, plan.scale.steps)  # before any run trains (train checks it again)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for run in plan.runs:
        for lr in lrs:
            cfg = dataclasses.replace(run.train, lr=lr, out=str(out / f"{run.dir.name}-lr{_lr_name(lr)}"))
            what = f"{run.model.label} seed {run.seed} lr {_lr_name(lr)}"
            if _done(Path(cfg.out), cfg, stop_after):
                log(f"{what}: already done ({cfg.out})")
            else:
                resume = latest_checkpoint(cfg.out) is not None  # one cut off (its checkpoint), or kept
                log(f"{what}: the first {stop_after:,} of {cfg.steps:,} steps -> {cfg.out}"
                    + (" (resumed)" if resume else ""))
                try:
                    train(cfg, resume=resume, stop_after=stop_after)
                except TrainingDiverged as e:  # a result: this lr is too high (the run directory records it)
                    log(f"{what}: {e}")
                if not keep_checkpoints:
                    shutil.rmtree(checkpoint_dir(cfg.out), ignore_errors=True)
            rows.append(summarize(run, lr, _rows(Path(cfg.out)), stop_after, diverged_step(cfg.out)))
            text = table(rows)
            write_atomic(out / "pilot.json", json.dumps({"experiment": plan.experiment.name, "scale": plan.scale_name,
                                                         "stop_after": stop_after, "rows": rows}, indent=1))
            write_atomic(out / "pilot.md", text + "\n")
            log(text)
    return rows
