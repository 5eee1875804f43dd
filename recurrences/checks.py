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
