"""``KVMAttention``: the Key-Value Means layer (docs/design.md §4.3, KVM paper, arXiv 2605.09877, appendix B weight preparation).

q, k: LayerNorm over ``head_dim`` (affine, one module each, shared by heads), then RoPE on
the first ``rope_dims`` channels as interleaved pairs; v plain. Merge gate
``g = 1 + elu(x W_g)`` (one scalar per token and head), state LayerNorm ``LN_s``,
temperatures ``tau_state, tau_bswa [H]`` initialised to 1.

Ablations (KVM paper, arXiv 2605.09877, §6): ``use_gate=False`` (g = 1), ``sink_len=0`` (no protected sinks),
``use_vlens=False`` (state values ``s_v / count``), ``use_temperatures=False`` (tau = 1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from masks.program import DEFAULT_BLOCK, AttentionProgram
from recurrences.kvm import KVMBudget, routing_memory_keys
from recurrences.precision import to_compute_dtype

from ..cache.base import check_cache, positions
from ..cache.kvm import KVMCache, KVMDecodeOptions, kvm_decode, kvm_prefill
from ..ops.kvm import check_kvm_options, kvm_attention, kvm_program
from ..profiling import stage
from .heads import MultiHeadProjection
from .rope import apply_rope


class KVMAttention(MultiHeadProjection):
    """x ``[B, T, hidden]`` -> ``[B, T, hidden]``.

    Budget options (``budget``, ``state_min_len``, ``growth_factor``, ``growth_exponent``,
    ``round_down``, ``saturation_n``, ``max_state_chunks``) are those of
    :func:`ovqflex.kvm_attention`; none is a parameter, so they may be changed at test time
    (``layer.max_state_chunks = None``, or ``HybridLM.set_overrides(max_state_chunks=...)``).
    ``state_layout`` ("auto" | "snapshot" | "versioned") and ``checkpoint_every``: how the state is
    laid out as kv rows (docs/design.md §5); same outputs.
    """

    supports_cache = True  # forward(x, cache=None, use_cache=False): docs/design.md §6

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None = None, chunk_size: int = 128,
                 n_bswa_chunks: int = 2, sink_len: int = 1, rope_dims: int | None = None,
                 rope_base: float = 10000.0, budget: str = "fixed", state_min_len: int | None = None,
                 growth_factor: float = 16.0, growth_exponent: float = 0.5, round_down: int = 1,
                 saturation_n: int = 1024, max_state_chunks: int | None = 1, use_gate: bool = True,
                 use_vlens: bool = True, use_temperatures: bool = True, qk_conv: int = 0, backend: str = "auto",
                 state_layout: str = "auto", checkpoint_every: int | None = None, block_size: int = DEFAULT_BLOCK):
        super().__init__(hidden_size, num_heads, head_dim, backend, qk_conv)
        rope_dims = check_kvm_options(self.head_dim, chunk_size, n_bswa_chunks, sink_len, rope_dims, state_layout,
                                      checkpoint_every, block_size)
        self.state_layout, self.checkpoint_every = state_layout, checkpoint_every
        D = self.head_dim
        KVMBudget(budget, state_min_len, growth_factor, growth_exponent, round_down, saturation_n, max_state_chunks)
        self.budget, self.state_min_len, self.max_state_chunks = budget, state_min_len, max_state_chunks
        self.growth_factor, self.growth_exponent = growth_factor, growth_exponent
        self.round_down, self.saturation_n = round_down, saturation_n
        self.chunk_size, self.n_bswa_chunks, self.sink_len = chunk_size, n_bswa_chunks, sink_len
        self.rope_dims, self.rope_base, self.use_vlens = rope_dims, rope_base, use_vlens
        self.block_size = block_size  # checked by check_kvm_options (check_state_layout)
        self.q_norm, self.k_norm, self.ln_s = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.gate_proj = nn.Linear(hidden_size, num_heads, bias=False) if use_gate else None
        if use_temperatures:
            self.tau_state = nn.Parameter(torch.ones(num_heads))
            self.tau_bswa = nn.Parameter(torch.ones(num_heads))
        else:
            self.tau_state = self.tau_bswa = None

    def _prepare(self, x: Tensor, start: int = 0, conv_tail: Tensor | None = None):
        """q, k (normalized, rotated at positions ``start..``), v ``[B, H, T, D]``, the op's
        keyword options and the q/k conv tail."""
        with stage("proj"):
            q, k, v, tail = self.split_heads_cached(x, conv_tail)
            pos = positions(start, x.shape[1], x.device)
            q = apply_rope(self.q_norm(q), pos, self.rope_dims, self.rope_base, interleaved=True)
            k = apply_rope(self.k_norm(k), pos, self.rope_dims, self.rope_base, interleaved=True)
            gate = None if self.gate_proj is None else (1.0 + F.elu(self.gate_proj(x))).transpose(1, 2)  # [B, H, T]
            # one compute dtype here already, so the cache paths see the tensors the op sees
            q, k, v, gate = to_compute_dtype(q, k, v, gate)
        options = dict(gate=gate, ln_s_weight=self.ln_s.weight, ln_s_bias=self.ln_s.bias, tau_state=self.tau_state,
                       tau_bswa=self.tau_bswa, chunk_size=self.chunk_size, n_bswa_chunks=self.n_bswa_chunks,
                       sink_len=self.sink_len, rope_dims=self.rope_dims, budget=self.budget,
                       state_min_len=self.state_min_len, growth_factor=self.growth_factor,
                       growth_exponent=self.growth_exponent, round_down=self.round_down,
                       saturation_n=self.saturation_n, max_state_chunks=self.max_state_chunks,
                       use_vlens=self.use_vlens, ln_eps=self.ln_s.eps, state_layout=self.state_layout,
                       checkpoint_every=self.checkpoint_every, block_size=self.block_size)
        return q, k, v, options, tail

    def program(self, x: Tensor) -> AttentionProgram:
        """The layer's attention program for x ``[B, T, hidden]`` (what the visualizer draws)."""
        q, k, v, options, _ = self._prepare(x)
        return kvm_program(q, k, v, **options)[0]

    def _decode_options(self) -> KVMDecodeOptions:
        budget = KVMBudget(self.budget, self.state_min_len, self.growth_factor, self.growth_exponent,
                           self.round_down, self.saturation_n, self.max_state_chunks)
        return KVMDecodeOptions(self.chunk_size, self.n_bswa_chunks, self.sink_len, budget, self.use_vlens,
                                self.ln_s.weight, self.ln_s.bias, self.ln_s.eps, self.tau_state, self.tau_bswa)

    def forward(self, x: Tensor, cache: KVMCache | None = None, use_cache: bool = False):
        """x ``[B, T, hidden]`` -> y ``[B, T, hidden]``; ``(y, cache)`` with ``use_cache=True`` or
        a ``cache`` (:class:`~ovqflex.cache.KVMCache`) to continue from."""
        check_cache(cache, KVMCache, self)
        start, conv = (0, None) if cache is None else (cache.position, cache.conv)
        q, k, v, options, tail = self._prepare(x, start, conv)
        if cache is None and not use_cache:
            o, new_cache = kvm_attention(q, k, v, backend=self.backend, **options), None
        else:
            gate = options["gate"]
            gate = torch.ones(q.shape[:3], dtype=q.dtype, device=q.device) if gate is None else gate
            kbar32 = routing_memory_keys(k, self.rope_dims, self.ln_s.weight, self.ln_s.bias, self.ln_s.eps)
            if cache is None:
                o, state = kvm_attention(q, k, v, backend=self.backend, return_state=True, **options)
                new_cache = kvm_prefill(k, v, kbar32, gate, state.routes, state.founder, self._decode_options(), tail)
            else:
                o, new_cache = kvm_decode(cache, q, k, v, kbar32, gate, self._decode_options(), tail)
        with stage("proj"):
            y = self.merge(o)
        return y if new_cache is None else (y, new_cache)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"chunk_size={self.chunk_size}, n_bswa_chunks={self.n_bswa_chunks}, sink_len={self.sink_len}, "
                f"rope_dims={self.rope_dims}, budget={self.budget!r}, max_state_chunks={self.max_state_chunks}, backend={self.backend!r}")
