"""CUDA's rules where they differ from the CPU's, followed on a CPU: for tools and tests that trace or run code
as it would run on a GPU, without one.

    from tools.cuda_rules import follow_cuda_rules
    follow_cuda_rules()   # in a process of its own: it registers kernels for ATen ops

Two rules differ. CUDA's autocast runs :data:`CUDA_FP32_OPS` (``layer_norm``, ``sum``, ``exp``, the norms, ...)
in fp32, where the CPU's keeps their input's dtype; and CUDA's ``index_add_`` and scans add bf16 and fp16 in
that dtype, rounding every add, so the state sums take their fp32-accumulating branches there
(``recurrences.segments.NARROW_ADDS``, ``recurrences.scan.NARROW_SCANS``; docs/precision.md, "State sums in
bf16"). Followed, an op that leaves such an op to autocast shows on the CPU what it does on CUDA:
KVM's ``LN_s`` had made a bf16 layer's key sums fp32 there (``tools/compiled_saved.py`` traces with these
rules; ``tests/ovqflex/ops/test_dtypes.py`` runs every op under them).
"""
from __future__ import annotations

import torch

#: ATen ops CUDA's autocast runs in fp32 (torch's AMP reference, "CUDA Ops that can autocast to float32", as ATen
#: names; the losses left out) where the CPU's keeps their input's dtype: :func:`follow_cuda_rules`
CUDA_FP32_OPS = ("layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "exp", "expm1", "log",
                 "log1p", "log2", "log10", "reciprocal", "rsqrt", "pow", "softplus", "sum", "cumsum", "cumprod",
                 "prod", "softmax", "_softmax", "log_softmax", "_log_softmax", "logsumexp", "norm",
                 "linalg_vector_norm", "acos", "asin", "cosh", "sinh", "tan", "erfinv", "cdist", "renorm")

_library = None  # the registrations of follow_cuda_rules, kept alive: dropping the library unregisters them


def follow_cuda_rules() -> None:
    """From now on in this process, follow CUDA's rules on the CPU: the state sums' branches for bf16 and fp16
    (CUDA's adds round in the narrow dtype, so its sums accumulate in fp32 and round once), and CUDA's autocast
    rule for :data:`CUDA_FP32_OPS` under the CPU's autocast: a bf16 or fp16 input runs in fp32, the result
    fp32 (an op given an explicit ``dtype`` is left alone, as autocast leaves it). Calling it again changes
    nothing."""
    global _library
    from torch._C import DispatchKey, DispatchKeySet, _ExcludeDispatchKeyGuard

    import recurrences.scan
    import recurrences.segments

    recurrences.scan.NARROW_SCANS["cpu"] = recurrences.segments.NARROW_ADDS["cpu"] = True
    if _library is not None:
        return
    low = (torch.bfloat16, torch.float16)

    def widen(x):
        if isinstance(x, torch.Tensor) and x.dtype in low:
            return x.float()
        return type(x)(widen(a) for a in x) if isinstance(x, (list, tuple)) else x

    def kernel_of(op):
        def kernel(*args, **kwargs):
            if kwargs.get("dtype") is None:
                args, kwargs = widen(args), {k: widen(v) for k, v in kwargs.items()}
            with _ExcludeDispatchKeyGuard(DispatchKeySet(DispatchKey.AutocastCPU)):
                return op(*args, **kwargs)
        return kernel

    _library = torch.library.Library("aten", "IMPL")
    for name in CUDA_FP32_OPS:
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            if overload.endswith("out") or overload.endswith("_"):
                continue  # in-place and out= variants are not autocast's (torch's AMP reference)
            _library.impl(name if overload == "default" else f"{name}.{overload}", kernel_of(getattr(packet, overload)),
                          "AutocastCPU")
