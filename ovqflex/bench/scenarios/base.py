"""The scenario registry: ``KINDS`` maps a profile's ``kind`` to its schema and its function."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from recurrences.checks import check_int, from_dict


@dataclass(kw_only=True)
class Scenario:
    """Keys every scenario table has: ``kind``, ``name`` (default: the kind) and ``series``
    (scenarios sharing it are fitted as one series)."""

    kind: str
    name: str | None = None
    series: str | None = None


#: kind -> (schema, function); filled by :func:`register`
KINDS: dict[str, tuple[type[Scenario], Callable[[Scenario, str], list[dict]]]] = {}


def register(kind: str, schema: type[Scenario]):
    def add(fn):
        KINDS[kind] = (schema, fn)
        return fn
    return add


def parse_scenario(table: dict, where: str) -> Scenario:
    """A profile's ``[[scenario]]`` table -> its kind's schema (clear errors, see the module docstring)."""
    kind = table.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{where}: kind must be one of {sorted(KINDS)}, got {kind!r}")
    return from_dict(KINDS[kind][0], table, f"{where} (kind {kind!r})")


def check_sizes(where: str, sizes: list[int]) -> None:
    """``sizes`` (batch sizes, lengths): a non-empty list of positive ints."""
    if not sizes:
        raise ValueError(f"{where} must list at least one size, got {sizes!r}")
    for i, n in enumerate(sizes):
        check_int(f"{where}[{i}]", n)


def runs_on(decode: str, device: torch.device, where: str) -> bool:
    """Whether a ``decode`` path runs on ``device``: ``"graph"`` (a CUDA graph) needs a CUDA device;
    elsewhere its rows are left out, with one printed line saying so."""
    if decode == "graph" and device.type != "cuda":
        print(f"{where}: decode 'graph' replays a CUDA graph, left out on {device}")
        return False
    return True
