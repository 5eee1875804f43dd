"""Regions of the versioned state layout (masks/versioned.py): what the liveness test reads past the state, and
which blocks the liveness of their rows lists."""
import pytest
import torch

from masks.blocks import build_block_layout
from masks.regions import Geometry
from masks.versioned import CheckpointBank, VersionRows


def _regions(rows: int, born: torch.Tensor, dies: torch.Tensor):
    """One checkpoint of ``rows`` rows per chunk (``every = 1``) and version rows after them, chunk 16."""
    live = torch.full((2,), rows, dtype=torch.int32)
    return (CheckpointBank(rows, 16, 1, 2, live, born, dies),
            VersionRows(16, 1, 1, 2, 2 * rows, born.shape[-1] - 2 * rows, born, dies))


@pytest.mark.parametrize("which", [0, 1], ids=["checkpoints", "version-rows"])
def test_rows_after_the_liveness_are_dead_even_when_its_last_row_is_live(which):
    """Every kv row after the liveness rows (state padding, then tokens) is dead for every query, however
    the last liveness row lives: here every row lives in every chunk."""
    n_rows = 13  # 2 checkpoints of 5 rows, 3 version rows; the state padded to 16 rows
    born = torch.zeros(1, 2, n_rows, dtype=torch.int32)
    dies = torch.full((1, 2, n_rows), 100, dtype=torch.int32)
    geom = Geometry(q_len=32, q_pad=32, n_state=16, kv_tokens=32, block_q=16, block_kv=16)
    region = _regions(5, born, dies)[which]
    p = region.params(geom, torch.device("cpu"))
    q_idx, kv_idx = torch.arange(32).view(-1, 1), torch.arange(geom.kv_len).view(1, -1)
    for h in range(2):
        seen = region.test_shared(p, q_idx, kv_idx, torch.tensor(0), torch.tensor(h))
        assert seen[:, :n_rows].all() and not seen[:, n_rows:].any()


def test_liveness_longer_than_the_state_is_refused():
    born = dies = torch.zeros(1, 1, 17, dtype=torch.int32)
    geom = Geometry(q_len=32, q_pad=32, n_state=16, kv_tokens=32, block_q=16, block_kv=16)
    with pytest.raises(ValueError, match="17 rows, more than the program's 16 state rows"):
        _regions(5, born, dies)[0].params(geom, torch.device("cpu"))


def test_a_block_is_listed_only_for_the_query_blocks_some_of_its_rows_live_in():
    """Counted by hand: one checkpoint of 32 rows read by 4 chunks of 16 queries (``every = 4``), blocks of 16.
    Block 0's rows live in every chunk: full for each query block. Block 1 holds 8 dead rows (``born = dies =
    0``, as padding is) and 8 rows living in chunk 2 only: listed (partial) for query block 2 alone: not in
    chunks 0 and 1, before its live rows are born (the dead rows' birth 0 must not count), nor in chunk 3,
    when they have died."""
    born = torch.tensor([0] * 16 + [0] * 8 + [2] * 8, dtype=torch.int32).view(1, 1, 32)
    dies = torch.tensor([4] * 16 + [0] * 8 + [3] * 8, dtype=torch.int32).view(1, 1, 32)
    region = CheckpointBank(32, 16, 4, 4, torch.tensor([32], dtype=torch.int32), born, dies)
    geom = Geometry(q_len=64, q_pad=64, n_state=32, kv_tokens=64, block_q=16, block_kv=16)
    layout = build_block_layout((region,), (region.params(geom, torch.device("cpu")),), geom)
    full = [layout.full_idx[r, : layout.full_num[r]].tolist() for r in range(4)]
    partial = [layout.kv_idx[r, : layout.kv_num[r]].tolist() for r in range(4)]
    assert full == [[0], [0], [0], [0]]
    assert partial == [[], [], [1], []]
