"""OVQAttention layer: parameters, overrides and compilation (the op: tests/ovqflex/ops/test_ovq.py)."""
import pytest
import torch

import ovqflex
from recurrences.reference import ovq_attention_reference
from tests.helpers import FWD_TOL, assert_close, assert_parameter_gradients_match, assert_trains_compiled_once


def test_layer_equals_the_reference_loop_on_its_projections():
    """The layer is its projections (with the q/k convolution), the paper's chunk loop over them with the layer's
    beta (away from its initial value) and the output projection: forward and every parameter's gradient."""
    torch.manual_seed(0)
    layer = ovqflex.OVQAttention(32, 2, chunk_size=16, max_centroids=24, qk_conv=3, backend="blocked")
    with torch.no_grad():
        layer.beta.mul_(torch.tensor([0.5, 1.5]))
    x = torch.randn(2, 100, 32)
    q, k, v = layer.split_heads(x)
    ref = layer.merge(ovq_attention_reference(q, k, v, layer.beta, chunk_size=16, max_centroids=24).out)
    out = layer(x)
    assert_close(out, ref, FWD_TOL[torch.float32], "forward")
    assert_parameter_gradients_match(layer, out, ref)


def test_layer_compiles_without_graph_break_or_recompile():
    torch.manual_seed(0)
    layer = ovqflex.OVQAttention(64, 2, chunk_size=32, max_centroids=48, backend="blocked")
    assert_trains_compiled_once(layer, lambda compiled, step: compiled(torch.randn(2, 200, 64)).square().mean())


def test_layer_beta_init_and_max_centroids_override():
    layer = ovqflex.OVQAttention(64, 4, chunk_size=16, max_centroids=8, backend="blocked")
    assert torch.allclose(layer.beta, torch.full((4,), 4.0))
    x = torch.randn(1, 160, 64)
    small, large = layer(x), layer(x, max_centroids=64)
    assert small.shape == large.shape == x.shape
    assert not torch.allclose(small, large)  # a larger dictionary changes what late chunks read


def test_a_cache_keeps_the_cap_it_was_made_with():
    """A prefill at one ``max_centroids`` holds that dictionary: a decode step at another, functional or
    static, is refused by name (it would read a dictionary built under another schedule)."""
    torch.manual_seed(0)
    layer = ovqflex.OVQAttention(32, 2, chunk_size=16, max_centroids=24, backend="dense").eval()
    x = torch.randn(2, 40, 32)
    match = "max_centroids=48 differs from the cache's 24; start a new cache"
    with torch.no_grad():
        _, cache = layer(x[:, :37], use_cache=True)
        static = layer.static_cache(cache, 40)
        for c in (cache, static):
            with pytest.raises(ValueError, match=match):
                layer(x[:, 37:38], cache=c, max_centroids=48)
            assert layer(x[:, 37:38], cache=c, max_centroids=24)[0].shape == (2, 1, 32)
