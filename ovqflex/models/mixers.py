"""The mixer registry: pattern names -> layer factories ``(config) -> nn.Module``.

Each mixer maps ``x [B, T, d_model] -> [B, T, d_model]`` (or ``(y, aux)`` with an aux loss:
``vq``, ``longvq``). Methods that land later register here with :func:`register_mixer`; a pattern naming an unregistered mixer is refused with the list
of available ones.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from ..layers import (CausalAttention, DeltaNetAttention, KVMAttention, LinearAttention, LongVQBlock, OVQAttention,
                      SlidingWindowAttention, VLAAttention, VQAttention)
from .config import HybridConfig

MixerFactory = Callable[[HybridConfig], nn.Module]
_MIXERS: dict[str, MixerFactory] = {}
_PLANNED: tuple[str, ...] = ()


def register_mixer(name: str, factory: MixerFactory) -> None:
    _MIXERS[name] = factory


def available_mixers() -> list[str]:
    return sorted(_MIXERS)


def _attn_kwargs(c: HybridConfig, name: str) -> dict:
    return dict(head_dim=c.head_dim, qk_conv=c.qk_conv, backend=c.backend, block_size=c.block_size,
                **c.mixer_options.get(name, {}))


def build_mixer(name: str, config: HybridConfig) -> nn.Module:
    if name not in _MIXERS:
        extra = f" ('{name}' is planned but not built yet)" if name in _PLANNED else ""
        raise ValueError(f"pattern names unknown mixer {name!r}{extra}; available: {available_mixers()}")
    return _MIXERS[name](config)


register_mixer("full", lambda c: CausalAttention(c.d_model, c.n_heads, rope=True, rope_base=c.rope_base,
                                                 qk_norm=c.qk_norm, **_attn_kwargs(c, "full")))
register_mixer("nope", lambda c: CausalAttention(c.d_model, c.n_heads, rope=False, qk_norm=c.qk_norm,
                                                 **_attn_kwargs(c, "nope")))
register_mixer("swa", lambda c: SlidingWindowAttention(c.d_model, c.n_heads, window=c.window, rope=True,
                                                       rope_base=c.rope_base, qk_norm=c.qk_norm,
                                                       **_attn_kwargs(c, "swa")))
register_mixer("bswa", lambda c: SlidingWindowAttention(c.d_model, c.n_heads, block_window=c.bswa_chunks,
                                                        chunk_size=c.chunk_size, rope=True, rope_base=c.rope_base,
                                                        qk_norm=c.qk_norm, **_attn_kwargs(c, "bswa")))
register_mixer("ovq", lambda c: OVQAttention(c.d_model, c.n_heads, chunk_size=c.chunk_size,
                                             max_centroids=c.max_centroids, growth=c.growth, seeding=c.seeding,
                                             **_attn_kwargs(c, "ovq")))
register_mixer("kvm", lambda c: KVMAttention(c.d_model, c.n_heads, chunk_size=c.chunk_size,
                                             n_bswa_chunks=c.bswa_chunks, rope_base=c.rope_base,
                                             **_attn_kwargs(c, "kvm")))

register_mixer("vq", lambda c: VQAttention(c.d_model, c.n_heads, chunk_size=c.chunk_size, **_attn_kwargs(c, "vq")))
register_mixer("longvq", lambda c: LongVQBlock(c.d_model, c.n_heads, chunk_size=c.chunk_size, backend=c.backend,
                                               block_size=c.block_size, norm_eps=c.norm_eps,
                                               **({"head_dim": c.head_dim} | c.mixer_options.get("longvq", {}))))


def _recurrent_kwargs(c: HybridConfig, name: str) -> dict:
    """Non-softmax recurrences: no backend or attention block; the q/k conv and head dim apply."""
    return dict(head_dim=c.head_dim, qk_conv=c.qk_conv, **c.mixer_options.get(name, {}))


register_mixer("linear", lambda c: LinearAttention(c.d_model, c.n_heads, **_recurrent_kwargs(c, "linear")))
register_mixer("deltanet", lambda c: DeltaNetAttention(c.d_model, c.n_heads, **_recurrent_kwargs(c, "deltanet")))
register_mixer("vla", lambda c: VLAAttention(c.d_model, c.n_heads, **_recurrent_kwargs(c, "vla")))
