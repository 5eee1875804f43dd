"""The dtype rule at the boundary of every op (``ovqflex.ops``, ``masks.program.build_program``).

1. **One compute dtype.** q, k, v and the per-token inputs that travel with them (KVM's
   ``gate``, DeltaNet's ``beta``, VLA's ``u``) may arrive in different floating dtypes: under
   CUDA autocast ``F.normalize`` and ``layer_norm`` return fp32 while the projections return
   bf16. The op casts them all to one compute dtype (:func:`compute_dtype`):

   - autocast enabled for their device type: the autocast dtype (``torch.get_autocast_dtype``),
     as autocast runs ``scaled_dot_product_attention`` — unless one of them is float64, which
     autocast never touches (then float64);
   - otherwise their promoted dtype (``torch.promote_types``: fp32 with bf16 gives fp32).

   The output is in the compute dtype. Per-head parameters (OVQ/VQ ``beta``, KVM temperatures
   and ``LN_s``, the VQ codebook) are cast where they are used.

2. **Routing in fp32.** The discrete decisions (OVQ slots, KVM state rows, VQ codes) read fp32
   copies of the compute-dtype keys — OVQ and VQ the unit keys ``F.normalize(k.float())``
   (:func:`routing_keys`), KVM ``LN_s`` of ``k.float()`` with fp32 ``LN_s`` parameters; each copy
   an opaque custom op (:func:`~recurrences.compiling.eager_kernels`), so compiled code routes on the
   eager bits — with fp32 similarities, sums and counts, autocast switched off (:func:`no_autocast`:
   autocast would run the similarity matmuls in bf16, even inside the routing custom ops). The fused
   ops, the decode caches and the sequential references (``recurrences/reference``) all follow this,
   so on the same inputs, in any dtype, the fused op routes like its reference (up to near-ties, a
   similarity gap below 1e-6).
   A bf16 run and an fp32 run of the same model route differently: rounding the keys to bf16
   moves them across near-ties. That is a difference of inputs, not of the op.

3. The attention itself takes its program in the compute dtype and returns it; the scores, the
   softmax and the weighted sum are fp32 (flex accumulates in fp32; the ``blocked`` and ``dense``
   backends and a decode step's ``attend_rows`` upcast, with autocast off, which would run their
   matmuls in bf16 and round the scores before the softmax); the linear recurrences work in fp32
   and return the compute dtype. The state sums (``recurrences/segments.py``, ``versioned.py``: every
   method's dictionary, state or codebook rows before their readout) are kept in the compute dtype,
   summed in fp32 and rounded once: the CPU's scatter and scan accumulate in fp32; CUDA's ``index_add_``
   and scan add bf16 in bf16, rounding every add, so there a cell's tokens are summed in fp32 before
   their one add (``segments.NARROW_ADDS``) and the scans run in fp32 (``scan.NARROW_SCANS``); the
   version rows' scan is fp64. In bf16 they are within twice the error of rounding once the fp32 sums of
   the same tokens, where a bf16 running sum would stop growing
   (tests/recurrences/test_versioned.py::test_bf16_state_sums_are_rounded_about_once; the cuda tier
   checks the same on CUDA).

   **float64 stays float64** (a model or op run in fp64 to check the arithmetic, e.g. by gradcheck):
   everything above that is "fp32" is fp64 for fp64 inputs (:func:`work_dtype`, :func:`widened`): the
   state's sums (fp64 as the inputs are) and ``log(count)`` bias, the scores and softmax, the linear
   recurrences and LongVQ's EMA, RoPE's angles and the logits, so an fp64 op equals its fp64 reference
   to fp64 precision
   (tests/ovqflex/ops/test_dtypes.py::test_float64_ops_equal_their_references_in_float64).
   ``backend="auto"`` runs an fp64 program on ``blocked``: torch's CPU flex kernel takes fp32, bf16
   and fp16 only (an explicit ``"flex"`` is refused by name there).
   What stays fp32 in fp64: the routing copies (rule 2: the decisions, the references' too) and the
   decode caches' state (``ovqflex/ops/*_decode.py``: one set of fp32 sums serves routing and
   reading), so an fp64 OVQ, KVM or VQ layer decodes to within 4e-8 (relative) of its fp64 forward, the
   others to fp64 precision
   (tests/ovqflex/cache/test_streaming.py::test_a_float64_layer_decodes_like_its_float64_forward).

4. **The layers' arithmetic before the boundary, the same compiled and eager.** Under autocast, eager
   code rounds the output of every elementwise op to the autocast dtype, while a compiled graph
   fuses a chain of them and rounds once at its end. Measured on the CPU under bf16 autocast, the
   eager and compiled layers' q and k after a trained q/k convolution (``K`` products and sums)
   differed in about half of their elements, and KVM's gates ``1 + elu(x W_g)`` in 12%; a gate
   enters KVM's state sums, so at 1,000 tokens 0.3-2% of the routes differed. Such chains are
   computed in fp32 (:func:`widened`) and rounded once (:func:`rounded`), eager and compiled.
   Code documented as fp32 inside (LongVQ's damped EMA, the linear recurrences) switches autocast
   off (:func:`no_autocast`), which would otherwise run its matmuls in bf16. And a tensor a layer
   hands to a bf16 matmul is contiguous: eager kernels may round another layout otherwise.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .compiling import eager_kernels, realize


def compute_dtype(*xs: Tensor | None) -> torch.dtype:
    """The compute dtype of an op's floating inputs ``xs`` (None entries ignored; at least one
    tensor; all on one device type): the autocast dtype when autocast is on for their device
    type and none is float64, else their promoted dtype."""
    tensors = [x for x in xs if x is not None]
    promoted = functools.reduce(torch.promote_types, (x.dtype for x in tensors))
    device_type = tensors[0].device.type
    if promoted != torch.float64 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return promoted


def to_dtype(dtype: torch.dtype, *xs: Tensor | None) -> tuple[Tensor | None, ...]:
    """``xs`` cast to ``dtype`` (None stays None; a tensor already in ``dtype`` is returned as is)."""
    return tuple(None if x is None else x.to(dtype) for x in xs)


def to_compute_dtype(*xs: Tensor | None) -> tuple[Tensor | None, ...]:
    """``xs`` cast to their :func:`compute_dtype` (None stays None)."""
    return to_dtype(compute_dtype(*xs), *xs)


def work_dtype(x: Tensor) -> torch.dtype:
    """The dtype that computes on x: float32, or float64 for float64 x (rules 3 and 4)."""
    return torch.promote_types(x.dtype, torch.float32)


def widened(x: Tensor) -> Tensor:
    """x in its :func:`work_dtype` (bf16 and fp16 to fp32; fp32 and fp64 as they are): the precision of
    the backends' scores, the state's bias and the layers' elementwise chains (rules 3 and 4)."""
    return x.to(work_dtype(x))


def rounded(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype)``: the one rounding of a chain computed :func:`widened` (rule 4). While compiling,
    a bf16 or fp16 result passes :func:`~recurrences.compiling.realize`, so what reads it reads the
    rounded buffer: inductor may drop the rounding of an fp32 -> bf16 -> fp32 round trip inside one
    fused kernel (pytorch/pytorch#179561, torch 2.11 on CUDA; fixed by #180575), as when a norm under
    autocast reads the rounded q/k."""
    y = x.to(dtype)
    return y if y.dtype == x.dtype else _held(y)


def _held(x: Tensor) -> Tensor:
    """x; while compiling, a bf16/fp16 x passes :func:`~recurrences.compiling.realize`, whose output is a
    real buffer in x's dtype, so no fused kernel can skip its rounding (:func:`rounded`)."""
    if x.dtype in (torch.bfloat16, torch.float16) and torch.compiler.is_compiling():
        return realize(x)
    return x


def one_plus_elu(x: Tensor) -> Tensor:
    """``1 + elu(x)``, elementwise, without its cancellation: ``1 + x`` for ``x > 0``, ``exp(x)`` otherwise.
    Written as ``elu(x) + 1``, a negative x's value is ``exp(x) - 1`` rounded near -1 and then 1 added, which
    leaves ``exp(x)`` an absolute error of half an ulp of 1 (3e-8 in fp32): a relative error that grows as
    ``exp(-x)``, and 0 for every ``x < -17`` (fp32). Linear attention's and VLA's feature map and KVM's merge
    gates are this function; measured on linear attention in fp32 against the float64 reference loop, with
    queries and keys drawn from ``N(-8, 2)``: 1.4e-5 relative error written as ``elu(x) + 1``, 1.1e-7 so
    (tests/ovqflex/ops/test_linear.py::test_far_negative_features_equal_the_reference)."""
    # exp in place on clamp's fresh output (an allocation fewer: eager on the CPU as fast as elu + 1); relu's
    # gradient is 0 at 0, so the sum's there is elu's 1
    return torch.clamp(x, max=0).exp_() + F.relu(x)


def no_autocast(x: Tensor):
    """A context with autocast off for ``x``'s device type (routing, and code that computes in fp32 inside)."""
    return torch.autocast(x.device.type, enabled=False)


def routing_keys(k: Tensor) -> Tensor:
    """The fp32 unit keys OVQ and VQ routing read: k ``[B, H, T, D]`` (compute dtype) ->
    ``F.normalize(k.float())`` ``[B, H, T, D]`` fp32, detached; compiled too, the bits the eager
    op routes on (:func:`~recurrences.compiling.eager_kernels`)."""
    return _unit_keys(k.detach())


@eager_kernels("ovqflex::unit_keys", torch.float32)
def _unit_keys(k: Tensor) -> Tensor:
    return F.normalize(k.float(), dim=-1)
