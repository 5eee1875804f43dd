"""Stage labels for ``torch.profiler`` (SPEC §8).

``with stage("routing"): ...`` opens ``torch.profiler.record_function("ovqflex.routing")``.
Outside a profiler it costs one cheap Python object; under ``torch.compile`` dynamo
treats ``record_function`` as a no-op context (no graph break in torch 2.13, checked
by ``tests/ovqflex/test_profiling.py``), so compiled graphs carry no stage labels —
profile eager layers to see stages. Layers of new methods reuse the same names.
"""
from __future__ import annotations

from torch.profiler import record_function

#: The stages a layer forward is divided into, in data-flow order (SPEC §1).
STAGES = ("proj", "routing", "state_build", "block_mask", "attention")
PREFIX = "ovqflex."


def stage(name: str) -> record_function:
    """Context manager labelling a stage ``ovqflex.<name>``; ``name`` is one of :data:`STAGES`."""
    if name not in STAGES:
        raise ValueError(f"stage name must be one of {STAGES}, got {name!r}")
    return record_function(PREFIX + name)
