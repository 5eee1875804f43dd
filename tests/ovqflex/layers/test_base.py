"""``AttentionLayer``, the one layer contract (docs/design.md §2, §6): what the conformance suite does
not check per method — the template's code objects per class, and the registry's refusal of a
layer outside the contract."""
import pytest
import torch
from torch import nn

import ovqflex
from ovqflex import AttentionLayer, Method, register_method
from ovqflex.methods import METHODS


def test_every_registered_layer_is_an_attention_layer_with_its_own_forward_code():
    """Each class runs the template through a code object of its own, so torch.compile keeps frame
    state (automatic dynamic shapes, recompile limits) per layer class."""
    classes = {m.layer for m in METHODS.values()}
    assert all(issubclass(c, AttentionLayer) for c in classes)
    codes = {c.forward.__code__ for c in classes}
    assert len(codes) == len(classes) and AttentionLayer.forward.__code__ not in codes
    assert ovqflex.OVQAttention.forward.__code__.co_name == "OVQAttention.forward"
    assert ovqflex.VQAttention.supports_cache and ovqflex.LinearAttention.supports_cache


def test_a_layer_outside_the_contract_is_not_registered():
    with pytest.raises(TypeError, match="layer must be a subclass of ovqflex.AttentionLayer"):
        register_method(Method("linear-module", nn.Linear, "not a layer of the contract"))
    assert "linear-module" not in METHODS


class _NoCacheLayer(AttentionLayer):
    """A plugged-in layer as small as the contract allows: no decode cache."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden_size = hidden

    def check_input(self, x):
        pass

    def _project(self, x, cache, use_cache):
        return x

    def _full(self, inputs):
        return inputs, {}

    def _output(self, o, inputs):
        return o


def test_a_layer_without_a_cache_refuses_cached_calls_by_name():
    layer, x = _NoCacheLayer(8), torch.randn(2, 5, 8)
    assert not layer.supports_cache and torch.equal(layer(x), x) and layer(x, return_aux=True)[1] == {}
    for call in (dict(use_cache=True), dict(cache=object())):
        with pytest.raises(NotImplementedError, match="_NoCacheLayer has no decode cache .*supports_cache=True"):
            layer(x, **call)


def test_a_decode_of_no_tokens_is_checked_and_a_static_step_takes_exactly_one():
    torch.manual_seed(0)
    layer = ovqflex.SlidingWindowAttention(16, 2, window=4, backend="dense")
    _, cache = layer(torch.randn(2, 5, 16), use_cache=True)
    y, same = layer(torch.randn(2, 0, 16), cache=cache)  # no tokens: an empty y and a copy of the cache
    assert y.shape == (2, 0, 16) and same is not cache and same.position == cache.position
    with pytest.raises(ValueError, match=r"x must have last dim hidden_size=16, got shape \(2, 0, 12\)"):
        layer(torch.randn(2, 0, 12), cache=cache)
    static = layer.static_cache(cache, 10)
    for T in (0, 2):
        with pytest.raises(ValueError, match=rf"a static cache decodes one token per call: x must be \[B, 1, hidden\], "
                                             rf"got \[2, {T}, 16\]"):
            layer(torch.randn(2, T, 16), cache=static)
