"""OVQAttention layer: parameters, overrides and compilation (the op: tests/ovqflex/ops/test_ovq.py)."""
import torch

import ovqflex
from tests.helpers import assert_trains_compiled_once


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
