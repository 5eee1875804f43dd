"""The ``ovqflex`` command line: ``info``, ``demo``, ``train``, ``eval``, ``probe``, ``experiment``, ``pilot``,
``generate``, ``bench``, ``viz``, ``profile``.

``flags`` holds the value parsers, the ``--device`` flag and the flags derived from a config
dataclass (``train``'s from :class:`ovqflex.training.TrainConfig`, ``profile``'s from
:class:`ovqflex.profiling.ProfileConfig`, ``viz``'s from :class:`ovqflex.viz.VizConfig`, ``demo``'s
from :class:`~ovqflex.cli.tools.DemoConfig`); ``runs`` the commands on training runs; ``tools`` the
commands on layers and the machine.
"""
from __future__ import annotations

import argparse
import os
import sys

from recurrences.checks import ConfigError

from ..experiments.runner import ExperimentInterrupted
from ..training.interrupt import TrainingInterrupted
from ..training.trainer import TrainingDiverged

from . import runs, tools

#: What a command refuses as the user's mistake: reported as one line, exit status 2. Any other
#: exception (a TypeError from a bug included) propagates with its traceback.
USER_ERRORS = (ConfigError, ValueError, FileNotFoundError, NotImplementedError, ImportError)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ``ovqflex`` command; each sets ``fn``, the function that runs it."""
    p = argparse.ArgumentParser(prog="ovqflex", description="compressed-memory attention as FlexAttention programs")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (tools.add_info, tools.add_demo, runs.add_train, runs.add_eval, runs.add_probe, runs.add_experiment,
                runs.add_pilot, runs.add_generate, tools.add_bench, tools.add_viz, tools.add_profile):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the command of ``argv`` (default: ``sys.argv[1:]``); returns its exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except USER_ERRORS as e:
        print(f"ovqflex {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (TrainingInterrupted, ExperimentInterrupted) as e:  # SIGINT/SIGTERM: stopped after a step, checkpointed
        if os.environ.get("RANK", "0") == "0":
            print(f"\novqflex {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except TrainingDiverged as e:  # a non-finite loss or weights: stopped without checkpointing them
        if os.environ.get("RANK", "0") == "0":
            print(f"ovqflex {args.command}: {e}", file=sys.stderr)
        return e.exit_code
