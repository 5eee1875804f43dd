"""Experiments: several hybrids trained on one task and seeds, evaluated from the training
length to many times it, aggregated into one table, JSON and plot (``ovqflex experiment NAME``).

    from ovqflex.experiments import get_experiment, plan, run_experiment
    p = plan(get_experiment("icr"), "cpu", "runs/exp-icr", seeds=[0, 1])
    print(p.describe())            # what will run (nothing is written)
    results = run_experiment(p)    # OUT/<model>-s<seed>/, OUT/results.{json,md,png}

See :mod:`ovqflex.experiments.registry` for the named experiments and their scales, and
:mod:`ovqflex.experiments.pilot` for the first steps of their runs at several learning rates
(``ovqflex pilot``).
"""
from .plan import Plan, Run, Unit, Variant, plan
from .registry import EXPERIMENTS, get_experiment, register_experiment
from .report import collect, table, write_results
from .runner import ExperimentFailed, ExperimentInterrupted, run_experiment, spec_differences
from .spec import TRAIN_LENGTH, EvalSetting, EvalSweep, Experiment, ModelSpec, Scale

__all__ = ["EXPERIMENTS", "EvalSetting", "EvalSweep", "Experiment", "ExperimentFailed", "ExperimentInterrupted",
           "ModelSpec", "Plan", "Run", "Scale", "TRAIN_LENGTH", "Unit", "Variant", "collect", "get_experiment", "plan",
           "register_experiment", "run_experiment", "spec_differences", "table", "write_results"]
