"""``LongVQBlock``: the LongVQ block (LongVQ paper, §4.2–4.3; docs/design.md §4.5).

    Z   = silu(EMA(X))                  multi-head damped EMA as a causal convolution
    G_a = silu(Z W_g),  Q = Z W_q,  K = Z W_k,  V = silu(X W_v)
    O_a = (G_a ⊙ VQAttn(Q, K̂, V)) W_h   softmax VQ-attention (docs/design.md §4.4) with a learned
                                        per-head local bias on the window region
    G_o = sigmoid(X W_o),  O = G_o ⊙ O_a + (1 − G_o) ⊙ X
    Y   = Norm(O),  Y' = Norm(Y + FFN(Y))

``W_h`` maps the ``H * head_dim_v`` attention output back to ``hidden`` (MEGA's output
projection; the paper's equations leave it implicit). The FFN gets a residual (as MEGA's
and every post-norm Transformer's FFN; the paper's eq. 22 omits it). The local bias ``B`` is
one learned scalar per head (init 0) added to the scores of the quantized keys of the
query's own and previous chunk, relative to the codebook (state) rows — folded exactly into
the state rows' bias (see :func:`ovqflex.vq_attention`); its gradient needs a backend with
bias gradients: ``blocked``/``dense`` (CPU training), or ``flex`` where it supports
captured-tensor gradients.

``forward(x [B, T, hidden]) -> y [B, T, hidden]`` (``(y, aux)`` with ``return_aux=True``); the codebook trains as in
:class:`~ovqflex.layers.VQAttention` (EMA buffers updated in training-mode forwards).
In a :class:`~ovqflex.models.HybridLM` (pattern ``"longvq"``) the block replaces the whole
pre-norm mixer + MLP block (``standalone_block = True``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from masks.program import AttentionProgram
from recurrences.checks import check_int, check_layer_input, check_number, options_of
from recurrences.ema import damped_ema

from ..cache.vq import LongVQCache, StaticLongVQCache
from ..ops.vq import VQOptions, vq_program
from ..profiling import stage
from .base import AttentionLayer
from .options import OptionAttributes
from .vq import VQCodebook, VQInputs, VQMemory


@dataclass
class LongVQInputs(VQInputs):
    """:class:`~ovqflex.layers.vq.VQInputs` plus the block's input x ``[B, T, hidden]`` and gates
    ``g_a [B, T, H*Dv]``, ``g_o [B, T, hidden]``."""

    x: Tensor
    g_a: Tensor
    g_o: Tensor


class LongVQBlock(VQMemory, OptionAttributes, AttentionLayer):
    """The block; its VQ attention's options are a :class:`~ovqflex.ops.vq.VQOptions` (``options=``)
    or its fields as keywords (``chunk_size``, ``estimator``, ``state_layout``, ``checkpoint_every``,
    ``block_size``), each an attribute (``estimator`` fixed once built)."""

    standalone_block = True
    cache_type = LongVQCache  # forward(x, cache=None, use_cache=False): docs/design.md §6
    static_cache_type = StaticLongVQCache
    options_type = VQOptions
    fixed_options = ("estimator",)

    def __init__(self, hidden_size: int, num_heads: int = 1, *, head_dim: int | None = None, ema_dim: int = 16,
                 codebook_size: int = 512, commitment_weight: float = 1e-4, ema_decay: float = 0.99,
                 dead_threshold: float = 0.01, ffn_ratio: float = 2.0, norm_eps: float = 1e-5, backend: str = "auto",
                 options: VQOptions | None = None, **option_kwargs):
        super().__init__()
        check_int("hidden_size", hidden_size)
        check_int("num_heads", num_heads)
        check_int("ema_dim", ema_dim)
        self.options = options_of(VQOptions, options, option_kwargs, "VQ options")
        self.backend = backend  # (checked when set)
        check_number("ffn_ratio", ffn_ratio)
        check_number("norm_eps", norm_eps)
        check_number("commitment_weight", commitment_weight, minimum=0.0, strict=False)
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
        H, Dv = num_heads, hidden_size // num_heads
        Dk = Dv if head_dim is None else check_int("head_dim", head_dim)
        self.hidden_size, self.num_heads, self.head_dim, self.head_dim_v = hidden_size, H, Dk, Dv
        self.commitment_weight = commitment_weight
        # damped EMA parameters (MEGA's initialisation)
        self.ema_delta = nn.Parameter(torch.randn(hidden_size, ema_dim) * 0.2)
        self.ema_alpha = nn.Parameter(torch.randn(hidden_size, ema_dim) * 0.2)
        self.ema_beta = nn.Parameter(torch.randn(hidden_size, ema_dim) * 0.02 + (torch.arange(ema_dim) % 2 * -2 + 1))
        self.ema_gamma = nn.Parameter(torch.randn(hidden_size, ema_dim) / math.sqrt(ema_dim))
        self.ema_omega = nn.Parameter(torch.randn(hidden_size) * 0.1)
        self.z_proj = nn.Linear(hidden_size, 2 * H * Dk + H * Dv)  # -> Q, K, G_a
        self.x_proj = nn.Linear(hidden_size, H * Dv + hidden_size)  # -> V, G_o
        self.h_proj = nn.Linear(H * Dv, hidden_size)
        self.quantizer = VQCodebook(H, codebook_size, Dk, estimator=self.options.estimator, ema_decay=ema_decay,
                                    dead_threshold=dead_threshold)
        self.beta = nn.Parameter(torch.full((H,), math.sqrt(Dk)))
        self.local_bias = nn.Parameter(torch.zeros(H))
        ffn = int(ffn_ratio * hidden_size)
        self.ffn = nn.Sequential(nn.Linear(hidden_size, ffn), nn.SiLU(), nn.Linear(ffn, hidden_size))
        self.norm1 = nn.LayerNorm(hidden_size, eps=norm_eps)
        self.norm2 = nn.LayerNorm(hidden_size, eps=norm_eps)

    def check_input(self, x: Tensor) -> None:
        """x ``[B, T, hidden]`` in the projections' dtype (any floating dtype under autocast)."""
        check_layer_input(x, self.hidden_size, self.z_proj.weight.dtype)

    def _qkv_gates(self, x: Tensor, ema_state: Tensor | None = None, want_state: bool = False):
        """q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]``, the gates, and (``want_state``) the EMA
        state after x, continuing from ``ema_state`` ``[B, hidden, ema_dim]`` (None: a sequence
        start); else None."""
        self.check_input(x)
        B, T, _ = x.shape
        H, Dk, Dv = self.num_heads, self.head_dim, self.head_dim_v
        z = damped_ema(x, self.ema_delta, self.ema_alpha, self.ema_beta, self.ema_gamma, self.ema_omega,
                       h0=ema_state, output_final_state=want_state)
        z, state = z if want_state else (z, None)
        z = F.silu(z)
        q, k, g_a = self.z_proj(z).split([H * Dk, H * Dk, H * Dv], dim=-1)
        v, g_o = self.x_proj(x).split([H * Dv, self.hidden_size], dim=-1)
        heads = lambda t, d: t.view(B, T, H, d).transpose(1, 2)  # noqa: E731
        return heads(q, Dk), heads(k, Dk), heads(F.silu(v), Dv), F.silu(g_a), torch.sigmoid(g_o), state

    def program(self, x: Tensor) -> AttentionProgram:
        """The block's VQ attention program for x ``[B, T, hidden]`` (what the visualizer draws)."""
        with stage("proj"):
            q, k, v, _, _, _ = self._qkv_gates(x)
        return vq_program(q, k, v, self.quantizer.codebook, self.beta, local_bias=self.local_bias,
                          code_bias=self.quantizer.code_bias(), options=self.options)[0]

    # forward(x, cache=None, use_cache=False, *, return_aux=False): AttentionLayer; the attention: VQMemory.
    # The cache (LongVQCache; static: StaticLongVQCache) is the VQ cache plus the EMA state.

    def _project(self, x: Tensor, cache: LongVQCache | None, use_cache: bool) -> LongVQInputs:
        with stage("proj"):
            q, k, v, g_a, g_o, ema = self._qkv_gates(x, None if cache is None else cache.ema, want_state=use_cache)
        fields = {"conv": None} if ema is None else {"conv": None, "ema": ema.detach()}
        return LongVQInputs(q, k, v, fields, x, g_a, g_o)

    def _output(self, o: Tensor, inputs: LongVQInputs) -> Tensor:
        """o ``[B, H, T, Dv]`` -> y ``[B, T, hidden]``: the gated residual, the norms and the FFN."""
        with stage("proj"):
            B, H, T, Dv = o.shape
            o_a = self.h_proj(inputs.g_a * o.transpose(1, 2).reshape(B, T, H * Dv))
            y = self.norm1(inputs.g_o * o_a + (1 - inputs.g_o) * inputs.x)
            return self.norm2(y + self.ffn(y))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"chunk_size={self.chunk_size}, backend={self.backend!r}")
