"""Flags of the ``ovqflex`` command line: value parsers (comma lists, ``NAME=VALUE`` options),
the one ``--device`` flag, and the flags of a config dataclass derived from its fields.

:func:`add_config_flags` gives every field of a config dataclass a flag: ``--seq-len`` for
``seq_len`` (``metadata["flag"]`` names it otherwise), of the field's type, defaulting to the
field's default, with ``metadata["help"]`` as its help and ``metadata["choices"]`` (if any) as
its choices. A bool field is a switch (``--no-NAME`` when its default is True), a dict field a
repeatable ``NAME=VALUE``. :func:`config_from_args` builds the config from the parsed flags, so
a new field is a new flag.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from .. import devices


def int_list(text: str) -> list[int]:
    """``"512,1024"`` -> ``[512, 1024]``: positive integers."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 512,1024, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 512,1024, got {text!r}")
    return values


def id_list(text: str) -> list[int]:
    """``"3,0,17"`` -> ``[3, 0, 17]``: token ids (checked against the vocabulary later)."""
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 3,0,17, got {text!r}") from None


def seed_list(text: str) -> list[int]:
    """``"0,1"`` -> ``[0, 1]``: distinct integers >= 0."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct comma-separated integers >= 0 like 0,1, got {text!r}")
    return values


def label_list(text: str) -> list[str]:
    """``"sw-ovq,sw-nope"`` -> ``["sw-ovq", "sw-nope"]``: a non-empty list of names."""
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated model labels like sw-ovq,sw-nope, got {text!r}")
    return values


def name_list(allowed):
    """A parser of a comma-separated, non-empty subset of ``allowed`` (returned as a tuple)."""
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}, got {text!r}")
        return values

    return parse


def parse_options(items: list[str] | None, flag: str) -> dict:
    """The ``NAME=VALUE`` items of the repeatable ``flag`` as a dict (values parsed as JSON where
    they are JSON, else strings); a malformed item is a ValueError naming ``flag``."""
    from ..training.evaluate import parse_overrides

    try:
        return parse_overrides(items or [])
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def _described(help: str, default) -> str:
    return help if default is None else f"{help} (default: {default})"


def add_device(parser: argparse.ArgumentParser) -> None:
    """The ``--device`` flag of every command that runs torch: one default, one meaning
    (:func:`ovqflex.devices.resolve_device`)."""
    parser.add_argument("--device", default=devices.AUTO, help=_described(devices.NAMES, devices.AUTO))


def _value_type(cls: type, name: str, hint) -> type:
    """The flag's value type of a field annotated ``hint`` (``X | None`` -> ``X``)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(h for h in typing.get_args(hint) if h is not type(None))
    hint = typing.get_origin(hint) or hint
    if hint not in (bool, int, float, str, dict):
        raise TypeError(f"{cls.__name__}.{name}: a field of type {hint} has no command-line flag")
    return hint


def _flag(field: dataclasses.Field, kind: type) -> str:
    default_on = kind is bool and field.default is True
    return field.metadata.get("flag") or ("--no-" if default_on else "--") + field.name.replace("_", "-")


def _fields(cls: type) -> list[tuple[dataclasses.Field, type, str]]:
    """(field, value type, flag) of every field of the config dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = _value_type(cls, f.name, hints[f.name])
        out.append((f, kind, _flag(f, kind)))
    return out


def add_config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """A flag for every field of the config dataclass ``cls`` (see the module docstring); each
    flag stores under the field's name."""
    for f, kind, flag in _fields(cls):
        help = f.metadata.get("help", "")
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action="store_false" if f.default else "store_true",
                                help=f"do not {help}" if f.default else help)
        elif kind is dict:
            parser.add_argument(flag, dest=f.name, action="append", metavar="NAME=VALUE", help=f"{help} (repeatable)")
        else:
            choices = f.metadata.get("choices")
            parser.add_argument(flag, dest=f.name, type=kind, default=f.default, choices=choices,
                                metavar=None if choices else flag[2:].upper().replace("-", "_"),
                                help=_described(help, f.default))


def config_from_args(cls: type, args: argparse.Namespace):
    """The config ``cls`` of the flags :func:`add_config_flags` added (a dict field from its
    ``NAME=VALUE`` items); its values are checked by ``cls``."""
    return cls(**{f.name: parse_options(getattr(args, f.name), flag) if kind is dict else getattr(args, f.name)
                  for f, kind, flag in _fields(cls)})
