"""``ovqflex/training/distributed.py`` without a process group: the collectives are stood in for (the
gloo run of two ranks under ``torchrun`` is ``test_trainer.py``'s slow data-parallel test)."""
import pytest
import torch

import ovqflex.training.distributed as distributed
from ovqflex.training.distributed import DistInfo, all_reduce_sum_, init_distributed


def test_all_reduce_sums_every_tensor_through_one_flat_buffer(monkeypatch):
    """One collective for all the tensors, each given back its own slice of the sum, in place."""
    calls = []

    def all_reduce(flat, op):  # another rank's values: 100 x the position in the buffer
        calls.append((flat.shape, op))
        flat.add_(100 * torch.arange(flat.numel(), dtype=flat.dtype))

    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce)
    a, b, c = torch.arange(6.0).view(2, 3), torch.tensor([0.5]), torch.ones(2, 2, dtype=torch.float32)
    all_reduce_sum_([a, b, c], DistInfo(world_size=2))
    assert calls == [(torch.Size([11]), distributed.dist.ReduceOp.SUM)]
    assert torch.equal(a, torch.arange(6.0).view(2, 3) * 101)
    assert b.tolist() == [600.5] and c.flatten().tolist() == [701.0, 801.0, 901.0, 1001.0]
    all_reduce_sum_([a], DistInfo())  # a single process: nothing to sum
    all_reduce_sum_([], DistInfo(world_size=2))
    assert len(calls) == 1


@pytest.mark.parametrize("device_type, backend", [("cpu", "gloo"), ("cuda", "nccl")])
def test_init_joins_the_group_torchrun_describes(monkeypatch, device_type, backend):
    joined = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: bool(joined))
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend: joined.append(backend))
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 4)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed(device_type) == DistInfo() and joined == []
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_distributed(device_type) == DistInfo() and joined == []
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    info = init_distributed(device_type)
    assert info == DistInfo(rank=3, world_size=4, local_rank=1) and joined == [backend]
    assert info.enabled and not info.is_main and DistInfo().is_main and not DistInfo().enabled
    assert not DistInfo(rank=4, world_size=8, local_rank=0).is_main  # a second node's first rank is not rank 0
    init_distributed(device_type)  # a group already joined is not joined again
    assert joined == [backend]
