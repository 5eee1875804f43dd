"""What ``torch.compile`` did while a loop ran: graphs compiled, graph breaks, recompiles, and code
dynamo gave up on (docs/design.md §7 "What compiling did", §8).

A model trained under ``torch.compile(model)`` (not ``fullgraph``) never fails to compile: where
dynamo cannot trace, it splits the model at a *graph break* and runs the code between graphs unfused;
where a guard fails at a shape it compiled before, it *recompiles*; past ``recompile_limit`` graphs of
one function it *gives up* on that function, which then runs eager. Each is silent unless logged, and
each can cost a training run most of its speed. The counts come from dynamo's process-wide counters
(``torch._dynamo.utils.counters``), read before and after each step: a frame traced once counts once,
at the step that traced it.

:func:`compile_counts` reads the counters; :class:`CompileWatch` follows the steps of one loop and says
what each step did that a user should hear of. The trainer prints its notes and summary
(``ovqflex train``), and the ``train`` bench scenario reports its counts per model.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

#: dynamo's message for a function it stopped compiling at its recompile limit (torch 2.11, 2.13)
_GAVE_UP = "Dynamo recompile limit exceeded"


@dataclass(frozen=True)
class CompileCounts:
    """Dynamo's counts at one moment, or (``after - before``) over an interval. ``breaks``: graph
    breaks met while tracing, as ``(reason, count)`` pairs (reason: dynamo's one-line kind of break
    and its explanation); ``gave_up``: functions dynamo stopped compiling at its recompile limit."""

    graphs: int = 0
    breaks: tuple[tuple[str, int], ...] = ()
    gave_up: int = 0

    @property
    def graph_breaks(self) -> int:
        return sum(n for _, n in self.breaks)

    def __sub__(self, earlier: CompileCounts) -> CompileCounts:
        breaks = Counter(dict(self.breaks))
        breaks.subtract(dict(earlier.breaks))
        return CompileCounts(self.graphs - earlier.graphs, tuple((r, n) for r, n in breaks.items() if n > 0),
                             self.gave_up - earlier.gave_up)


def break_reason(message: str) -> str:
    """Dynamo's graph-break message -> one line: its first line (the kind of break) and its
    ``Explanation:`` line, e.g. ``"Failed to trace builtin operator: Dynamo does not know how to trace
    builtin operator `print` ..."``."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    why = next((line[len("Explanation:"):].strip() for line in lines[1:] if line.startswith("Explanation:")), "")
    return f"{lines[0]}: {why}" if why else lines[0]


def compile_counts() -> CompileCounts:
    """Dynamo's counts so far in this process."""
    from torch._dynamo.utils import counters

    breaks = Counter()
    for message, n in counters["graph_break"].items():
        breaks[break_reason(message)] += n
    gave_up = sum(n for message, n in counters["unimplemented"].items() if message.startswith(_GAVE_UP))
    return CompileCounts(counters["stats"]["unique_graphs"], tuple(sorted(breaks.items())), gave_up)


class CompileWatch:
    """Follows the steps of one loop (a training run, a benchmark's steps): call :meth:`step` after each
    with the shape of what it ran (e.g. ``tuple(x.shape)``); it returns the notes a user should see:

    - graph breaks met in that step, with their reasons;
    - graphs compiled in a step whose shape an earlier step ran: a recompile (a model whose steps keep
      their shape should compile once per shape);
    - functions dynamo gave up on at its recompile limit (they run eager from then on).

    ``graphs``, ``graph_breaks``, ``recompiles``, ``gave_up`` total them; ``first_graphs`` is what the
    first step compiled. Counters are per process: while two watches are open at once in one process
    (trainings on two threads), neither can tell whose compile it saw, so both stop counting
    (``mixed``) and say so instead of guessing. Use as a context manager (open from ``__enter__`` to
    ``__exit__``)."""

    _open = 0
    _lock = threading.Lock()

    def __init__(self):
        self.graphs = self.graph_breaks = self.recompiles = self.gave_up = 0
        self.first_graphs: int | None = None
        self.mixed = False
        self._first_step_of: dict[object, int] = {}
        self._last = None

    def __enter__(self) -> CompileWatch:
        with CompileWatch._lock:
            CompileWatch._open += 1
            self.mixed |= CompileWatch._open > 1
        self._last = compile_counts()
        return self

    def __exit__(self, *exc) -> None:
        with CompileWatch._lock:
            CompileWatch._open -= 1

    def step(self, step: int, shape) -> list[str]:
        """Account for ``step`` (its number, for the notes), which ran inputs of ``shape``."""
        if self._last is None:
            raise RuntimeError("CompileWatch.step called outside `with CompileWatch() as watch:`")
        now = compile_counts()
        new, self._last = now - self._last, now
        with CompileWatch._lock:
            self.mixed |= CompileWatch._open > 1
        if self.mixed:
            return []
        notes = []
        if self.first_graphs is None:
            self.first_graphs = new.graphs
        self.graphs += new.graphs
        self.graph_breaks += new.graph_breaks
        self.gave_up += new.gave_up
        if new.breaks:
            reasons = "; ".join(f"{reason}" + (f" (x{n})" if n > 1 else "") for reason, n in new.breaks)
            notes.append(f"step {step}: torch.compile split the model at {new.graph_breaks} graph break(s), "
                         f"and runs the code between the graphs unfused: {reasons} "
                         f"(TORCH_LOGS=graph_breaks shows where)")
        earlier = self._first_step_of.setdefault(shape, step)
        if new.graphs and earlier != step:
            self.recompiles += new.graphs
            notes.append(f"step {step}: torch.compile compiled {new.graphs} new graph(s) for inputs of shape "
                         f"{_shape_text(shape)}, which step {earlier} ran already: a recompile "
                         f"(TORCH_LOGS=recompiles says why)")
        if new.gave_up:
            import torch._dynamo.config as dynamo_config

            notes.append(f"step {step}: dynamo stopped compiling {new.gave_up} function(s) at its recompile limit "
                         f"(torch._dynamo.config.recompile_limit = {dynamo_config.recompile_limit}): they run "
                         f"eager, unfused, from now on (TORCH_LOGS=recompiles says why)")
        return notes

    def counts(self) -> dict:
        """The totals, as a benchmark row or a run's record holds them (None where ``mixed``)."""
        if self.mixed:
            return {"graphs": None, "graph_breaks": None, "recompiles": None, "gave_up": None}
        return {"graphs": self.graphs, "graph_breaks": self.graph_breaks, "recompiles": self.recompiles,
                "gave_up": self.gave_up}

    def summary(self) -> str:
        """One line, e.g. ``"torch.compile: 2 graphs, no graph break, no recompile"``."""
        if self.mixed:
            return "torch.compile: not counted (another loop compiled in this process at the same time)"
        parts = [_count(self.graphs, "graph"), _count(self.graph_breaks, "graph break"),
                 _count(self.recompiles, "recompile")]
        if self.gave_up:
            parts.append(f"{_count(self.gave_up, 'function')} left eager at the recompile limit")
        return "torch.compile: " + ", ".join(parts)


def _count(n: int, what: str) -> str:
    return f"no {what}" if n == 0 else f"{n:,} {what}" + ("" if n == 1 else "s")


def _shape_text(shape) -> str:
    return "x".join(map(str, shape)) if isinstance(shape, tuple) else str(shape)
