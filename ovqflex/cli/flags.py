"""Flags of the ``ovqflex`` command line: value parsers (comma lists, ``NAME=VALUE`` options),
the one ``--device`` flag, and the flags of a config dataclass derived from its fields.

:func:`add_config_flags` gives every field of a config dataclass a flag: ``--seq-len`` for
``seq_len`` (``metadata["flag"]`` names it otherwise; ``metadata["positional"]`` makes it a
positional argument named like the field), of the field's type, defaulting to the field's
default, with ``metadata["help"]`` as its help (a callable is called when the flag is made,
for lists that grow at run time) and ``metadata["choices"]`` (if any) as its choices. A bool
field is a switch (``--no-NAME`` when its default is True; a ``bool | None`` field defaulting to
None, which means "decided by the run", gets both ``--NAME`` and ``--no-NAME``), a dict field a repeatable
``NAME=VALUE``, a ``tuple[X, ...]`` field a comma-separated list of X (of the choices, if
any), or with ``metadata["repeatable"]`` one X per flag, the flag repeatable.
:func:`config_from_args` builds the config from the parsed flags, so a new field is a new flag.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from .. import devices


def _items(text: str) -> list[str]:
    """The stripped items of a comma-separated flag value; ValueError for an empty one (``"1,,2"``,
    ``"1,"``, ``""``): it is more often a value left out than a stray comma, so it is refused, not skipped."""
    items = [v.strip() for v in text.split(",")]
    if "" in items:
        raise ValueError(f"empty item in {text!r}")
    return items


def int_list(text: str) -> list[int]:
    """``"512,1024"`` -> ``[512, 1024]``: positive integers."""
    try:
        values = [int(v) for v in _items(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 512,1024, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 512,1024, got {text!r}")
    return values


def id_list(text: str) -> list[int]:
    """``"3,0,17"`` -> ``[3, 0, 17]``: token ids (checked against the vocabulary later)."""
    try:
        return [int(v) for v in _items(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 3,0,17, got {text!r}") from None


def seed_list(text: str) -> list[int]:
    """``"0,1"`` -> ``[0, 1]``: distinct integers >= 0."""
    try:
        values = [int(v) for v in _items(text)]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct comma-separated integers >= 0 like 0,1, got {text!r}")
    return values


def label_list(text: str) -> list[str]:
    """``"sw-ovq,sw-nope"`` -> ``["sw-ovq", "sw-nope"]``: a non-empty list of names."""
    try:
        return _items(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated model labels like sw-ovq,sw-nope, got {text!r}") \
            from None


def comma_list(item: type = str, allowed=None):
    """A parser of a non-empty comma-separated list of ``item`` values, a subset of ``allowed``
    when that is given (returned as a tuple)."""
    what = f"a comma-separated subset of {','.join(map(str, allowed))}" if allowed else \
        f"comma-separated values of type {item.__name__}"

    def parse(text: str) -> tuple:
        try:
            values = tuple(item(v) for v in _items(text))
        except ValueError:
            values = ()
        if not values or (allowed and any(v not in allowed for v in values)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
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
    if isinstance(default, tuple):
        default = ",".join(map(str, default)) or None
    return help if default is None else f"{help} (default: {default})"


def add_device(parser: argparse.ArgumentParser) -> None:
    """The ``--device`` flag of every command that runs torch: one default, one meaning
    (:func:`ovqflex.devices.resolve_device`)."""
    parser.add_argument("--device", default=devices.AUTO, help=_described(devices.NAMES, devices.AUTO))


class _Flag(typing.NamedTuple):
    field: dataclasses.Field
    kind: type  # bool, int, float, str, dict or tuple
    item: type | None  # the element type of a tuple
    flag: str  # the flag (the field's name for a positional argument)


def _value_type(cls: type, name: str, hint) -> tuple[type, type | None]:
    """``(kind, item)``: the flag's value type of a field annotated ``hint`` (``X | None`` -> X,
    ``tuple[X, ...]`` -> tuple of X)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(h for h in typing.get_args(hint) if h is not type(None))
    args = typing.get_args(hint)
    hint = typing.get_origin(hint) or hint
    if hint is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in (int, float, str):
        return tuple, args[0]
    if hint not in (bool, int, float, str, dict):
        raise TypeError(f"{cls.__name__}.{name}: a field of type {hint} has no command-line flag")
    return hint, None


def _flag(field: dataclasses.Field, kind: type) -> str:
    if field.metadata.get("positional"):
        return field.name
    default_on = kind is bool and field.default is True
    return field.metadata.get("flag") or ("--no-" if default_on else "--") + field.name.replace("_", "-")


def _fields(cls: type) -> list[_Flag]:
    """The flag of every field of the config dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind, item = _value_type(cls, f.name, hints[f.name])
        out.append(_Flag(f, kind, item, _flag(f, kind)))
    return out


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return None if f.default_factory is dataclasses.MISSING else f.default_factory()


def add_config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """A flag for every field of the config dataclass ``cls`` (see the module docstring); each
    flag stores under the field's name."""
    for f, kind, item, flag in _fields(cls):
        help = f.metadata.get("help", "")
        help = help() if callable(help) else help
        choices = f.metadata.get("choices")
        name = flag[2:].upper().replace("-", "_")
        if f.metadata.get("positional"):
            if kind not in (int, float, str):
                raise TypeError(f"{cls.__name__}.{f.name}: a positional argument must be an int, float or str")
            parser.add_argument(flag, type=kind, choices=choices, help=help)
        elif kind is bool and f.default is None:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help)
        elif kind is bool:
            parser.add_argument(flag, dest=f.name, action="store_false" if f.default else "store_true",
                                help=f"do not {help}" if f.default else help)
        elif kind is dict:
            parser.add_argument(flag, dest=f.name, action="append", metavar="NAME=VALUE", help=f"{help} (repeatable)")
        elif kind is tuple and f.metadata.get("repeatable"):
            parser.add_argument(flag, dest=f.name, type=item, action="append", choices=choices,
                                metavar=None if choices else name, help=f"{help} (repeatable)")
        elif kind is tuple:  # a comma list: its choices are checked (and shown) item by item
            items = "{" + ",".join(map(str, choices)) + "}" if choices else name
            parser.add_argument(flag, dest=f.name, type=comma_list(item, choices), default=_default(f),
                                metavar=f"{items}[,...]", help=_described(help, _default(f)))
        else:
            parser.add_argument(flag, dest=f.name, type=kind, default=_default(f), choices=choices,
                                metavar=None if choices else name, help=_described(help, _default(f)))


def config_from_args(cls: type, args: argparse.Namespace):
    """The config ``cls`` of the flags :func:`add_config_flags` added (a dict field from its
    ``NAME=VALUE`` items, a repeatable field from its items, its default when none is given);
    its values are checked by ``cls``."""
    def value(f: dataclasses.Field, kind: type, flag: str):
        given = getattr(args, f.name)
        if kind is dict:
            return parse_options(given, flag)
        if kind is tuple:
            return _default(f) if given is None else tuple(given)
        return given

    return cls(**{f.name: value(f, kind, flag) for f, kind, _, flag in _fields(cls)})
