"""Input validation shared by every package (docs/design.md §2).

Bad input is refused early with a ``ValueError``/``TypeError`` that names the
argument, its value and what was expected. A config value or option of the wrong type,
or an option that is not a field, is a :class:`ConfigTypeError`: still a ``TypeError``, and
also a :class:`ConfigError`, which tells the user's mistake from a bug (a plain ``TypeError``).
This module is the lowest layer of the project (plain torch), so ``recurrences``,
``masks`` and ``ovqflex`` all use it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import types
import typing

import torch
from torch import Tensor

from .compiling import plain_options


class ConfigError(Exception):
    """Bad input refused by name (a config key, an option, a value): the user's mistake, not a bug.
    The ``ovqflex`` command line reports it as one line and exits with status 2."""


class ConfigTypeError(ConfigError, TypeError):
    """A config value or option of the wrong type, or an unknown option: a ``TypeError``, so
    callers catching ``TypeError`` keep working, and a :class:`ConfigError`."""


def check_tensor(name: str, x: object, ndim: int | None = None) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    return x


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, same_len: bool = True) -> None:
    """q, k: ``[B, H, T, D]``, v: ``[B, H, T, Dv]``, floating, on one device. Their dtypes may
    differ: the op brings them to one compute dtype (:mod:`recurrences.precision`)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, 4)
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"q, k, v must share [B, H]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim D; got q D={q.shape[-1]}, k D={k.shape[-1]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same length; got k T={k.shape[2]}, v T={v.shape[2]}")
    if same_len and q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same length T; got q T={q.shape[2]}, k T={k.shape[2]}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")


def check_layer_input(x: object, hidden_size: int, dtype: torch.dtype) -> Tensor:
    """A layer's input ``x [B, T, hidden_size]`` in the dtype of the layer's parameters
    (``dtype``), or any floating dtype under ``torch.autocast`` on x's device; finite, within
    :func:`finite_checks`."""
    check_tensor("x", x, 3)
    if x.shape[-1] != hidden_size:
        raise ValueError(f"x must have last dim hidden_size={hidden_size}, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating tensor of dtype {dtype} (the layer's parameters), got {x.dtype}")
    if x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"x must have dtype {dtype} (the layer's parameters), got {x.dtype}: cast the input "
                        f"(x.to({dtype})) or the layer (layer.to({x.dtype})), or run under torch.autocast")
    check_finite_args(None, x=x)
    return x


def check_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_chunk(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 16:
        raise ValueError(f"{name} must be a positive multiple of 16, got {value!r}")
    return value


def check_block_size(name: str, value: object) -> int:
    """An attention block size every backend serves: a power of two >= 16. FlexAttention's
    Triton kernels tile a block with power-of-two tiles that must divide it (the BlockMask's
    block sizes are checked against ``BLOCK_M``/``BLOCK_N`` in torch's flex lowering)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (16, 32, 64, 128, ...), got {value!r}")
    return value


def check_choice(name: str, value: object, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def host_check_is_free(x: Tensor) -> bool:
    """Whether a data-dependent branch on ``x`` costs nothing: eager code (not being traced by
    ``torch.compile``) on the CPU, where reading a value needs no device sync. Fast paths that
    are exact only for finite inputs branch on a cheap finiteness check there, and take the
    branch-free general path elsewhere."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


_FINITE_CHECKS = False  # the default of every op's ``check_finite`` (None); set by :func:`finite_checks`


@contextlib.contextmanager
def finite_checks(enabled: bool = True):
    """Within the block every op refuses non-finite tensor arguments and every layer a non-finite
    input ``x`` — as ``check_finite=True`` on each call — unless a call passes ``check_finite=False``.
    A debugging aid: each check reads the tensor's values on the host (a device sync), and compiled
    code cannot take it (:func:`check_finite_args`). Process-wide, not per thread; blocks nest."""
    global _FINITE_CHECKS
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__} {enabled!r}")
    before, _FINITE_CHECKS = _FINITE_CHECKS, enabled
    try:
        yield
    finally:
        _FINITE_CHECKS = before


def check_finite_tensor(name: str, x: Tensor) -> None:
    """Refuse a tensor holding nan or inf, naming it, how many and where the first is (reads ``x``
    on the host)."""
    bad = ~torch.isfinite(x)
    if bad.any():
        first = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"{name} must be finite, got {int(bad.sum())} non-finite value(s) (nan or inf) in shape "
                         f"{tuple(x.shape)}, the first at index {first}")


def check_finite_args(check_finite: bool | None, **tensors: Tensor | None) -> None:
    """An op's ``check_finite`` option: with True (None: the :func:`finite_checks` setting, off by
    default) every tensor given must be finite (None ones are skipped). ``torch.compile`` cannot
    trace the check: with ``fullgraph=True`` a True is refused by this error; without, dynamo runs
    the op's check in eager mode (a graph break)."""
    if check_finite is None:
        check_finite = _FINITE_CHECKS
    elif not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be a bool or None, got {type(check_finite).__name__} {check_finite!r}")
    if not check_finite:
        return
    if torch.compiler.is_compiling():
        raise ValueError("check_finite=True reads tensor values on the host, which a torch.compile(fullgraph=True) "
                         "graph cannot do; check in eager mode, or leave it off when compiling")
    for name, x in tensors.items():
        if x is not None:
            check_finite_tensor(name, x)


def check_number(name: str, value: object, *, minimum: float = 0, strict: bool = True) -> float:
    """A finite real number ``> minimum`` (``>= minimum`` with ``strict=False``); bools, NaN and
    infinities refused. (``minimum``'s default is the int 0: see :func:`recurrences.compiling.pad_to`
    on float defaults under ``torch.compile(dynamic=True)``; finiteness is compared, not
    ``math.isfinite``, for the same reason.)"""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not (value > minimum if strict else value >= minimum) or not value < math.inf:  # NaN fails both
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return float(value)


def check_companion(name: str, x: object, shape: tuple, like: Tensor) -> Tensor:
    """A per-token input that travels with ``like`` (e.g. a gate ``[B, H, T]`` next to q):
    a floating tensor of exactly ``shape`` on ``like``'s device (any floating dtype: the op
    casts it with q, k, v, :mod:`recurrences.precision`)."""
    check_tensor(name, x, len(shape))
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if x.device != like.device:
        raise ValueError(f"{name} must be on device {like.device} (as q), got {x.device}")
    return x


def check_keys(what: str, keys, known, error: type[Exception] = ValueError) -> None:
    """Refuse the ``keys`` (e.g. of a config dict) that are not in ``known``: an ``error`` naming
    each unknown key with the nearest known one (``difflib``) and listing the known keys."""
    known = sorted(map(str, known))
    unknown = [str(k) for k in keys if str(k) not in known]
    if not unknown:
        return
    named = []
    for key in unknown:
        near = difflib.get_close_matches(key, known, n=1)
        named.append(f"{key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    raise error(f"{what}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(named)}; "
                f"known keys: {', '.join(known)}")


def _matches(value: object, hint) -> bool:
    """Whether ``value`` (from JSON/TOML) fits the type ``hint`` of a dataclass field (``int``,
    ``float`` (ints too), ``bool``, ``str``, ``dict``, ``list[X]``, ``tuple[X, ...]`` (a list or a
    tuple of X), ``X | None``)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint) or (typing.Any,)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if _is_tuple_of(hint):
        return isinstance(value, (list, tuple)) and all(_matches(v, typing.get_args(hint)[0]) for v in value)
    if hint is typing.Any:
        return True
    return isinstance(value, origin or hint)


def _is_tuple_of(hint) -> bool:
    """Whether ``hint`` is ``tuple[X, ...]``."""
    args = typing.get_args(hint)
    return typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis


def _type_name(hint) -> str:
    return getattr(hint, "__name__", None) if typing.get_origin(hint) is None else str(hint).replace("typing.", "")


def from_dict(cls: type, d: dict, what: str):
    """``cls(**d)`` for a dataclass ``cls``, with clear errors: unknown keys are refused with the
    nearest valid key suggested (:func:`check_keys`), missing required keys and values of the
    wrong type are named; a list for a ``tuple[X, ...]`` field (JSON has no tuples) becomes a tuple.
    ``what`` says where the dict comes from (a file, a table)."""
    if not isinstance(d, dict):
        raise ConfigTypeError(f"{what} must be a table/dict, got {type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    check_keys(what, d, fields)
    missing = [n for n, f in fields.items() if n not in d and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{what}: missing key{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")
    hints = typing.get_type_hints(cls)
    for key, value in d.items():
        if not _matches(value, hints[key]):
            raise ConfigTypeError(f"{what}: {key} must be {_type_name(hints[key])}, got {type(value).__name__} {value!r}")
    return cls(**{k: tuple(v) if _is_tuple_of(hints[k]) else v for k, v in d.items()})


def options_of(cls: type, options: object, kwargs: dict, what: str):
    """A method's options: ``options`` (an instance of the frozen dataclass ``cls``, already
    validated) or ``cls(**kwargs)`` (validated by its ``__post_init__``). Both at once, or a keyword
    that is not a field of ``cls``, is a :class:`ConfigTypeError` naming it (with the nearest field); ``what``
    names the options (e.g. ``"OVQ options"``). Under ``torch.compile`` their numbers are plain values
    (:func:`~recurrences.compiling.plain_options`: a graph serves one set of options)."""
    if options is None:  # (dataclasses.fields does not trace under torch.compile; __dataclass_fields__ does)
        check_keys(what, kwargs, cls.__dataclass_fields__, error=ConfigTypeError)
        return plain_options(cls(**kwargs))
    if kwargs:
        raise TypeError(f"{what}: give options or keyword options, not both (got options and {sorted(kwargs)})")
    if not isinstance(options, cls):
        raise TypeError(f"options must be of type {cls.__name__}, got {type(options).__name__}")
    return plain_options(options)
