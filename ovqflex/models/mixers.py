"""``HybridLM`` mixers: the methods of :data:`ovqflex.methods.METHODS` with a ``from_config``.

Each mixer is an :class:`~ovqflex.layers.AttentionLayer`: ``x [B, T, d_model] -> [B, T, d_model]``,
``(y, aux)`` with ``return_aux=True`` (an aux loss: ``vq``, ``longvq``). A pattern naming a method
that is not a mixer is refused with the list of the mixers; a new method becomes a mixer by registering it (:func:`ovqflex.methods.register_method`).
"""
from __future__ import annotations

from torch import nn

from ..methods import METHODS, Method, method_names
from .config import HybridConfig


def _is_mixer(m: Method) -> bool:
    return m.is_mixer


def available_mixers() -> list[str]:
    return method_names(_is_mixer)


def build_mixer(name: str, config: HybridConfig) -> nn.Module:
    """The layer of mixer ``name`` for a block of a ``HybridLM`` of ``config``."""
    if name not in available_mixers():
        raise ValueError(f"pattern names unknown mixer {name!r}; available: {available_mixers()}")
    return METHODS[name].mixer(config)
