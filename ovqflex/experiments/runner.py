"""``run_experiment(plan)``: train and evaluate every unit of a plan, resumably, then write the results.

Layout of ``OUT`` (the plan's ``out``)::

    OUT/experiment.json                 the plan's spec; a resume must match it (it may add seeds, models
                                        and test-time variants)
    OUT/<model>-s<seed>/                an ``ovqflex train`` run directory (config.json,
                                        metrics.jsonl, checkpoints/; diverged.json if it diverged)
    OUT/<model>-s<seed>/eval-<variant>.json, .png   its evaluations (``ovqflex eval`` reports)
    OUT/results.json, results.md, results.png       the aggregate (rewritten after every evaluation)

Units run in order (per seed, per model: train, then its evaluations), in this process, or with
``jobs`` > 1 one run's units per worker process, that many runs at a time (:func:`_run_in_workers`:
for a GPU that one small model leaves idle). A unit whose output
exists and is complete is skipped: an evaluation report with the planned lengths, examples,
overrides and checkpoint step; a run whose latest checkpoint is at the final step, or whose
evaluations are all complete (its checkpoints may then be deleted to save space: with
``drop_checkpoints`` they are, as soon as its last evaluation is written). A run
with an earlier checkpoint continues from it (``train(..., resume=True)``: the same result as
an uninterrupted run, bit for bit where the run is deterministic, by default on the CPU); one that
died before its first checkpoint starts again. Ctrl-C or SIGTERM while a run trains stops it after
the step in flight with a checkpoint of that step (:class:`~ovqflex.training.TrainingInterrupted`
propagates), so ``--resume`` loses nothing. A run that diverges
(:class:`~ovqflex.training.TrainingDiverged`) is a result: its directory records the step
(``diverged.json``), its evaluations are skipped, the results count it as diverged, and the other runs go
on; ``--resume`` leaves it so (to train it again, move its directory away).
"""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from recurrences.checks import check_int

from ..training import TrainingDiverged, TrainingInterrupted, diverged_step, evaluate, latest_checkpoint, train
from ..training.checkpoint import checkpoint_dir, read_state
from ..training.interrupt import STOP_SIGNALS
from ..training.schedule import length_warmup_text
from ..training.trainer import METRICS_FILE
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
    A resume may add seeds, models and test-time variants -- each seed and model of ``saved`` must
    be in ``wanted``, a model with the same spec and each of its variants -- and must match in
    every other field."""
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
            continue
        now = wanted_models[label]
        diffs += spec_differences({k: v for k, v in model.items() if k != "variants"},
                                  {k: v for k, v in now.items() if k != "variants"}, f"models.{label}")
        diffs += [f"models.{label}.variants: {v['label']!r} {v['overrides']} in the directory, absent now "
                  f"(a resume may add variants, not drop or change them)"
                  for v in model.get("variants", []) if v not in now.get("variants", [])]
    return diffs


def added_parts(saved: dict, wanted: dict) -> list[str]:
    """What ``wanted`` adds to the experiment whose spec is ``saved`` (one it can resume): seeds,
    models, and variants of the models already there."""
    saved_models = saved.get("models", {})
    added = [f"seed {s}" for s in wanted["seeds"] if s not in saved.get("seeds", [])]
    added += [f"model {m}" for m in wanted["models"] if m not in saved_models]
    added += [f"variant {v['label']}" for m, spec in wanted["models"].items() if m in saved_models
              for v in spec["variants"] if v not in saved_models[m].get("variants", [])]
    return added


def prepare_out(plan: Plan, resume: bool, log=print) -> None:
    """Create ``OUT`` and write ``experiment.json``, or check that a resumed ``OUT`` holds this
    experiment. Refuses: a fresh run into a directory that holds anything; ``resume`` with
    nothing to resume; a resume whose spec differs other than by added seeds, models or variants
    (naming every differing field, :func:`resume_differences`). A resume that adds any rewrites
    ``experiment.json`` with them (logged); the units already complete stay."""
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
        _check_evaluable(plan)
        added = added_parts(saved, spec)
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


def _check_evaluable(plan: Plan) -> None:
    """Refuse a resume that would evaluate a run whose checkpoints are gone (``drop_checkpoints``)
    while its other evaluations are on disk: training it again would give a model other than the
    one those reports describe (not bit for bit on a GPU), so the run's line would mix two models."""
    stranded = []
    for run in plan.runs:
        done = [v.label for v in run.variants if read_eval(plan, run, v) is not None]
        todo = [v.label for v in run.variants if v.label not in done]
        if done and todo and latest_checkpoint(run.dir) is None:
            stranded.append(f"{run.dir.name} (on disk: {', '.join(done)}; to evaluate: {', '.join(todo)})")
    if stranded:
        raise ValueError(f"cannot resume {plan.out}: these runs have evaluations on disk but no checkpoint to "
                         f"evaluate the rest with (deleted by --drop-checkpoints?): {'; '.join(stranded)}; "
                         f"move such a run's directory away to have it trained and evaluated anew")


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
    """Elapsed time and an ETA from the mean duration of the units of each kind run so far; with
    ``jobs`` runs at a time, the work left is shared by as many of them as there are runs left."""

    def __init__(self, units: tuple, jobs: int = 1):
        self.t0 = time.perf_counter()
        self.spent: dict[str, list[float]] = {"train": [], "eval": []}
        self.units, self.jobs = units, jobs

    def add(self, kind: str, seconds: float) -> None:
        self.spent[kind].append(seconds)

    def status(self, todo: list[bool]) -> str:
        """``todo[i]``: unit ``i`` still has work (the units running now included)."""
        left = {k: sum(1 for u, t in zip(self.units, todo) if t and u.kind == k) for k in self.spent}
        known = {k: sum(v) / len(v) for k, v in self.spent.items() if v}
        runs_left = len({u.run.dir for u, t in zip(self.units, todo) if t})
        eta = sum(known[k] * n for k, n in left.items() if k in known) / max(1, min(self.jobs, runs_left))
        unknown = [k for k, n in left.items() if n and k not in known]
        elapsed = f"elapsed {_duration(time.perf_counter() - self.t0)}"
        if not known:
            return elapsed
        return f"{elapsed}, ETA {_duration(eta)}" + (f" + the {' and '.join(unknown)} units" if unknown else "")


def run_experiment(plan: Plan, *, resume: bool = False, log=print, jobs: int = 1,
                   progress_every: float = 60.0, drop_checkpoints: bool = False) -> dict:
    """Run every unit of ``plan`` not already complete in ``plan.out`` and write the results
    (``results.json``, ``results.md``, ``results.png``; see :mod:`ovqflex.experiments.report`).
    ``resume``: continue the experiment already in ``plan.out`` (same spec, or more seeds, models
    or variants: :func:`prepare_out`). ``log`` gets one line per unit (with elapsed time and ETA) and
    per evaluated length. ``jobs``: runs (a model at a seed: its training, then its evaluations)
    in progress at once, each in a process of its own (:func:`_run_in_workers`; ``log`` then also
    gets every run's step, loss and tokens/s each ``progress_every`` seconds). ``drop_checkpoints``:
    a run's checkpoints are deleted once all its evaluations are on disk (when its last one is
    written, and at the start for the runs already complete), so that the directory keeps the
    reports and metrics alone (a ``small`` run's two checkpoints with their AdamW state are ~80 MB);
    such a run can then be neither trained further nor evaluated anew. Returns the results."""
    check_int("jobs", jobs)
    prepare_out(plan, resume, log)
    units = plan.units
    n = len(units)
    evaluated = {i: read_eval(plan, u.run, u.variant) is not None for i, u in enumerate(units) if u.kind == "eval"}
    # a run whose evaluations are all on disk needs no checkpoint: its reports name the final step
    unevaluated = {units[i].run.dir for i, ok in evaluated.items() if not ok}
    evaluated_runs = {units[i].run.dir for i in evaluated} - unevaluated
    diverged = [diverged_step(u.run.dir) is not None for u in units]  # a result: nothing left to do
    todo = [not d and (not evaluated[i] if u.kind == "eval" else
                       u.run.dir not in evaluated_runs and (trained_step(u) or 0) < u.run.train.steps)
            for i, (u, d) in enumerate(zip(units, diverged))]
    skipped, n_diverged = n - sum(todo), sum(diverged)
    skipped_text = ", ".join(([f"{skipped - n_diverged} already complete"] if skipped > n_diverged else [])
                             + ([f"{n_diverged} of runs that diverged"] if n_diverged else []))
    log(f"experiment {plan.experiment.name}, scale {plan.scale_name}: {n} units into {plan.out}"
        + (f" ({skipped_text})" if skipped else "") + (f", {jobs} runs at a time" if jobs > 1 else ""))
    if drop_checkpoints:
        for run_dir in sorted(evaluated_runs):
            _drop_checkpoints(run_dir, log)
    clock = _Clock(units, jobs)

    def evaluated_now(i: int) -> dict:
        """After evaluation unit ``i`` (both loops have cleared its ``todo``): the results rewritten, and
        with ``drop_checkpoints`` the run's checkpoints deleted if that was its last evaluation left."""
        run_dir = units[i].run.dir
        if drop_checkpoints and not any(todo[j] for j, u in enumerate(units)
                                        if u.kind == "eval" and u.run.dir == run_dir):
            _drop_checkpoints(run_dir, log)
        return write_results(plan)

    if jobs == 1:
        results = _run_in_order(plan, todo, clock, log, evaluated_now)
    else:
        results = _run_in_workers(plan, todo, clock, jobs, log, progress_every, evaluated_now)
    if results is None:  # nothing evaluated now: (re)write from the reports on disk
        results = write_results(plan)
    log(f"done in {_duration(time.perf_counter() - clock.t0)}")
    return results


def _drop_checkpoints(run_dir: Path, log) -> None:
    """Delete the checkpoints of the run in ``run_dir`` (all its evaluations are on disk), if it has any."""
    root = checkpoint_dir(run_dir)
    if root.is_dir():
        shutil.rmtree(root)
        log(f"    {run_dir.name}: its evaluations are complete; deleted its checkpoints ({root})")


def _head(plan: Plan, i: int) -> str:
    return f"[{i + 1}/{len(plan.units)}] {plan.units[i].describe()}"


def _run_in_order(plan: Plan, todo: list[bool], clock: _Clock, log, evaluated_now) -> dict | None:
    """The units in plan order in this process, ``evaluated_now(i)`` (which returns the results) after
    evaluation unit ``i``; the results after the last evaluation (None: none ran)."""
    results = None
    for i, unit in enumerate(plan.units):
        if not todo[i]:
            step = diverged_step(unit.run.dir)
            log(f"{_head(plan, i)}: " + ("complete, skipped" if step is None else
                                          f"skipped, the run diverged after step {step:,}"))
            continue
        t0 = time.perf_counter()
        _run_unit(plan, i, clock.status(todo), log)
        clock.add(unit.kind, time.perf_counter() - t0)
        todo[i] = False
        if unit.kind == "eval":
            results = evaluated_now(i)
    return results


class ExperimentInterrupted(KeyboardInterrupt):
    """Runs in worker processes stopped on ``signum`` (SIGINT/SIGTERM): each training stopped after
    its step in flight with a checkpoint of it, an evaluation in flight is lost (``--resume`` redoes
    it). ``stopped``: one line per run that was in progress. A ``KeyboardInterrupt``, like
    :class:`~ovqflex.training.TrainingInterrupted`; ``exit_code``: the shell's ``128 + signal number``."""

    def __init__(self, signum: int, stopped: list[str]):
        self.signum, self.stopped = signum, stopped
        super().__init__(f"stopped by {signal.Signals(signum).name}: {'; '.join(stopped) or 'no run was in progress'}"
                         f"; continue with --resume")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class ExperimentFailed(RuntimeError):
    """A run in a worker process failed (its traceback in the message); the others were stopped
    with checkpoints, so ``--resume`` continues once the cause is fixed."""


@dataclass
class _Worker:
    """A worker process running the pending ``units`` of one run, in order; ``messages`` from it
    (:func:`_worker`), ``control`` to it (a signal number: stop as on that signal); ``current``:
    the unit it runs; ``end``: its last message if it said why it ends (``stopped``, ``failed``);
    ``asked``: it was asked to stop."""

    process: multiprocessing.process.BaseProcess
    messages: Connection
    control: Connection
    units: list
    label: str
    current: int | None = None
    end: tuple | None = None
    asked: bool = False

    def stop(self, signum: int) -> None:
        """Ask it to stop as on ``signum`` (once)."""
        if self.asked:
            return
        self.asked = True
        try:
            self.control.send(signum)
        except OSError:  # it has exited
            pass

    def close(self, plan: Plan) -> tuple[str, str, int] | None:
        """After its process exited: its pipes closed, and how it ended early -- ``("stopped", why,
        signal)`` (it said so, or died after it was asked to stop) or ``("failed", why, 0)`` -- or
        None: it ran all its units."""
        self.process.join()
        self.messages.close()
        self.control.close()
        if self.end is not None:
            return self.end if self.end[0] == "stopped" else (*self.end, 0)
        code = self.process.exitcode
        if code == 0 and self.current is None:
            return None
        what = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        where = "" if self.current is None else f" during {_head(plan, self.current)}"
        why = f"its process ended ({what}){where}"
        return ("stopped", why, signal.SIGTERM) if self.asked else ("failed", why, 0)


def _run_in_workers(plan: Plan, todo: list[bool], clock: _Clock, jobs: int, log, progress_every: float,
                    evaluated_now) -> dict | None:
    """Each run with work left (its training, then its evaluations, in order) in a process of its own,
    ``jobs`` at a time, started in plan order; each gets this process's torch threads divided by
    ``jobs``. Workers are spawned (safe with CUDA) into a process group of their own, so a Ctrl-C at
    the terminal reaches this process only: the first SIGINT or SIGTERM here starts no more runs and is
    passed on, once, to every worker, whose training then stops as it would alone (after the step in
    flight, with a checkpoint); :class:`ExperimentInterrupted` follows once all have exited. A worker
    whose parent dies stops the same way (SIGTERM); one stopped by a signal sent to it alone ends its
    run there, and no more runs start. Only this process writes the results (``evaluated_now(i)``
    after every evaluation, as in :func:`_run_in_order`). A run that fails stops the others and
    raises :class:`ExperimentFailed` naming it. Returns the results after the last evaluation (None:
    none ran)."""
    ctx = multiprocessing.get_context("spawn")
    threads = max(1, torch.get_num_threads() // jobs)
    queue: deque[list[int]] = deque()       # the pending units of each run, runs in plan order
    for i, unit in enumerate(plan.units):
        if not todo[i]:
            log(f"{_head(plan, i)}: complete, skipped")
        elif queue and plan.units[queue[-1][0]].run.dir == unit.run.dir:
            queue[-1].append(i)
        else:
            queue.append([i])
    active: dict[Connection, _Worker] = {}
    failed: list[str] = []
    stopped: list[tuple[int, str]] = []     # (first unit, why), sorted into plan order at the end
    signum: int | None = None
    results = None
    next_progress = time.perf_counter() + progress_every

    def on_signal(sig, frame):
        nonlocal signum
        signum = sig
        restore()  # a second signal acts as it would without this handler
        for w in active.values():
            w.stop(sig)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}

    def restore():
        for s, handler in previous.items():
            signal.signal(s, handler)
        previous.clear()

    try:
        while active or (queue and signum is None and not failed):
            while queue and len(active) < jobs and signum is None and not failed:
                w = _start_worker(ctx, plan, queue.popleft(), threads)
                active[w.messages] = w
                if signum is not None:  # the signal came while it started
                    w.stop(signum)
            ready = wait(list(active), timeout=max(0.0, next_progress - time.perf_counter()))
            if time.perf_counter() >= next_progress:
                log(_progress(plan, active.values(), clock.status(todo)))
                next_progress = time.perf_counter() + progress_every
            for conn in ready:
                w = active[conn]
                try:
                    message = conn.recv()
                except EOFError:  # the worker has exited
                    del active[conn]
                    outcome = w.close(plan)
                    if outcome is None:
                        continue
                    kind, why, sig = outcome
                    if kind == "stopped":
                        stopped.append((w.units[0], f"{w.label}: {why}"))
                        signum = signum or sig  # a worker stopped from outside: no more runs start
                        continue
                    failed.append(f"{w.label}: {why}")
                    for other in active.values():
                        other.stop(signal.SIGTERM)
                    continue
                if message[0] == "log":
                    log(message[1])
                elif message[0] == "start":
                    w.current = message[1]
                elif message[0] == "done":
                    i, seconds = message[1], message[2]
                    todo[i], w.current = False, None
                    clock.add(plan.units[i].kind, seconds)
                    if plan.units[i].kind == "eval":
                        results = evaluated_now(i)
                else:
                    w.end = message
    finally:
        restore()
    if failed:
        raise ExperimentFailed("\n".join(failed) + "\nthe other runs stopped with checkpoints; fix the cause and "
                               "continue with --resume")
    if signum is not None:
        raise ExperimentInterrupted(signum, [why for _, why in sorted(stopped)])
    return results


def _start_worker(ctx, plan: Plan, units: list[int], threads: int) -> _Worker:
    """A started :func:`_worker` process for ``units`` (one run's), with its two pipes."""
    receive, send = ctx.Pipe(duplex=False)
    control_in, control_out = ctx.Pipe(duplex=False)
    run = plan.units[units[0]].run
    process = ctx.Process(target=_worker, args=(plan, units, threads, send, control_in),
                          name=f"ovqflex-{run.dir.name}")
    process.start()
    send.close()  # the worker's ends: closed here, so its exit shows as EOF
    control_in.close()
    return _Worker(process, receive, control_out, units, f"{run.model.label} seed {run.seed}")


def _progress(plan: Plan, workers, status: str) -> str:
    """One line: each worker's unit and, while it trains, its last logged step, loss and tokens/s."""
    parts = []
    for w in workers:
        if w.current is None:
            parts.append(f"{w.label}: starting")
            continue
        unit = plan.units[w.current]
        text = unit.describe()
        row = _last_metrics(unit.run.dir) if unit.kind == "train" else None
        if row is not None:
            text += (f" step {row['step']:,}/{unit.run.train.steps:,}, loss {row['loss']:.3f}, "
                     f"{row['tokens_per_s']:,.0f} tokens/s")
        parts.append(text)
    return f"    running ({status}): " + "; ".join(parts)


def _last_metrics(run_dir: Path) -> dict | None:
    """The last line of a run's ``metrics.jsonl`` (None: none yet, or that line is still being written)."""
    try:
        lines = (run_dir / METRICS_FILE).read_text().splitlines()
        return json.loads(lines[-1]) if lines else None
    except (OSError, json.JSONDecodeError, IndexError):
        return None


def _worker(plan: Plan, units: list[int], threads: int, messages: Connection, control: Connection) -> None:
    """A worker process of :func:`_run_in_workers`: run ``units`` in order, without a progress bar,
    and say so on ``messages``: ``("log", line)``, ``("start", i)``, ``("done", i, seconds)``, and
    ``("stopped", why, signal number)`` or ``("failed", traceback)`` when it ends early."""
    if hasattr(os, "setpgrp"):
        os.setpgrp()  # the terminal's Ctrl-C reaches the parent only, which passes it on once
    torch.set_num_threads(threads)
    threading.Thread(target=_stop_when_asked, args=(control,), daemon=True).start()

    def log(line: str) -> None:
        messages.send(("log", line))

    i = units[0]
    try:
        for i in units:
            messages.send(("start", i))
            t0 = time.perf_counter()
            _run_unit(plan, i, None, log, alone=False)
            messages.send(("done", i, time.perf_counter() - t0))
    except TrainingInterrupted as e:
        where = "" if e.checkpoint is None else f": checkpoint {e.checkpoint}"
        messages.send(("stopped", f"stopped after step {e.step:,}{where}", e.signum))
        sys.exit(e.exit_code)
    except KeyboardInterrupt:  # a SIGINT outside training
        messages.send(("stopped", f"stopped during {_head(plan, i)}", signal.SIGINT))
        sys.exit(128 + signal.SIGINT)
    except BaseException:
        messages.send(("failed", traceback.format_exc()))
        sys.exit(1)


def _stop_when_asked(control: Connection) -> None:
    """In a worker: deliver to it the signal its parent sends, or SIGTERM if the parent dies."""
    try:
        signum = control.recv()
    except (EOFError, OSError):
        signum = signal.SIGTERM
    os.kill(os.getpid(), signum)


def _run_unit(plan: Plan, i: int, status: str | None, log, alone: bool = True) -> None:
    """Unit ``i``; not ``alone`` (one of several worker processes): no progress bar, and each
    evaluated length's line names the unit. An evaluation of a run that diverged is skipped."""
    unit = plan.units[i]
    step = diverged_step(unit.run.dir)
    if step is not None:
        log(f"{_head(plan, i)}: skipped, the run diverged after step {step:,}")
    elif unit.kind == "train":
        _train_unit(unit, _head(plan, i), status, log, progress=alone)
    else:
        _eval_unit(plan, unit, _head(plan, i), status, log, tag="" if alone else f"[{i + 1}/{len(plan.units)}] ")


def _train_unit(unit: Unit, head: str, status: str | None, log, progress: bool = True) -> None:
    cfg = unit.run.train if progress else dataclasses.replace(unit.run.train, progress=False)
    step = trained_step(unit)
    # None: from scratch, a run that died before its first checkpoint too (a fresh ``train`` into its
    # directory drops what it left: metric lines, checkpoint leftovers, diverged.json; rewrites config.json)
    how = "from scratch" if step is None else f"resuming from step {step:,}"
    log(f"{head}: {cfg.steps:,} steps x {cfg.batch_size} x {cfg.seq_len} tokens"
        f"{length_warmup_text(cfg.length_warmup, cfg.length_warmup_steps)}, {how} -> {unit.run.dir}"
        + (f" ({status})" if status else ""))
    t0 = time.perf_counter()
    try:
        result = train(cfg, resume=step is not None)
    except TrainingDiverged as e:  # a result (the run directory records it): the experiment goes on
        log(f"{head}: {e}")
        return
    what = "" if result.loss is None else f": {result.describe()}"
    log(f"{head}: trained in {_duration(time.perf_counter() - t0)}{what}")


def _eval_unit(plan: Plan, unit: Unit, head: str, status: str | None, log, tag: str = "") -> None:
    overrides = plan.eval_overrides(unit.variant)
    shown = ", ".join(f"{k}={v}" for k, v in overrides.items()) or "no overrides"
    log(f"{head}: {plan.scale.eval_examples} examples at {', '.join(map(str, plan.lengths))} tokens, {shown}"
        + (f" ({status})" if status else ""))

    def show(row):
        log(f"    {tag}length {row.length:>7}: accuracy {row.accuracy:.4f} ({row.seconds:.1f} s)")

    evaluate(unit.run.dir, plan.lengths, n_examples=plan.scale.eval_examples,
             batch_size=plan.scale.eval_batch_size, overrides=overrides, device=unit.run.train.device,
             progress=show, name=unit.eval_file.stem)
