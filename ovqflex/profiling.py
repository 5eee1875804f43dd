"""Stage labels for ``torch.profiler`` (docs/design.md §8).

``with stage("routing"): ...`` opens ``torch.profiler.record_function("ovqflex.routing")``.
Outside a profiler it costs one cheap Python object. Under ``torch.compile`` dynamo
would treat ``record_function`` as a no-op context (no graph break in torch 2.13) but
log a warning per graph, so while compiling ``stage`` returns a ``nullcontext``
(``torch.compiler.is_compiling()`` is constant while tracing): compiled graphs carry
no stage labels — profile eager layers to see stages. Layers of new methods reuse
the same names. :class:`ProfileConfig` is what ``ovqflex profile`` runs (here, not in
``ovqflex.bench.profiler``, so that the command line derives its flags without importing the bench).
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch.profiler import record_function

from recurrences.checks import check_int

from . import devices

#: The stages a layer forward is divided into, in data-flow order (docs/design.md §1).
STAGES = ("proj", "routing", "state_build", "block_mask", "attention")
PREFIX = "ovqflex."
#: What ``ovqflex profile`` runs: forward without grad, and forward + backward.
MODES = ("fwd", "fwd+bwd")


#: the active :func:`stage_timer` (innermost last): what each stage adds its time to, and the device it syncs
_timers: list[tuple[dict[str, float], torch.device]] = []


def stage(name: str):
    """Context manager labelling a stage ``ovqflex.<name>``; ``name`` is one of :data:`STAGES`.
    Inside a :func:`stage_timer` it also adds its wall time to the timer's totals."""
    if name not in STAGES:
        raise ValueError(f"stage name must be one of {STAGES}, got {name!r}")
    if torch.compiler.is_compiling():
        return nullcontext()
    if _timers:
        return _timed(name, *_timers[-1])
    return record_function(PREFIX + name)


@contextmanager
def _timed(name: str, totals: dict[str, float], device: torch.device):
    with record_function(PREFIX + name):
        devices.sync(device)
        t0 = time.perf_counter()
        yield
        devices.sync(device)
        totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0


@contextmanager
def stage_timer(device: torch.device | str = "cpu"):
    """Time every :func:`stage` run inside (eager code; compiled graphs have no stages): yields a dict
    ``stage name -> seconds`` (summed over the stage's runs), filled as they end. Each stage
    synchronizes ``device`` when it starts and ends, so a CUDA stage's time is its kernels' too, and
    the stages no longer overlap the host's launches of the next one: their sum is a little more than
    the same code's unsynchronized time. A stage nested in another counts in both."""
    totals: dict[str, float] = {}
    _timers.append((totals, torch.device(device)))
    try:
        yield totals
    finally:
        _timers.pop()


def _target_help() -> str:
    from .methods import method_names  # (registered methods included: called when the flag is made)

    return f"'model' or a layer: one of {', '.join(method_names())}"


@dataclass
class ProfileConfig:
    """``target``: a method of :data:`ovqflex.methods.METHODS` (one layer, input
    ``[batch, seq_len, heads * head_dim]``) or ``"model"`` (a ``HybridLM`` of ``preset`` and
    ``pattern`` on random tokens, loss = cross-entropy). ``options``: layer options, or
    model config overrides for ``"model"``. ``device``: see :func:`ovqflex.devices.resolve_device`.
    Each field's ``metadata`` makes its ``ovqflex profile`` flag (``ovqflex/cli/flags.py``)."""

    target: str = field(default="ovq", metadata={"positional": True, "help": _target_help})
    seq_len: int = field(default=1024, metadata={"help": "tokens T of the input"})
    batch: int = field(default=1, metadata={"help": "batch size of the input"})
    heads: int = field(default=4, metadata={"help": "layer targets: heads"})
    head_dim: int = field(default=32, metadata={"help": "layer targets: head dim"})
    options: dict = field(default_factory=dict, metadata={
        "flag": "--opt", "help": "layer option (e.g. backend=blocked, max_centroids=512) or model config override"})
    preset: str = field(default="tiny", metadata={"help": "model target: preset"})
    pattern: str | None = field(default=None, metadata={"help": "model target: mixer pattern, e.g. swa,ovq"})
    modes: tuple[str, ...] = field(default=MODES, metadata={
        "flag": "--mode", "choices": MODES, "help": "comma-separated: fwd (no grad), fwd+bwd"})
    steps: int = field(default=2, metadata={"help": "profiled steps per mode"})
    kernels: int = field(default=5, metadata={
        "help": "kernels (CUDA; operators by self time on a CPU) listed per stage, the most time first; 0: none"})
    warmup: int = field(default=1, metadata={"help": "unprofiled steps per mode first (compilation)"})
    seed: int = field(default=0, metadata={"help": "seed of the init and the input"})
    device: str = field(default=devices.AUTO, metadata={"help": devices.NAMES})

    def __post_init__(self):
        for name in ("seq_len", "batch", "heads", "head_dim", "steps"):
            check_int(name, getattr(self, name))
        check_int("warmup", self.warmup, minimum=0)
        check_int("kernels", self.kernels, minimum=0)
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"modes must be a non-empty subset of {MODES}, got {tuple(self.modes)!r}")
