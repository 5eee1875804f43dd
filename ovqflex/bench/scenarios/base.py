"""The scenario registry: ``KINDS`` maps a profile's ``kind`` to its schema and its function."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Callable

import torch

from recurrences.checks import ConfigError, check_int, from_dict

#: the ``metadata`` of an int key whose 0 has a meaning (a default, "none", "never"): every other
#: int key of a scenario must be >= 1 (:func:`check_numbers`)
ZERO_MEANS_DEFAULT = {"minimum": 0}


@dataclass(kw_only=True)
class Scenario:
    """Keys every scenario table has: ``kind``, ``name`` (default: the kind) and ``series``
    (scenarios sharing it are fitted as one series).

    A kind's schema checks its keys when the profile loads, before any scenario runs (a bad value in
    the last scenario of a GPU profile had been found after the others ran): its ints and lists of
    sizes by their types (:func:`check_numbers`), and in its ``__post_init__`` what they mean
    together, by building the method options, layers or configs its function will build."""

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
    """A profile's ``[[scenario]]`` table -> its kind's schema, checked (see :class:`Scenario`); every
    error starts with ``where`` and the kind."""
    kind = table.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{where}: kind must be one of {sorted(KINDS)}, got {kind!r}")
    where, schema = f"{where} (kind {kind!r})", KINDS[kind][0]
    try:
        check_numbers(schema, table)  # before the schema's own checks, which use them
        scenario = from_dict(schema, table, where)
    except (ValueError, ConfigError) as e:  # (a TypeError of a bug keeps its traceback)
        if str(e).startswith(where):
            raise
        raise type(e)(f"{where}: {e}") from None
    return scenario


def check_numbers(schema: type[Scenario], table: dict) -> None:
    """The values ``table`` gives ``schema``'s keys, by the keys' types: an int >= 1 (>= 0 where its field's
    metadata is :data:`ZERO_MEANS_DEFAULT`), a list of ints a non-empty list of sizes (:func:`check_sizes`),
    any other list non-empty. (A value of another type is left to :func:`~recurrences.checks.from_dict`,
    which names the type expected; the defaults are good.)"""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        value = table.get(f.name)
        if hints[f.name] is int and isinstance(value, int) and not isinstance(value, bool):
            check_int(f.name, value, minimum=f.metadata.get("minimum", 1))
        elif typing.get_origin(hints[f.name]) is list and isinstance(value, list):
            if hints[f.name] == list[int] and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                check_sizes(f.name, value)
            elif not value:
                raise ValueError(f"{f.name} must list at least one item, got []")


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
