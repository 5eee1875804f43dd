"""``ovqflex info``: what runs here — torch, device, which backends work forward/backward, how
OVQ and KVM route by default."""
from __future__ import annotations

import platform
import time

import torch

from recurrences.compiling import resolve_routing

from .attention import training_backend
from .devices import AUTO, failure_line, resolve_device
from .ops.plain import sliding_window_attention


def _probe(backend: str, device: torch.device, backward: bool) -> str:
    q, k, v = (torch.randn(1, 2, 128, 16, device=device, requires_grad=backward) for _ in range(3))
    t0 = time.perf_counter()
    try:
        with torch.set_grad_enabled(backward):
            out = sliding_window_attention(q, k, v, window=32, backend=backend)
            if backward:
                out.sum().backward()
    except NotImplementedError:
        return "no (not implemented here)"
    except Exception as e:  # report, never crash `info`
        return f"no ({failure_line(e, 100)})"
    return f"yes ({time.perf_counter() - t0:.2f} s incl. compile)" if backend == "flex" else "yes"


def collect(device: str = AUTO) -> list[tuple[str, str]]:
    """What runs on ``device`` (:func:`ovqflex.devices.resolve_device`): versions, the device, and
    whether each backend works forward and backward there."""
    dev = resolve_device(device)
    rows = [
        ("ovqflex", __import__("ovqflex").__version__),
        ("torch", torch.__version__),
        ("python", platform.python_version()),
        ("device", f"{dev.type}" + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else
                                    f" ({platform.machine()}, {torch.get_num_threads()} threads)")),
        ("compile backend", "inductor (torch.compile, dynamic=False for flex)"),
    ]
    for backend in ("flex", "blocked", "dense"):
        rows.append((f"{backend} forward", _probe(backend, dev, False)))
        rows.append((f"{backend} backward", _probe(backend, dev, True)))
    rows.append(("auto (no grad)", "flex"))
    rows.append(("auto (training)", training_backend(dev)))
    rows.append(("routing auto (OVQ, KVM)", "static: compiled step, one CUDA graph per input shape"
                 if resolve_routing("auto", dev) == "static" else "loop: one step per chunk"))
    return rows
