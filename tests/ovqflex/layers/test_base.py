"""``AttentionLayer``, the one layer contract (docs/design.md §2, §6): what the conformance suite does
not check per method — the template's code objects per class, and the registry's refusal of a
layer outside the contract."""
import pytest
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
