"""Snapshot layout == versioned layout through the layers (docs/design.md §5, §9.5; the ops:
tests/ovqflex/ops/test_state_layout.py)."""
import pytest
import torch

import ovqflex
from tests.helpers import FWD_TOL, assert_close, assert_trains_compiled_once, checked_square_loss


def test_layer_compiles_versioned_without_graph_break_or_recompile():
    torch.manual_seed(0)
    layer = ovqflex.OVQAttention(64, 2, chunk_size=32, max_centroids=48, backend="blocked", state_layout="versioned",
                                 checkpoint_every=2)
    assert_trains_compiled_once(layer, checked_square_loss(layer, torch.randn(2, 200, 64)))


def test_kvm_layer_versioned_equals_snapshot():
    torch.manual_seed(0)
    layer = ovqflex.KVMAttention(32, 2, chunk_size=16, budget="saturation", saturation_n=64, max_state_chunks=None,
                                 backend="blocked", state_layout="versioned", checkpoint_every=2)
    x = torch.randn(1, 150, 32)
    ver = layer(x)
    layer.state_layout = "snapshot"
    assert_close(ver, layer(x), FWD_TOL[torch.float32], "layer")


@pytest.mark.parametrize("make, match", [
    (lambda: ovqflex.OVQAttention(32, 2, state_layout="versioned-ish"), "state_layout"),
    (lambda: ovqflex.OVQAttention(32, 2, checkpoint_every=1.5), "checkpoint_every"),
    (lambda: ovqflex.KVMAttention(32, 2, state_layout=None), "state_layout"),
    (lambda: ovqflex.VQAttention(32, 2, state_layout="chunked"), "state_layout"),
], ids=["ovq-layer-layout", "ovq-layer-every", "kvm-layer-layout", "vq-layer-layout"])
def test_bad_state_layout_raises(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()
