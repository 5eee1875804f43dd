"""Decode caches (docs/design.md §6): bounded state a layer carries from one call to the next.

``layer(x, use_cache=True) -> (y, cache)`` after a prefill of any length;
``layer(x, cache=cache) -> (y, cache)`` continues with one or more tokens. Each cache
type documents its size bound; ``cache.nbytes()`` is its own accounting.
"""
from .base import LayerCache
from .kvm import KVMCache
from .ovq import OVQCache
from .plain import PlainCache
from .recurrent import DeltaNetCache, LinearAttentionCache, VLACache
from .vq import LongVQCache, VQCache

__all__ = ["DeltaNetCache", "KVMCache", "LayerCache", "LinearAttentionCache", "LongVQCache", "OVQCache", "PlainCache",
           "VLACache", "VQCache"]
