"""One meaning of a device name for every entry point: ``auto`` (the default everywhere) is
CUDA when it is available, else the CPU."""
from __future__ import annotations

import torch

AUTO = "auto"
#: The device names, as the help of every ``--device`` flag of the ``ovqflex`` command line says them.
NAMES = "auto (cuda if available, else cpu), cpu, cuda or cuda:N"


def resolve_device(name: str = AUTO, local_rank: int = 0) -> torch.device:
    """The device ``name`` means: ``auto`` is cuda if available, else cpu; a bare ``cuda`` is
    ``cuda:local_rank``. A CUDA device where CUDA is not available, or a name torch does not
    know, is a ValueError naming it."""
    if name == AUTO:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be {NAMES}, got {name!r}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available here")
        if dev.index is None:
            dev = torch.device("cuda", local_rank)
    return dev


#: lines of torch's compile errors that say nothing of the failure itself: dynamo's closing advice and
#: the user's stack it quotes
_NOISE = ("Set TORCHDYNAMO_VERBOSE", "from user code:", "File \"")


def failure_line(error: BaseException, width: int = 120) -> str:
    """``"Type: message"`` of ``error`` in one line, for a report of what did not run on a device (a
    benchmark's error row, ``ovqflex info``): the first line of its message that says something, cut
    to ``width`` characters. A compile error of torch's closes its message with advice to set
    ``TORCHDYNAMO_VERBOSE`` and may quote the user's stack before it; neither is taken. An empty
    message gives the type alone."""
    said = next((line for line in (raw.strip() for raw in str(error).splitlines())
                 if line and not line.startswith(_NOISE)), "")
    text = f"{type(error).__name__}: {said}" if said else type(error).__name__
    return text if len(text) <= width else text[:width - 3] + "..."


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op elsewhere. Call it before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host tensors (a batch made on the CPU) on ``device``, without making the host wait for it. A copy
    to a GPU from pageable memory first synchronizes the stream (CUDA's documented behaviour, whatever
    ``non_blocking`` says): a training loop that copied each step's batch that way could not queue a step
    while the GPU still ran the last one. On CUDA a CPU tensor goes through pinned memory and is copied
    asynchronously (the pinned block is held until its copy has run); elsewhere it is ``.to(device)``."""
    if device.type != "cuda":
        return tuple(t.to(device) for t in tensors)
    return tuple(t.pin_memory().to(device, non_blocking=True) if t.device.type == "cpu" else t.to(device)
                 for t in tensors)
