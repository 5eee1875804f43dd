"""``ovqflex/ops/decode.py``: the helpers the softmax ops' decode paths share (docs/design.md §6)."""
import torch

from ovqflex.ops.decode import chunk_segments, positions


def test_chunk_segments_split_new_tokens_at_chunk_boundaries():
    assert chunk_segments(0, 5, 16) == [(0, 5)]
    assert chunk_segments(13, 22, 16) == [(0, 3), (3, 16), (19, 3)]  # tokens 13..34: to 16, to 32, the rest
    assert chunk_segments(32, 16, 16) == [(0, 16)]
    assert chunk_segments(7, 0, 16) == []


def test_positions_are_absolute():
    assert torch.equal(positions(5, 3, "cpu"), torch.tensor([5, 6, 7]))
