"""Inductor's CUDA code for one static routing step, generated on a machine without a GPU.

    python tools/cuda_codegen.py {ovq,kvm} [--heads H] [--dim D] [--chunk L] [--rows R]
                                 [--normalize-centroids] [--opaque-absorb] [--code]

Prints the launches of the step's compiled wrapper (``recurrences/ovq/routing_static.py::
ovq_static_step``, ``recurrences/kvm/routing_static.py::kvm_static_step``, compiled as on CUDA:
``fullgraph=True, dynamic=False``, no grad, the absorb fused unless ``--opaque-absorb``: the
modules' ``FUSED_ABSORB``): one line per Triton kernel, library
call (cuBLAS) and opaque op, then their count. A step replayed from a CUDA graph is bound by its
launches (README, GPU routing table), so this is what a change to a step is first judged by where
no GPU is at hand; ``--code`` prints the whole wrapper and kernels' source.

Needs torch built for CUDA, with triton: ``pip install torch==2.11.0`` in a venv gives the GPU
machine's version (docs/torch-versions.md). No GPU and no driver: torch's device queries are
answered with an H100's properties, the inputs are fake tensors, and code generation stops before
anything is compiled for or run on a device. What it cannot do: time anything; trace a backward
(autograd's engine asks the driver); or compile ``flex_attention`` (tracing its mask makes small
real device tensors), so the ops' and layers' graphs are out of its reach.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys
import types

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

#: what the device queries answer: an H100 SXM (sm_90)
H100 = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
                             regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                             max_threads_per_block=1024, warp_size=32, total_memory=80 * 2**30,
                             L2_cache_size=50 * 2**20, gcnArchName="")


class _CodegenDone(Exception):
    """Raised once the wrapper's code is written: nothing is compiled for a device after it."""


def _answer_device_queries() -> None:
    """Answer the device queries inductor's CUDA code generation makes, without a driver."""
    if not torch.backends.cuda.is_built():
        raise SystemExit("this torch is not built for CUDA: `pip install torch==2.11.0` (a CUDA build) in a venv")
    from torch._dynamo import device_interface
    from torch._subclasses import fake_tensor
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    torch.cuda.get_device_properties = lambda *a, **k: H100
    torch.cuda.get_device_capability = lambda *a, **k: (H100.major, H100.minor)
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    cuda = device_interface.CudaInterface
    cuda.get_device_properties = staticmethod(lambda *a, **k: H100)
    cuda.get_compute_capability = staticmethod(lambda *a, **k: 10 * H100.major + H100.minor)
    cuda.current_device = staticmethod(lambda: 0)
    cuda.device_count = staticmethod(lambda: 1)
    cuda.is_available = staticmethod(lambda: True)
    fake_tensor.init_gpu_context = lambda device: None  # it would allocate on the device

    class Target:  # triton's driver, as far as inductor's code generation asks it
        def get_current_target(self):
            return GPUTarget("cuda", 10 * H100.major + H100.minor, H100.warp_size)

        def get_current_device(self):
            return 0

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

    driver.set_active(Target())


def _stop_after_codegen(store: list[str]) -> None:
    """Keep the wrapper's code (its kernels' source inside) once inductor has written it, then stop."""
    from torch._inductor.graph import GraphLowering

    codegen = GraphLowering.codegen

    def keep(self):
        wrapper, _ = codegen(self)
        store.append(wrapper.value)
        raise _CodegenDone

    GraphLowering.codegen = keep


def launches(wrapper: str) -> list[str]:
    """The launches of a wrapper's ``call``: Triton kernels (``name.run``), library calls
    (``extern_kernels.bmm``) and opaque ops (``torch.ops.ns.op``), in order."""
    body = wrapper[wrapper.index("def call(self, args)"):]
    found = re.findall(r"^\s*(?:\w+ = )?((?:extern_kernels|torch\.ops)\.[\w.]+|\w+\.run)\(", body, re.M)
    return [name.removesuffix(".run") for name in found]


def step_inputs(method: str, heads: int, dim: int, chunk: int, rows: int, normalize: bool):
    """``(step, args, kwargs)`` of one static step on fake CUDA tensors (B = 1, fp32)."""
    e = lambda *s, dtype=torch.float32: torch.empty(*s, device="cuda", dtype=dtype)  # noqa: E731
    B, H, L, D, R = 1, heads, chunk, dim, rows
    if method == "ovq":
        from recurrences.ovq import routing_static as rs
        args = (e(B, H, L, D), e(B, H, R + 1, D), e(B, H, R + 1), e(2, dtype=torch.long), None)
        kw = dict(normalize_centroids=normalize, means=e(B, H, R + 1, D), out=e(B, H, L, dtype=torch.long))
        return rs.ovq_static_step, args, kw
    from recurrences.kvm import routing_static as rs
    args = (e(B, H, L, D), e(B, H, L), e(B, H, R + 1, D), e(2, dtype=torch.long), e(D), e(D))
    kw = dict(sink_len=1, ln_eps=1e-5, rows=e(B, H, R + 1, D), key_rows=e(B, H, L, D),
              out=(e(B, H, L, dtype=torch.long), e(B, H, L, dtype=torch.bool)))
    return rs.kvm_static_step, args, kw


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("method", choices=["ovq", "kvm"])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--rows", type=int, default=None,
                   help="state rows R read by a step (default: OVQ 2048, KVM 4096, as at 64k tokens)")
    p.add_argument("--normalize-centroids", action="store_true", help="OVQ: unit dictionary rows")
    p.add_argument("--opaque-absorb", action="store_true",
                   help="the absorb as the opaque op of eager kernels (FUSED_ABSORB off), not fused")
    p.add_argument("--code", action="store_true", help="print the whole generated wrapper")
    args = p.parse_args(argv)
    rows = args.rows or {"ovq": 2048, "kvm": 4096}[args.method]

    _answer_device_queries()
    from torch._inductor import config
    from torch._subclasses.fake_tensor import FakeTensorMode

    config.compile_threads = 1
    config.joint_graph_constant_folding = False  # it would run the graph's constants on the device
    store: list[str] = []
    _stop_after_codegen(store)
    fake = FakeTensorMode()
    with fake:
        step, step_args, kw = step_inputs(args.method, args.heads, args.dim, args.chunk, rows,
                                          args.normalize_centroids)
    sys.modules[step.__module__].FUSED_ABSORB["cuda"] = not args.opaque_absorb  # the step's routing_static
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    try:
        with fake, torch.no_grad():
            compiled(*step_args, **kw)
    except Exception:  # dynamo wraps _CodegenDone in its own errors; the code kept says it was reached
        if not store:
            raise
    if args.code:
        print(store[-1])
    names = launches(store[-1])
    print(f"{args.method} static step, H={args.heads}, D={args.dim}, chunk {args.chunk}, {rows} rows, "
          f"{'opaque' if args.opaque_absorb else 'fused'} absorb, torch {torch.__version__}:")
    for name in names:
        print(f"  {name}")
    opaque = sum(name.startswith("torch.ops.") for name in names)
    library = sum(name.startswith("extern_kernels.") for name in names)
    print(f"{len(names)} launches: {len(names) - opaque - library} Triton kernels, {library} library calls, "
          f"{opaque} opaque ops (each runs its own eager kernels, one or more)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
