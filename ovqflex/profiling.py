"""Stage labels for ``torch.profiler`` (docs/design.md §8).

``with stage("routing"): ...`` opens ``torch.profiler.record_function("ovqflex.routing")``.
Outside a profiler it costs one cheap Python object. Under ``torch.compile`` dynamo
would treat ``record_function`` as a no-op context (no graph break in torch 2.13) but
log a warning per graph, so while compiling ``stage`` returns a ``nullcontext``
(``torch.compiler.is_compiling()`` is constant while tracing): compiled graphs carry
no stage labels — profile eager layers to see stages. Layers of new methods reuse
the same names.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.profiler import record_function

#: The stages a layer forward is divided into, in data-flow order (docs/design.md §1).
STAGES = ("proj", "routing", "state_build", "block_mask", "attention")
PREFIX = "ovqflex."
#: What ``ovqflex profile`` runs: forward without grad, and forward + backward.
MODES = ("fwd", "fwd+bwd")


def stage(name: str) -> record_function | nullcontext:
    """Context manager labelling a stage ``ovqflex.<name>``; ``name`` is one of :data:`STAGES`."""
    if name not in STAGES:
        raise ValueError(f"stage name must be one of {STAGES}, got {name!r}")
    if torch.compiler.is_compiling():
        return nullcontext()
    return record_function(PREFIX + name)
