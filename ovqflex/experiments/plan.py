"""``plan(experiment, scale, out)``: the units of work of one experiment run, checked before
anything trains.

Planning resolves the task's options in full, builds every model on the ``meta`` device
(so a bad mixer option fails now, not after hours of training), checks that the task can
generate a sequence at the training length and at every evaluation length (e.g. that ICR
has enough distinct keys and values at the longest one) and that the test-time overrides
name attributes the models have. The plan's :meth:`Plan.spec` is what ``experiment.json``
records; a resumed run must have the same.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from recurrences.checks import ConfigError

from ..models import HybridConfig, HybridLM
from ..models.config import merge_config
from ..tasks import Task, make_task
from ..training.config import TrainConfig
from ..training.schedule import length_warmup_text
from ..training.setup import check_lengths, model_config
from .spec import EvalSetting, Experiment, ModelSpec, Scale

BASE_VARIANT = "base"
#: TrainConfig fields that differ between the runs of one experiment, do not change results, or are
#: recorded elsewhere in the spec (the task)
_PER_RUN = ("out", "seed", "pattern", "model_options", "device", "progress", "task", "task_options")


@dataclass(frozen=True)
class Variant:
    """One evaluation of a trained model: ``name`` names its file ``eval-<name>.json``,
    ``label`` its line in the results, ``overrides`` its test-time overrides (on top of the
    scale's ``eval_overrides``)."""

    name: str
    label: str
    overrides: dict


@dataclass(frozen=True)
class Run:
    """One trained model: ``model`` at ``seed``, trained per ``train`` into ``dir``."""

    model: ModelSpec
    seed: int
    dir: Path
    train: TrainConfig
    config: HybridConfig
    parameters: int
    variants: tuple


@dataclass(frozen=True)
class Unit:
    """One unit of work: ``kind`` ``"train"`` (the run) or ``"eval"`` (one variant of it)."""

    kind: str
    run: Run
    variant: Variant | None = None

    @property
    def eval_file(self) -> Path:
        assert self.variant is not None
        return self.run.dir / f"eval-{self.variant.name}.json"

    def describe(self) -> str:
        what = f"{self.kind} {self.run.model.label} seed {self.run.seed}"
        if self.variant is not None and self.variant.name != BASE_VARIANT:
            what += f" ({self.variant.label.removeprefix(self.run.model.label).strip()})"
        return what


@dataclass(frozen=True)
class Plan:
    """Everything one ``ovqflex experiment`` invocation will do, in order (``units``)."""

    experiment: Experiment
    scale_name: str
    scale: Scale
    seeds: tuple
    models: tuple
    out: Path
    task: Task
    runs: tuple
    units: tuple

    @property
    def lengths(self) -> list[int]:
        return list(self.scale.eval_lengths)

    def eval_overrides(self, variant: Variant) -> dict:
        return {**self.scale.eval_overrides, **variant.overrides}

    def spec(self) -> dict:
        """What makes two invocations the same experiment (written to ``OUT/experiment.json``):
        task options, seeds, models with their resolved ``HybridConfig``, the training settings
        shared by all runs, evaluation and variants. JSON-normalised (tuples become lists)."""
        first = self.runs[0].train.to_dict()
        doc = {
            "experiment": self.experiment.name, "scale": self.scale_name, "task": self.experiment.task,
            "task_options": self.task.options(), "seeds": list(self.seeds),
            "models": {r.model.label: {"pattern": r.model.pattern, "config": r.config.to_dict(),
                                       "variants": [{"name": v.name, "label": v.label, "overrides": v.overrides}
                                                    for v in r.variants]}
                       for r in self.runs[:len(self.models)]},  # the first seed's runs: one per model
            "train": {k: v for k, v in first.items() if k not in _PER_RUN},
            "eval": {"lengths": self.lengths, "examples": self.scale.eval_examples,
                     "batch_size": self.scale.eval_batch_size, "overrides": self.scale.eval_overrides},
        }
        return json.loads(json.dumps(doc))

    def describe(self) -> str:
        """The plan as text (what ``ovqflex experiment NAME --dry-run`` prints)."""
        from tabulate import tabulate

        s, exp = self.scale, self.experiment
        n_train = sum(u.kind == "train" for u in self.units)
        n_eval = len(self.units) - n_train
        lines = [f"experiment {exp.name}, scale {self.scale_name}: {exp.description}",
                 f"task {exp.task}: {self.task.describe()}",
                 f"train at {s.seq_len} tokens; evaluate at {', '.join(map(str, s.eval_lengths))} "
                 f"(up to {s.max_ratio:g}x the training length), {s.eval_examples} examples per length"
                 + (f", overrides {s.eval_overrides}" if s.eval_overrides else ""),
                 f"seeds {', '.join(map(str, self.seeds))}; preset {s.preset}"
                 + (f" with {s.model_options}" if s.model_options else ""), ""]
        rows = []
        for run in self.runs[:len(self.models)]:
            rows.append((run.model.label, run.model.pattern, f"{run.parameters:,}",
                         ", ".join(v.label for v in run.variants), run.model.model_options or ""))
        lines.append(tabulate(rows, headers=["model", "pattern", "parameters", "evaluated as", "options"]))
        t = self.runs[0].train
        lines += ["",
                  f"per run: {t.steps:,} steps x {t.batch_size} x {t.seq_len}"
                  f"{length_warmup_text(t.length_warmup, t.length_warmup_steps)} = {s.train_tokens:,} training tokens "
                  f"(lr {t.lr:g}, warmup {t.warmup}, checkpoint every {t.ckpt_every or t.steps} steps); "
                  f"{s.eval_tokens:,} tokens per evaluation",
                  f"units: {n_train} train + {n_eval} eval = {len(self.units)}; tokens: "
                  f"{n_train * s.train_tokens:,} trained, {n_eval * s.eval_tokens:,} evaluated"]
        if s.budget:
            lines.append(f"budget: {s.budget}")
        if exp.notes:
            lines.append(f"notes: {exp.notes}")
        lines.append(f"output: {self.out}/ (experiment.json, <model>-s<seed>/, results.json, results.md, "
                     f"results.png)")
        w = len(str(len(self.units)))
        lines += [""] + [f"  [{i:>{w}}/{len(self.units)}] {u.describe():<34} -> "
                         f"{u.run.dir if u.kind == 'train' else u.eval_file}" for i, u in enumerate(self.units, 1)]
        return "\n".join(lines)


def _check_lengths(task: Task, exp: Experiment, scale_name: str, scale: Scale) -> None:
    """Every length the plan uses must hold a target and be generable (distinct keys, values)."""
    try:
        check_lengths(task, [*scale.train_options.get("length_warmup", ()), scale.seq_len], what="training length")
        check_lengths(task, list(scale.eval_lengths))
    except ValueError as e:
        raise ValueError(f"experiment {exp.name!r}, scale {scale_name!r}: {e}") from None


def _variants(exp: Experiment, model: ModelSpec, net: HybridLM, seq_len: int) -> tuple:
    """The evaluations of ``model``: the plain one, then those of each of ``exp.sweeps`` that names it
    (checked against ``net``, the model built on ``meta``: the mixers take the option and value)."""
    out = [Variant(BASE_VARIANT, model.label, {})]
    for sweep in exp.sweeps:
        if model.label not in sweep.models:
            continue
        if isinstance(sweep, EvalSetting):
            overrides = {sweep.option: sweep.resolved(seq_len)}
            try:
                with net.overridden(**overrides):  # set (the layers check it), then restored
                    pass
            except (ValueError, TypeError) as e:
                raise ValueError(f"experiment {exp.name!r}, model {model.label!r}: test-time {e}") from None
            out.append(Variant(sweep.variant_name(seq_len), sweep.variant_label(model.label, seq_len), overrides))
            continue
        values = {getattr(b.mixer, sweep.option) for b in net.blocks if sweep.option in b.mixer.overrides}
        if len(values) != 1:
            raise ValueError(f"experiment {exp.name!r}: sweep of {sweep.option!r} over model {model.label!r}, but "
                             + (f"no mixer of pattern {model.pattern!r} has a test-time {sweep.option!r}" if not values
                                else f"its mixers have different values {sorted(values)} (the sweep scales one)"))
        base = values.pop()
        out += [Variant(sweep.variant_name(f), sweep.variant_label(model.label, f), {sweep.option: base * f})
                for f in sweep.factors if f != 1]
    return tuple(out)


def _seeds(exp: Experiment, seeds) -> tuple:
    if seeds is None:
        return exp.seeds
    seeds = tuple(seeds)
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds) \
            or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct ints >= 0, e.g. 0,1; got {seeds!r}")
    return seeds


def _with_steps(sc: Scale, steps) -> Scale:
    """``sc`` trained for ``steps`` steps instead of its own (warmup and checkpoint interval kept;
    the budget line says what it was written for)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if steps == sc.steps:
        return sc
    budget = f"{steps:,} steps instead of the scale's {sc.steps:,}"
    if sc.budget:
        budget += f"; the scale's: {sc.budget}"
    return dataclasses.replace(sc, steps=steps, budget=budget)


def plan(experiment: Experiment, scale: str, out: str | Path, *, seeds=None, models=None, steps: int | None = None,
         device: str = "auto", progress: bool = True) -> Plan:
    """The units of ``experiment`` at ``scale`` into ``out``: for each seed, for each model, a
    training run ``out/<label>-s<seed>/`` followed by its evaluations. ``seeds`` / ``models``
    (labels) select a subset (default: the experiment's seeds, all models); ``steps`` replaces the
    scale's training steps per run (e.g. to fit a run into the time a machine is lent for; the spec
    records it, so a resume must give the same). Nothing is written. ``ValueError`` names whatever
    is wrong: an unknown scale or model, a length the task cannot generate, a mixer option or
    test-time override the models do not take."""
    exp = experiment
    sc = exp.scale(scale) if steps is None else _with_steps(exp.scale(scale), steps)
    seeds = _seeds(exp, seeds)
    if models is None:
        chosen = exp.models
    else:
        labels = list(models)
        if not labels or len(set(labels)) != len(labels):
            raise ValueError(f"models must be distinct labels of {', '.join(exp.labels)}; got {labels}")
        chosen = tuple(exp.model(label) for label in labels)
    task = make_task(exp.task, **sc.task_options)
    _check_lengths(task, exp, scale, sc)
    options = task.options()
    out = Path(out)
    resolved = {}
    for m in chosen:
        train = sc.train_config(out=str(out / f"{m.label}-s{seeds[0]}"), seed=seeds[0], task=exp.task,
                                task_options=options, pattern=m.pattern,
                                model_options=merge_config(sc.model_options, m.model_options,
                                                           f"model {m.label!r} options"),
                                device=device,
                                progress=progress)
        try:
            config = model_config(train, task)
            with torch.device("meta"):
                net = HybridLM(config)
            if sc.eval_overrides:
                net.set_overrides(**sc.eval_overrides)
        except (ValueError, ConfigError) as e:
            raise ValueError(f"experiment {exp.name!r}, scale {scale!r}, model {m.label!r}: {e}") from None
        resolved[m.label] = (train, config, net.num_parameters(), _variants(exp, m, net, sc.seq_len))
    runs, units = [], []
    for seed in seeds:
        for m in chosen:
            train, config, n_params, variants = resolved[m.label]
            run_dir = out / f"{m.label}-s{seed}"
            train = dataclasses.replace(train, out=str(run_dir), seed=seed)
            run = Run(m, seed, run_dir, train, config, n_params, variants)
            runs.append(run)
            units += [Unit("train", run)] + [Unit("eval", run, v) for v in variants]
    return Plan(exp, scale, sc, seeds, chosen, out, task, tuple(runs), tuple(units))
