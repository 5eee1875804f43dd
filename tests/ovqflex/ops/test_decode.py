"""``ovqflex/ops/decode.py``: the helpers the softmax ops' decode paths share (docs/design.md §6)."""
import torch

from masks.regions import BlockWindow, Causal
from ovqflex.ops.decode import chunk_segments, positions, slot_positions, slot_visibility, slotted


def test_chunk_segments_split_new_tokens_at_chunk_boundaries():
    assert chunk_segments(0, 5, 16) == [(0, 5)]
    assert chunk_segments(13, 22, 16) == [(0, 3), (3, 16), (19, 3)]  # tokens 13..34: to 16, to 32, the rest
    assert chunk_segments(32, 16, 16) == [(0, 16)]
    assert chunk_segments(7, 0, 16) == []


def test_positions_are_absolute():
    assert torch.equal(positions(5, 3, "cpu"), torch.tensor([5, 6, 7]))


def test_slots_of_a_ring():
    """Tokens 5..9 in a ring of 4 slots (position p in slot p % 4) keep the last 4 — 6, 7, 8, 9 — in
    slots 2, 3, 0, 1; a ring of 6 leaves two slots empty (-1)."""
    pos = torch.arange(6, 10)
    rows = pos.view(1, 1, 4, 1).float().expand(2, 3, 4, 5)  # [B, H, n, D], each row holding its position
    ring = slotted(rows, 4, pos % 4)
    assert ring.shape == (2, 3, 4, 5) and torch.equal(ring[1, 2, :, 4], torch.tensor([8.0, 9.0, 6.0, 7.0]))
    assert torch.equal(slot_positions(pos, 4, pos % 4), torch.tensor([8, 9, 6, 7]))
    assert torch.equal(slot_positions(pos, 6, pos % 6), torch.tensor([6, 7, 8, 9, -1, -1]))


def test_slot_visibility_is_the_window_over_filled_slots():
    """Tokens 20..39 in a ring of 48 slots (28 empty), a block window of 2 chunks of 16: the query at
    40 sees chunks 1 and 2 up to itself, i.e. the filled slots of positions 20..39; the query at 31
    (chunk 1) sees positions 20..31; empty slots never, even where the regions alone would show
    their -1 (causal attention: -1 <= p)."""
    pos = slot_positions(torch.arange(20, 40), 48, torch.arange(20, 40) % 48)
    for regions, p, first, last in (((BlockWindow(2, 16),), 40, 20, 39), ((BlockWindow(2, 16),), 31, 20, 31),
                                    ((Causal(),), 40, 20, 39), ((Causal(),), 25, 20, 25)):
        want = (pos >= first) & (pos <= last)
        assert torch.equal(slot_visibility(regions, torch.tensor([p]), pos), want), (regions, p)
