"""Decode caches (docs/design.md §6): bounded state a layer carries from one call to the next.

``layer(x, use_cache=True) -> (y, cache)`` after a prefill of any length;
``layer(x, cache=cache) -> (y, cache)`` continues with one or more tokens. Each cache
type documents its size bound; ``cache.nbytes()`` is its own accounting. The ``Static*`` caches
are their in-place forms (``layer.static_cache(cache, capacity)``, docs/design.md §6 "Static decode").
"""
from .base import LayerCache, StaticLayerCache
from .kvm import KVMCache, StaticKVMCache
from .ovq import OVQCache, StaticOVQCache
from .plain import PlainCache, StaticPlainCache
from .recurrent import (DeltaNetCache, LinearAttentionCache, StaticDeltaNetCache, StaticLinearAttentionCache,
                        StaticVLACache, VLACache)
from .vq import LongVQCache, StaticLongVQCache, StaticVQCache, VQCache

__all__ = ["DeltaNetCache", "KVMCache", "LayerCache", "LinearAttentionCache", "LongVQCache", "OVQCache", "PlainCache",
           "StaticDeltaNetCache", "StaticKVMCache", "StaticLayerCache", "StaticLinearAttentionCache",
           "StaticLongVQCache", "StaticOVQCache", "StaticPlainCache", "StaticVLACache", "StaticVQCache", "VLACache",
           "VQCache"]
