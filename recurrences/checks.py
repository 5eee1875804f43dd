"""Input validation shared by every package (SPEC §2).

Bad input is refused early with a ``ValueError``/``TypeError`` that names the
argument, its value and what was expected. This module is the lowest layer of
the project (plain torch), so ``recurrences``, ``masks`` and ``ovqflex`` all use it.
"""
from __future__ import annotations

import torch
from torch import Tensor


def check_tensor(name: str, x: object, ndim: int | None = None) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(x.shape)}")
    return x


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, same_len: bool = True) -> None:
    """q, k: ``[B, H, T, D]``, v: ``[B, H, T, Dv]``; one dtype (floating) and device."""
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
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")


def check_layer_input(x: object, hidden_size: int, dtype: torch.dtype) -> Tensor:
    """A layer's input ``x [B, T, hidden_size]`` in the dtype of the layer's parameters
    (``dtype``), or any floating dtype under ``torch.autocast`` on x's device."""
    check_tensor("x", x, 3)
    if x.shape[-1] != hidden_size:
        raise ValueError(f"x must have last dim hidden_size={hidden_size}, got shape {tuple(x.shape)}")
    if torch.is_autocast_enabled(x.device.type):
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating tensor, got dtype {x.dtype}")
    elif x.dtype != dtype:
        raise TypeError(f"x must have dtype {dtype} (the layer's parameters), got {x.dtype}: cast the input "
                        f"(x.to({dtype})) or the layer (layer.to({x.dtype})), or run under torch.autocast")
    return x


def check_int(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_chunk(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 16:
        raise ValueError(f"{name} must be a positive multiple of 16, got {value!r}")
    return value


def check_choice(name: str, value: object, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")
    return value


def check_finite(name: str, x: Tensor) -> None:
    """Opt-in (host-syncing) check used when ``check_finite=True``."""
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} contains non-finite values (nan or inf)")


def check_number(name: str, value: object, *, minimum: float = 0.0, strict: bool = True) -> float:
    """A real number ``> minimum`` (``>= minimum`` with ``strict=False``); bools refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not (value > minimum if strict else value >= minimum) or value != value:
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return float(value)


def check_companion(name: str, x: object, shape: tuple, like: Tensor, *, same_dtype: bool = True) -> Tensor:
    """A per-token input that travels with ``like`` (e.g. a gate ``[B, H, T]`` next to q):
    a floating tensor of exactly ``shape`` with ``like``'s device and (``same_dtype``) dtype."""
    check_tensor(name, x, len(shape))
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if same_dtype and x.dtype != like.dtype:
        raise TypeError(f"{name} must have dtype {like.dtype} (as q), got {x.dtype}")
    if x.device != like.device:
        raise ValueError(f"{name} must be on device {like.device} (as q), got {x.device}")
    return x
