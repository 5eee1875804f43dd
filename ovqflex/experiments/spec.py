"""What an experiment is: a task, several models, seeds, and named scales (frozen, validated).

- :class:`ModelSpec` -- one model of the comparison: a label (its table row and run
  directory), a mixer pattern and ``HybridConfig`` overrides.
- :class:`Scale` -- the preset, task options, ``TrainConfig`` fields and evaluation
  (lengths, examples, test-time overrides) of one size of the experiment (``cpu``, ``gpu``).
- :class:`EvalSweep` -- extra evaluations of some models with a mixer attribute
  scaled at test time (OVQ's dictionary size ``max_centroids`` ×2, ×4).
- :class:`EvalSetting` -- an extra evaluation of some models with a mixer attribute set to
  one value at test time (the NoPE layer's ``logn_len`` at the training length).
- :class:`Experiment` -- all of the above under a name.

Everything here is checked on construction (names, types, ranges); what needs the task
or the models built (every evaluation length can be generated, every mixer option is
accepted) is checked when the experiment is planned (:func:`ovqflex.experiments.plan`).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from recurrences.checks import check_keys

from ..models.config import PRESETS, pattern_names
from ..tasks import TASKS
from ..training.config import TrainConfig
from ..training.evaluate import report_name

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
#: TrainConfig fields the runner sets itself (per run) -- not allowed in ``Scale.train_options``
RUNNER_FIELDS = ("out", "seed", "task", "task_options", "data", "preset", "pattern", "model_options", "device",
                 "progress")
#: TrainConfig fields that have their own ``Scale`` field
SCALE_FIELDS = ("steps", "seq_len", "batch_size", "lr", "warmup", "ckpt_every")


def _check_name(what: str, value: object) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"{what} must be a name of letters, digits, '.', '_' or '-' (it names files), got {value!r}")
    return value


def _check_options(what: str, value: object) -> dict:
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(f"{what} must be a dict with str keys, got {value!r}")
    return value


def _check_option(what: str, value: object, example: str) -> str:
    if not isinstance(value, str) or not value.isidentifier():
        raise ValueError(f"{what} must be a mixer attribute name (e.g. {example}), got {value!r}")
    return value


def _check_labels(what: str, values: object) -> tuple:
    if not isinstance(values, tuple) or not values or not all(isinstance(m, str) for m in values):
        raise TypeError(f"{what} must be a non-empty tuple of model labels, got {values!r}")
    return values


def _check_positive_ints(what: str, values: object, *, increasing: bool = False, minimum: int = 1) -> tuple:
    if not isinstance(values, tuple) or not values:
        raise TypeError(f"{what} must be a non-empty tuple of ints, got {values!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"{what} must hold ints >= {minimum}, got {values!r}")
    if len(set(values)) != len(values) or (increasing and list(values) != sorted(values)):
        raise ValueError(f"{what} must hold distinct{' increasing' if increasing else ''} values, got {values!r}")
    return values


@dataclass(frozen=True)
class ModelSpec:
    """One model of an experiment.

    ``label`` names its runs (``OUT/<label>-s<seed>/``) and its line in the results;
    ``pattern`` is the ``HybridConfig`` mixer pattern (``"swa,ovq"``); ``model_options`` are
    ``HybridConfig`` overrides applied on top of the scale's preset and ``model_options``
    (e.g. ``{"mixer_options": {"kvm": {"budget": "power_law"}}}``).
    """

    label: str
    pattern: str
    model_options: dict = field(default_factory=dict)

    def __post_init__(self):
        _check_name("ModelSpec.label", self.label)
        if not isinstance(self.pattern, str):
            raise TypeError(f"ModelSpec {self.label!r}: pattern must be a str like 'swa,ovq', got {self.pattern!r}")
        pattern_names(self.pattern, f"ModelSpec {self.label!r}: pattern")
        _check_options(f"ModelSpec {self.label!r}: model_options", self.model_options)
        if "pattern" in self.model_options or "vocab_size" in self.model_options:
            raise ValueError(f"ModelSpec {self.label!r}: model_options must not set pattern or vocab_size "
                             f"(the pattern is ModelSpec.pattern, the vocab is the task's)")


@dataclass(frozen=True)
class EvalSweep:
    """Evaluate ``models`` again with the test-time mixer attribute ``option`` (one
    :meth:`~ovqflex.HybridLM.set_overrides` takes, e.g. OVQ's ``max_centroids``) multiplied by each
    of ``factors`` (factor 1 is the plain evaluation and adds nothing). The base value is the
    built model's (the plan checks that its mixers have it, all with one value).

    ``symbol`` is the option's short name in line labels: ``"sw-ovq N×2"``.
    """

    option: str
    factors: tuple
    models: tuple
    symbol: str = ""

    def __post_init__(self):
        _check_option("EvalSweep.option", self.option, "max_centroids")
        _check_positive_ints("EvalSweep.factors", self.factors, increasing=True)
        _check_labels("EvalSweep.models", self.models)
        if not isinstance(self.symbol, str):
            raise TypeError(f"EvalSweep.symbol must be a str, got {self.symbol!r}")

    def variant_name(self, factor: int) -> str:
        """File-name part of the evaluation at ``factor``: ``max_centroids-x2``."""
        return f"{self.option}-x{factor}"

    def variant_label(self, model: str, factor: int) -> str:
        """Line label of ``model`` at ``factor``: ``sw-ovq N×2``."""
        return f"{model} {self.symbol or self.option}×{factor}"


#: ``EvalSetting.value`` standing for the scale's training length (``Scale.seq_len``)
TRAIN_LENGTH = "train_length"


@dataclass(frozen=True)
class EvalSetting:
    """Evaluate ``models`` again with the test-time mixer attribute ``option`` (one
    :meth:`~ovqflex.HybridLM.set_overrides` takes) set to ``value``: an int or float, or
    :data:`TRAIN_LENGTH` for the scale's training length (e.g. ``logn_len``, which scales the
    logits of a query past that many tokens). The plan checks that a mixer of each model takes
    the value.
    """

    option: str
    value: object
    models: tuple

    def __post_init__(self):
        _check_option("EvalSetting.option", self.option, "logn_len")
        if self.value != TRAIN_LENGTH and (isinstance(self.value, bool) or not isinstance(self.value, (int, float))):
            raise ValueError(f"EvalSetting.value must be an int, a float or {TRAIN_LENGTH!r} (the scale's "
                             f"training length), got {self.value!r}")
        _check_labels("EvalSetting.models", self.models)

    def resolved(self, seq_len: int):
        """The value at a scale that trains at ``seq_len`` tokens."""
        return seq_len if self.value == TRAIN_LENGTH else self.value

    def variant_name(self, seq_len: int) -> str:
        """File-name part of the evaluation, as ``ovqflex eval --override`` names it: ``logn_len-2048``."""
        return report_name({self.option: self.resolved(seq_len)}).removeprefix("eval-")

    def variant_label(self, model: str, seq_len: int) -> str:
        """Line label of ``model``: ``sw-nope logn_len=2048``."""
        return f"{model} {self.option}={self.resolved(seq_len)}"


@dataclass(frozen=True)
class Scale:
    """One size of an experiment: model preset, task options, training and evaluation.

    ``task_options`` are the task's options in full (on top of the task's own defaults --
    not of ``ovqflex.training.setup.TASK_SCALES``, which the runner overrides); ``model_options``
    are ``HybridConfig`` overrides shared by every model. ``steps`` ... ``ckpt_every`` and
    ``train_options`` (any other ``TrainConfig`` field: ``min_lr``, ``grad_clip``, ``compile``, ...)
    make each run's ``TrainConfig``. Every model is evaluated at ``eval_lengths`` on
    ``eval_examples`` unseen sequences each, with the test-time ``eval_overrides``.
    ``budget`` says what the scale costs, and on what basis (shown by ``--dry-run``).
    """

    preset: str
    seq_len: int
    steps: int
    batch_size: int
    eval_lengths: tuple
    task_options: dict = field(default_factory=dict)
    model_options: dict = field(default_factory=dict)
    lr: float = 5e-3
    warmup: int = 100
    ckpt_every: int = 100
    train_options: dict = field(default_factory=dict)
    eval_examples: int = 64
    eval_batch_size: int = 8
    eval_overrides: dict = field(default_factory=dict)
    budget: str = ""

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"Scale.preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        _check_positive_ints("Scale.eval_lengths", self.eval_lengths, increasing=True)
        for name in ("task_options", "model_options", "train_options", "eval_overrides"):
            _check_options(f"Scale.{name}", getattr(self, name))
        clash = sorted(set(self.train_options) & set(RUNNER_FIELDS + SCALE_FIELDS))
        if clash:
            raise ValueError(f"Scale.train_options must not set {clash}: the runner sets "
                             f"{', '.join(RUNNER_FIELDS)} per run, and {', '.join(SCALE_FIELDS)} are Scale fields")
        if "pattern" in self.model_options or "vocab_size" in self.model_options:
            raise ValueError("Scale.model_options must not set pattern or vocab_size (the models' patterns and "
                             "the task's vocab set them)")
        for name in ("eval_examples", "eval_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Scale.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.budget, str):
            raise TypeError(f"Scale.budget must be a str, got {self.budget!r}")
        self.train_config(out="check", seed=0, task="icr", task_options={}, pattern="swa", model_options={})

    def train_config(self, *, out: str, seed: int, task: str, task_options: dict, pattern: str,
                     model_options: dict, device: str = "auto", progress: bool = True) -> TrainConfig:
        """The ``TrainConfig`` of one run at this scale (``TypeError``/``ValueError`` naming a bad field)."""
        check_keys("Scale.train_options (TrainConfig fields)", self.train_options,
                   [f.name for f in dataclasses.fields(TrainConfig)])
        return TrainConfig(out=out, seed=seed, task=task, task_options=dict(task_options), preset=self.preset,
                           pattern=pattern, model_options=dict(model_options), device=device, progress=progress,
                           steps=self.steps, seq_len=self.seq_len, batch_size=self.batch_size, lr=self.lr,
                           warmup=self.warmup, ckpt_every=self.ckpt_every, **self.train_options)

    @property
    def train_tokens(self) -> int:
        """Tokens one training run sees: ``steps * batch_size * seq_len``."""
        return self.steps * self.batch_size * self.seq_len

    @property
    def eval_tokens(self) -> int:
        """Tokens one evaluation (all lengths) reads: ``eval_examples * sum(eval_lengths)``."""
        return self.eval_examples * sum(self.eval_lengths)

    @property
    def max_ratio(self) -> float:
        """Longest evaluation length / training length."""
        return self.eval_lengths[-1] / self.seq_len


@dataclass(frozen=True)
class Experiment:
    """A named comparison: every model of ``models`` is trained on ``task`` once per seed, at
    the chosen scale of ``scales``, and evaluated at that scale's lengths, plus the test-time
    variants of ``sweeps`` (:class:`EvalSweep`, :class:`EvalSetting`).

    ``seeds`` are the default seeds (``--seeds`` picks others). ``description`` is one line
    (listed by ``ovqflex experiment -h``); ``notes`` may say more (``--dry-run`` prints them).
    """

    name: str
    description: str
    task: str
    models: tuple
    scales: dict
    seeds: tuple = (0, 1)
    sweeps: tuple = ()
    notes: str = ""

    def __post_init__(self):
        _check_name("Experiment.name", self.name)
        if self.task not in TASKS:
            raise ValueError(f"Experiment {self.name!r}: task must be one of {sorted(TASKS)}, got {self.task!r}")
        if not isinstance(self.models, tuple) or not self.models or \
                not all(isinstance(m, ModelSpec) for m in self.models):
            raise TypeError(f"Experiment {self.name!r}: models must be a non-empty tuple of ModelSpec")
        labels = [m.label for m in self.models]
        if len(set(labels)) != len(labels):
            raise ValueError(f"Experiment {self.name!r}: model labels must be distinct, got {labels}")
        if not isinstance(self.scales, dict) or not self.scales or \
                not all(isinstance(s, Scale) for s in self.scales.values()):
            raise TypeError(f"Experiment {self.name!r}: scales must be a non-empty dict of name -> Scale")
        for name in self.scales:
            _check_name(f"Experiment {self.name!r}: scale name", name)
        _check_positive_ints(f"Experiment {self.name!r}: seeds", self.seeds, minimum=0)
        if not isinstance(self.sweeps, tuple) or not all(isinstance(s, (EvalSweep, EvalSetting))
                                                         for s in self.sweeps):
            raise TypeError(f"Experiment {self.name!r}: sweeps must be a tuple of EvalSweep or EvalSetting")
        for sweep in self.sweeps:
            unknown = [m for m in sweep.models if m not in labels]
            if unknown:
                raise ValueError(f"Experiment {self.name!r}: {type(sweep).__name__} of {sweep.option} names "
                                 f"unknown model(s) {unknown}; models: {labels}")

    @property
    def labels(self) -> list[str]:
        return [m.label for m in self.models]

    def model(self, label: str) -> ModelSpec:
        for m in self.models:
            if m.label == label:
                return m
        raise ValueError(f"experiment {self.name!r} has no model {label!r}; its models: {', '.join(self.labels)}")

    def scale(self, name: str) -> Scale:
        if name not in self.scales:
            raise ValueError(f"experiment {self.name!r} has no scale {name!r}; its scales: {', '.join(self.scales)}")
        return self.scales[name]

