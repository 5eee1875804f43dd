"""Data parallelism under ``torchrun``: gloo on CPU, NCCL on GPU.

Every rank builds the same model from the same seed and takes its slice of the global
batch (rows ``rank*b .. rank*b+b-1``, see :func:`ovqflex.tasks.make_batch`); gradients
are summed with one all-reduce of a flat buffer. The loss is normalised by the *global*
number of target tokens, so the summed gradient equals the single-process gradient of
the same global batch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group ``torchrun`` describes (``WORLD_SIZE`` > 1); else single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def all_reduce_sum_(tensors: list[torch.Tensor], info: DistInfo) -> None:
    """In-place sum of ``tensors`` over ranks (one flat buffer, one collective)."""
    if not info.enabled or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
