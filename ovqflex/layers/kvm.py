"""``KVMAttention``: the Key-Value Means layer (docs/design.md §4.3, KVM paper, arXiv 2605.09877, appendix B weight preparation).

q, k: LayerNorm over ``head_dim`` (affine, one module each, shared by heads), then RoPE on
the first ``rope_dims`` channels as interleaved pairs; v plain. Merge gate
``g = 1 + elu(x W_g)`` (one scalar per token and head), state LayerNorm ``LN_s``,
temperatures ``tau_state, tau_bswa [H]`` initialised to 1.

Ablations (KVM paper, arXiv 2605.09877, §6): ``use_gate=False`` (g = 1), ``sink_len=0`` (no protected sinks),
``use_vlens=False`` (state values ``s_v / count``), ``use_temperatures=False`` (tau = 1).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from masks.program import AttentionProgram
from recurrences.checks import check_number, options_of
from recurrences.kvm import routing_memory_keys
from recurrences.precision import one_plus_elu, rounded, to_compute_dtype, widened

from ..cache.kvm import KVMCache, StaticKVMCache
from ..ops.decode import positions
from ..ops.kvm import KVMOptions, kvm_attention, kvm_program
from ..ops.kvm_decode import (KVMReadout, kvm_decode, kvm_decode_static, kvm_prefill, kvm_static,
                              kvm_static_boundary)
from ..profiling import stage
from .heads import MultiHeadProjection
from .options import OptionAttributes
from .rope import apply_rope


def _merge_gate(z: Tensor) -> Tensor:
    """The merge gates ``1 + elu(z)``: z ``[B, T, H]`` (``x W_g``) -> ``[B, H, T]`` in z's dtype, computed in
    fp32 without the sum's cancellation (:func:`~recurrences.precision.one_plus_elu`: a gate of a very negative
    ``z`` keeps its relative precision) and rounded once, so that eager and compiled layers give the same gates
    under autocast (recurrences/precision.py, rule 4). Laid out ``[B, H, T]`` before the elementwise ops, so
    that the gate and its gradient are contiguous in the layout the routing reads. (Its backward under
    ``backend="aot_eager"``, dynamo's debugging backend, had failed with ``F.elu``, whose eager backward laid a
    transposed gradient out otherwise than its meta function:
    tests/ovqflex/layers/test_kvm.py::test_layer_trains_under_the_aot_eager_debugging_backend.)"""
    return rounded(one_plus_elu(widened(z.transpose(1, 2).contiguous())), z.dtype)


class KVMAttention(OptionAttributes, MultiHeadProjection):
    """x ``[B, T, hidden]`` -> ``[B, T, hidden]``.

    Options: a :class:`~ovqflex.ops.kvm.KVMOptions` (``options=``) or its fields as keywords
    (``chunk_size``, ``n_bswa_chunks``, ``sink_len``, ``rope_dims``, the budget ``budget``,
    ``state_min_len``, ``growth_factor``, ``growth_exponent``, ``round_down``, ``saturation_n``,
    ``max_state_chunks``, and ``use_vlens``, ``ln_eps``, ``state_layout``, ``checkpoint_every``,
    ``block_size``, ``routing``); none is a parameter, so each may be changed at test time as an attribute
    (``layer.max_state_chunks = None``, or ``HybridLM.set_overrides(max_state_chunks=...)``).
    ``rope_base`` and the ablation switches ``use_gate``, ``use_temperatures`` decide the parameters.
    """

    cache_type = KVMCache  # forward(x, cache=None, use_cache=False): docs/design.md §6
    static_cache_type = StaticKVMCache
    options_type = KVMOptions

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None = None, rope_base: float = 10000.0,
                 use_gate: bool = True, use_temperatures: bool = True, qk_conv: int = 0, backend: str = "auto",
                 options: KVMOptions | None = None, **option_kwargs):
        super().__init__(hidden_size, num_heads, head_dim, backend, qk_conv)
        options = options_of(KVMOptions, options, option_kwargs, "KVM options")
        self.options = replace(options, rope_dims=options.head_rope_dims(self.head_dim))
        self.rope_base = check_number("rope_base", rope_base)
        D = self.head_dim
        self.q_norm, self.k_norm, self.ln_s = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D, eps=options.ln_eps)
        self.gate_proj = nn.Linear(hidden_size, num_heads, bias=False) if use_gate else None
        if use_temperatures:
            self.tau_state = nn.Parameter(torch.ones(num_heads))
            self.tau_bswa = nn.Parameter(torch.ones(num_heads))
        else:
            self.tau_state = self.tau_bswa = None

    def _project(self, x: Tensor, cache: KVMCache | None, use_cache: bool = False):
        """q, k (normalized, rotated at the positions after ``cache``), v ``[B, H, T, D]``, the gate
        ``[B, H, T]`` (None without ``gate_proj``) and the q/k conv tail."""
        start, conv_tail = (0, None) if cache is None else (cache.position, cache.conv)
        with stage("proj"):
            q, k, v, tail = self.split_heads_cached(x, conv_tail)
            pos = positions(start, x.shape[1], x.device)
            q = apply_rope(self.q_norm(q), pos, self.rope_dims, self.rope_base, interleaved=True)
            k = apply_rope(self.k_norm(k), pos, self.rope_dims, self.rope_base, interleaved=True)
            gate = None if self.gate_proj is None else _merge_gate(self.gate_proj(x))  # [B, H, T]
            # one compute dtype here already, so the cache paths see the tensors the op sees
            q, k, v, gate = to_compute_dtype(q, k, v, gate)
        return q, k, v, gate, tail

    def _readout(self) -> KVMReadout:
        return KVMReadout(self.ln_s.weight, self.ln_s.bias, self.tau_state, self.tau_bswa)

    def program(self, x: Tensor) -> AttentionProgram:
        """The layer's attention program for x ``[B, T, hidden]`` (what the visualizer draws)."""
        q, k, v, gate, _ = self._project(x, None)
        return kvm_program(q, k, v, gate, options=self.options, **self._readout()._asdict())[0]

    # forward(x, cache=None, use_cache=False, *, return_aux=False): AttentionLayer

    def _full(self, inputs) -> tuple[Tensor, dict]:
        q, k, v, gate, _ = inputs
        return kvm_attention(q, k, v, gate, backend=self.backend, options=self.options, **self._readout()._asdict()), {}

    def _cached_operands(self, inputs):
        """The cache paths' q, k, v, gate (ones without ``gate_proj``), fp32 memory keys, conv tail."""
        q, k, v, gate, tail = inputs
        gate = torch.ones(q.shape[:3], dtype=q.dtype, device=q.device) if gate is None else gate
        kbar32 = routing_memory_keys(k, self.rope_dims, self.ln_s.weight, self.ln_s.bias, self.options.ln_eps)
        return q, k, v, gate, kbar32, tail

    def _prefill(self, inputs) -> tuple[Tensor, KVMCache]:
        q, k, v, gate, kbar32, tail = self._cached_operands(inputs)
        readout, options = self._readout(), self.options
        o, state = kvm_attention(q, k, v, gate, backend=self.backend, return_state=True, options=options,
                                 **readout._asdict())
        return o, kvm_prefill(k, v, kbar32, gate, state.routes, state.founder, options, readout, tail)

    def _decode_step(self, inputs, cache: KVMCache) -> tuple[Tensor, KVMCache]:
        q, k, v, gate, kbar32, tail = self._cached_operands(inputs)
        return kvm_decode(cache, q, k, v, kbar32, gate, self.options, self._readout(), tail)

    def _static_cache(self, cache: KVMCache, capacity: int) -> StaticKVMCache:
        return kvm_static(cache, self.options, self._readout(), capacity)

    def _decode_static(self, inputs, cache: StaticKVMCache) -> Tensor:
        q, k, v, gate, kbar32, tail = self._cached_operands(inputs)
        return kvm_decode_static(cache, q, k, v, kbar32, gate, self.options, self._readout(), tail)

    def _static_boundary(self, cache: StaticKVMCache, position: int, *, compile: bool = False) -> None:
        """At a query chunk ``>= Nb``'s start, absorb the oldest window chunk in place
        (:func:`~ovqflex.ops.kvm_decode.kvm_static_boundary`; ``compile``: its compiled routing step)."""
        kvm_static_boundary(cache, self.options, self._readout(), position, compile=compile)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"chunk_size={self.chunk_size}, n_bswa_chunks={self.n_bswa_chunks}, sink_len={self.sink_len}, "
                f"rope_dims={self.rope_dims}, budget={self.budget!r}, max_state_chunks={self.max_state_chunks}, backend={self.backend!r}")
