"""``run_experiment(plan)``: train and evaluate every unit of a plan, resumably, then write the results.

Layout of ``OUT`` (the plan's ``out``)::

    OUT/experiment.json                 the plan's spec; a resume must match it (it may add seeds or models)
    OUT/<model>-s<seed>/                an ``ovqflex train`` run directory (config.json,
                                        metrics.jsonl, checkpoints/)
    OUT/<model>-s<seed>/eval-<variant>.json, .png   its evaluations (``ovqflex eval`` reports)
    OUT/results.json, results.md, results.png       the aggregate (rewritten after every evaluation)

Units run in order (per seed, per model: train, then its evaluations). A unit whose output
exists and is complete is skipped: an evaluation report with the planned lengths, examples,
overrides and checkpoint step; a run whose latest checkpoint is at the final step, or whose
evaluations are all complete (its checkpoints may then be deleted to save space). A run
with an earlier checkpoint continues from it (``train(..., resume=True)``: the same result as
an uninterrupted run, bit for bit where the run is deterministic, by default on the CPU); one that
died before its first checkpoint starts again. Ctrl-C or SIGTERM while a run trains stops it after
the step in flight with a checkpoint of that step (:class:`~ovqflex.training.TrainingInterrupted`
propagates), so ``--resume`` loses nothing.
"""
from __future__ import annotations

import json
import shutil
import time

from ..training import evaluate, latest_checkpoint, train
from ..training.checkpoint import read_state
from .plan import Plan, Unit
from ..files import write_atomic
from .report import read_eval, write_results

SPEC_FILE = "experiment.json"


def spec_differences(saved, wanted, path: str = "") -> list[str]:
    """One line per (dotted) field where two specs differ, e.g.
    ``"train.steps: 1200 in the directory vs 600 now"``."""
    if isinstance(saved, dict) and isinstance(wanted, dict):
        out = []
        for k in sorted(set(saved) | set(wanted), key=str):
            p = f"{path}.{k}" if path else str(k)
            if k not in saved:
                out.append(f"{p}: absent in the directory, present now")
            elif k not in wanted:
                out.append(f"{p}: present in the directory, absent now")
            else:
                out += spec_differences(saved[k], wanted[k], p)
        return out
    return [] if saved == wanted else [f"{path}: {saved!r} in the directory vs {wanted!r} now"]


def resume_differences(saved: dict, wanted: dict) -> list[str]:
    """Why ``wanted`` cannot continue the experiment whose spec is ``saved`` (empty: it can).
    A resume may add seeds and models -- each seed and model of ``saved`` must be in ``wanted``,
    a model with the same spec -- and must match in every other field."""
    extendable = ("seeds", "models")
    diffs = spec_differences({k: v for k, v in saved.items() if k not in extendable},
                             {k: v for k, v in wanted.items() if k not in extendable})
    dropped = [s for s in saved.get("seeds", []) if s not in wanted.get("seeds", [])]
    if dropped:
        diffs.append(f"seeds: {saved.get('seeds')} in the directory vs {wanted.get('seeds')} now "
                     f"(a resume may add seeds, not drop {dropped})")
    saved_models, wanted_models = saved.get("models", {}), wanted.get("models", {})
    for label, model in saved_models.items():
        if label not in wanted_models:
            diffs.append(f"models.{label}: present in the directory, absent now "
                         f"(a resume may add models, not drop them)")
        else:
            diffs += spec_differences(model, wanted_models[label], f"models.{label}")
    return diffs


def prepare_out(plan: Plan, resume: bool, log=print) -> None:
    """Create ``OUT`` and write ``experiment.json``, or check that a resumed ``OUT`` holds this
    experiment. Refuses: a fresh run into a directory that holds anything; ``resume`` with
    nothing to resume; a resume whose spec differs other than by added seeds or models (naming
    every differing field, :func:`resume_differences`). A resume that adds seeds or models
    rewrites ``experiment.json`` with them (logged); the units already complete stay."""
    out, spec = plan.out, plan.spec()
    path = out / SPEC_FILE
    if path.exists():
        if not resume:
            raise ValueError(f"{out} already holds an experiment ({SPEC_FILE}); pass --resume to continue it "
                             f"or choose another --out")
        try:
            saved = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); choose another --out") from None
        diffs = resume_differences(saved, spec)
        if diffs:
            shown = "; ".join(diffs[:8]) + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
            raise ValueError(f"cannot resume {out}: it was made by a different experiment spec ({shown})")
        added = [f"seed {s}" for s in spec["seeds"] if s not in saved.get("seeds", [])]
        added += [f"model {m}" for m in spec["models"] if m not in saved.get("models", {})]
        if added:
            log(f"extending {out}: adds {', '.join(added)}")
            write_atomic(path, json.dumps(spec, indent=1))
        return
    if resume:
        raise ValueError(f"--resume: {out} holds no experiment to resume (no {SPEC_FILE})")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out {out} is not empty and holds no {SPEC_FILE}; choose an empty or new directory")
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(spec, indent=1))


def trained_step(unit: Unit) -> int | None:
    """Step of the run's latest checkpoint (``None``: no checkpoint)."""
    ckpt = latest_checkpoint(unit.run.dir)
    return None if ckpt is None else int(read_state(ckpt)["step"])


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class _Clock:
    """Elapsed time and an ETA from the mean duration of the units of each kind run so far."""

    def __init__(self, units: tuple):
        self.t0 = time.perf_counter()
        self.spent: dict[str, list[float]] = {"train": [], "eval": []}
        self.units = units

    def add(self, kind: str, seconds: float) -> None:
        self.spent[kind].append(seconds)

    def status(self, index: int, todo: list[bool]) -> str:
        """``index``: 0-based unit about to run; ``todo[i]``: unit ``i`` still has work."""
        left = {k: sum(1 for u, t in zip(self.units[index:], todo[index:]) if t and u.kind == k) for k in self.spent}
        known = {k: sum(v) / len(v) for k, v in self.spent.items() if v}
        eta = sum(known[k] * n for k, n in left.items() if k in known)
        unknown = [k for k, n in left.items() if n and k not in known]
        elapsed = f"elapsed {_duration(time.perf_counter() - self.t0)}"
        if not known:
            return elapsed
        return f"{elapsed}, ETA {_duration(eta)}" + (f" + the {' and '.join(unknown)} units" if unknown else "")


def run_experiment(plan: Plan, *, resume: bool = False, log=print) -> dict:
    """Run every unit of ``plan`` not already complete in ``plan.out`` and write the results
    (``results.json``, ``results.md``, ``results.png``; see :mod:`ovqflex.experiments.report`).
    ``resume``: continue the experiment already in ``plan.out`` (same spec, or more seeds or
    models: :func:`prepare_out`). ``log`` gets one line per unit (with elapsed time and ETA) and
    per evaluated length. Returns the results."""
    prepare_out(plan, resume, log)
    units = plan.units
    n = len(units)
    evaluated = {i: read_eval(plan, u.run, u.variant) is not None for i, u in enumerate(units) if u.kind == "eval"}
    # a run whose evaluations are all on disk needs no checkpoint: its reports name the final step
    unevaluated = {units[i].run.dir for i, ok in evaluated.items() if not ok}
    evaluated_runs = {units[i].run.dir for i in evaluated} - unevaluated
    todo = [not evaluated[i] if u.kind == "eval" else
            u.run.dir not in evaluated_runs and (trained_step(u) or 0) < u.run.train.steps
            for i, u in enumerate(units)]
    skipped = n - sum(todo)
    log(f"experiment {plan.experiment.name}, scale {plan.scale_name}: {n} units into {plan.out}"
        + (f" ({skipped} already complete)" if skipped else ""))
    clock = _Clock(units)
    results = None
    for i, unit in enumerate(units):
        head = f"[{i + 1}/{n}] {unit.describe()}"
        if not todo[i]:
            log(f"{head}: complete, skipped")
            continue
        t0 = time.perf_counter()
        if unit.kind == "train":
            _train_unit(unit, head, clock.status(i, todo), log)
        else:
            _eval_unit(plan, unit, head, clock.status(i, todo), log)
        clock.add(unit.kind, time.perf_counter() - t0)
        todo[i] = False
        if unit.kind == "eval":
            results = write_results(plan)
    if results is None:  # nothing evaluated now: (re)write from the reports on disk
        results = write_results(plan)
    log(f"done in {_duration(time.perf_counter() - clock.t0)}")
    return results


def _train_unit(unit: Unit, head: str, status: str, log) -> None:
    cfg = unit.run.train
    step = trained_step(unit)
    if step is None and unit.run.dir.exists():
        shutil.rmtree(unit.run.dir)  # died before its first checkpoint: nothing worth keeping
    how = "from scratch" if step is None else f"resuming from step {step:,}"
    log(f"{head}: {cfg.steps:,} steps x {cfg.batch_size} x {cfg.seq_len} tokens, {how} -> {unit.run.dir} "
        f"({status})")
    t0 = time.perf_counter()
    result = train(cfg, resume=step is not None)
    what = "" if result.loss is None else \
        f": loss {result.loss:.4f}, target accuracy {result.accuracy:.3f}, {result.tokens_per_s:,.0f} tokens/s"
    log(f"{head}: trained in {_duration(time.perf_counter() - t0)}{what}")


def _eval_unit(plan: Plan, unit: Unit, head: str, status: str, log) -> None:
    overrides = plan.eval_overrides(unit.variant)
    shown = ", ".join(f"{k}={v}" for k, v in overrides.items()) or "no overrides"
    log(f"{head}: {plan.scale.eval_examples} examples at {', '.join(map(str, plan.lengths))} tokens, {shown} "
        f"({status})")

    def show(row):
        log(f"    length {row.length:>7}: accuracy {row.accuracy:.4f} ({row.seconds:.1f} s)")

    evaluate(unit.run.dir, plan.lengths, n_examples=plan.scale.eval_examples,
             batch_size=plan.scale.eval_batch_size, overrides=overrides, device=unit.run.train.device,
             progress=show, name=unit.eval_file.stem)
