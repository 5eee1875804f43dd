"""Benchmark scenarios: each ``kind`` of a profile's ``[[scenario]]`` maps to a schema (a
dataclass: the keys its table may hold, their types and defaults) and a function taking the
parsed scenario and returning a list of result rows (dicts) measured in this process.

:func:`parse_scenario` turns a TOML table into its kind's schema: an unknown key is refused
by name with the nearest valid key suggested (``seq_len`` for ``seq_lens``), a missing
required key or a value of the wrong type is named too, all before anything runs.

Modules: ``base`` (``Scenario``, ``KINDS``, ``register``, ``parse_scenario``), ``program``
(``blockmask``, ``viz``), ``op`` (``ovq``, ``kvm``, ``vq``: a method's op vs its reference loop and
SDPA), ``stages`` (``stages``: an op's program build stage by stage per state layout, its flex kernel),
``recurrent`` (``recurrent``, ``state_layout``, ``routing``), ``train`` (``train``), ``decode`` (``decode``),
``generate`` (``generate``, ``quantized``).
"""
from .base import KINDS, Scenario, parse_scenario, register
from . import decode, generate, op, program, recurrent, stages, train  # noqa: F401  (each module registers its kinds)

__all__ = ["KINDS", "Scenario", "parse_scenario", "register"]
