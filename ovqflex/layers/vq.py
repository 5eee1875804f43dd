"""``VQAttention``: the VQ-attention layer (Transformer-VQ; the OVQ paper's sw-vq; docs/design.md §4.4),
and ``VQCodebook``, the codebook module it shares with :class:`~ovqflex.layers.LongVQBlock`.

Codebook training. With ``estimator="ste"`` (default) the codebook is a *buffer* learned by
EMA k-means, like BatchNorm's running statistics: every ``forward`` in training mode updates
it in place (after the attention has used the old codebook), and codes whose EMA count falls
below ``dead_threshold`` are revived with random keys of the batch. ``eval()`` freezes it.
The update is part of the forward, so it runs under ``torch.compile(fullgraph=True)`` too
(dynamo functionalizes the buffer mutation). Under data parallelism (``torchrun``, DDP) the update
sums its statistics over the ranks first (:attr:`VQCodebook.sync_ranks`): the ranks keep one codebook,
the global batch's, where each had drifted to its own. The training state (the EMA counts
and sums, the idle-step counts) stays fp32 when the model is cast to bf16 or fp16 (``model.to(torch.bfloat16)``),
as BatchNorm's statistics would not: a 0.99 decay in bf16 rounds most updates away (after 400 updates a bf16
layer's codebook had drifted 5% from the same updates in fp32), and a bf16 count stops at 256 steps. Since the
forward updates that state, activation checkpointing, which re-runs a training forward in the backward, is
refused by name there, eager or compiled (:func:`training_snapshot`: the re-run would read the updated codebook).
With ``estimator="diveq"`` the codebook is an ``nn.Parameter`` trained by the optimizer
through DiVeQ's gradient, and dead codes get the OVQ paper's "no-use penalty": a bonus of
``penalty_rate`` per training step without a token, added to the code's assignment score.

``forward(x, return_aux=True)`` returns ``(y, aux)``: ``aux["loss"]`` (``commitment_weight ·
commitment``, add it to the training loss; :class:`~ovqflex.models.HybridLM` does with
``return_aux=True``) and detached metrics ``usage``, ``perplexity``, ``unused_codes``, ``dead_codes``, ``rel_quant_error``,
``commitment``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from masks.program import AttentionProgram, scaled_unit_queries, unit_rows
from recurrences.checks import check_choice, check_int, check_number, options_of
from recurrences.precision import routing_keys, work_dtype
from recurrences.vq import ESTIMATORS, assign_codes, code_histogram, ema_update_
from recurrences.vq.codebook import gather_codes

from ..cache.vq import StaticVQCache, VQCache
from ..ops.vq import VQOptions, vq_attention, vq_program
from ..ops.vq_decode import vq_decode, vq_decode_static, vq_prefill, vq_static, vq_static_boundary
from ..profiling import stage
from .heads import MultiHeadProjection
from .options import OptionAttributes


class VQCodebook(nn.Module):
    """Per-head unit-norm codebook ``[H, N, D]`` and its training state (see module doc)."""

    #: buffers that accumulate over training steps: never narrower than fp32 (:meth:`_apply`)
    accumulators = ("ema_counts", "ema_sums", "idle_steps")
    #: in a data-parallel run (a ``torch.distributed`` group of several ranks) each training step's update reads
    #: the statistics of every rank's keys, summed with one all-reduce, so the ranks keep one codebook, the one
    #: a single process would learn from the global batch; False: each rank updates its own from its own batch
    #: (for groups whose ranks see the same data, e.g. tensor parallelism, where the sums would count it twice)
    sync_ranks: bool = True

    def __init__(self, num_heads: int, codebook_size: int, head_dim: int, *, estimator: str = "ste",
                 ema_decay: float = 0.99, dead_threshold: float = 0.01, penalty_rate: float = 0.0025,
                 dead_after: int = 100):
        super().__init__()
        check_int("codebook_size", codebook_size)
        check_choice("estimator", estimator, ESTIMATORS)
        check_number("ema_decay", ema_decay, minimum=0.0, strict=False)
        if ema_decay >= 1:
            raise ValueError(f"ema_decay must be < 1, got {ema_decay!r}")
        check_number("dead_threshold", dead_threshold, minimum=0.0, strict=False)
        check_number("penalty_rate", penalty_rate, minimum=0.0, strict=False)
        check_int("dead_after", dead_after)
        self.estimator, self.ema_decay, self.dead_threshold = estimator, ema_decay, dead_threshold
        self.penalty_rate, self.dead_after = penalty_rate, dead_after
        init = F.normalize(torch.randn(num_heads, codebook_size, head_dim), dim=-1)
        if estimator == "ste":
            self.register_buffer("codebook", init)
            self.register_buffer("ema_counts", torch.ones(num_heads, codebook_size))
            self.register_buffer("ema_sums", init.clone())
        else:
            self.codebook = nn.Parameter(init)
            self.register_buffer("idle_steps", torch.zeros(num_heads, codebook_size))

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` (what ``.to``, ``.cuda``, ``.bfloat16`` ... run), then each of
        :attr:`accumulators` that ``fn`` made narrower than fp32 is its value before, moved to the new
        device in fp32: a cast of the model casts the codebook, not the sums it is derived from."""
        before = {name: self._buffers.get(name) for name in self.accumulators}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers.get(name)
            if old is not None and new is not None and new.dtype != work_dtype(new):
                self._buffers[name] = old.to(device=new.device, dtype=work_dtype(new))
        return self

    def code_bias(self) -> Tensor | None:
        """``[H, N]`` assignment bonus (DiVeQ's no-use penalty), or None."""
        return None if self.estimator == "ste" else self.penalty_rate * self.idle_steps

    def dead_codes(self) -> Tensor:
        """Codes currently dead (EMA count below threshold / idle ``dead_after`` steps), summed over heads."""
        with torch.no_grad():
            if self.estimator == "ste":
                return (self.ema_counts < self.dead_threshold).float().sum()
            return (self.idle_steps >= self.dead_after).float().sum()

    def update_(self, k: Tensor, codes: Tensor) -> None:
        """One training step's codebook update from the keys ``k`` ``[B, H, T, D]`` (the op's compute dtype) and
        their ``codes`` ``[B, H, T]``: EMA k-means (``ste``) on the fp32 unit keys the codes were assigned on
        (:func:`~recurrences.precision.routing_keys`: the same bits with autocast on or off, on any device),
        or the idle-step counts of the no-use penalty (``diveq``). A step without keys changes nothing.
        Data parallel (:attr:`sync_ranks`), from the statistics of every rank's keys: every rank calls it."""
        reduce = sum_over_ranks if self.sync_ranks and data_parallel() else None
        with torch.no_grad():
            if self.estimator == "ste":
                ema_update_(self.codebook, self.ema_counts, self.ema_sums, routing_keys(k), codes,
                            decay=self.ema_decay, dead_threshold=self.dead_threshold, reduce=reduce)
            else:
                hist = code_histogram(codes, self.idle_steps.shape[1])  # [H, N]
                if reduce is not None:
                    hist = reduce(hist)
                seen = hist.sum(-1, keepdim=True) > 0  # a step without keys is no idle step
                self.idle_steps.copy_(torch.where(hist > 0, torch.zeros_like(self.idle_steps),
                                                  self.idle_steps + seen.to(self.idle_steps.dtype)))

    def extra_repr(self) -> str:
        H, N, D = self.codebook.shape
        return f"heads={H}, codebook_size={N}, head_dim={D}, estimator={self.estimator!r}"


def data_parallel() -> bool:
    """Whether this process is one rank of several (an initialized default ``torch.distributed`` group)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def sum_over_ranks(x: Tensor) -> Tensor:
    """``x`` summed over the ranks of the default process group (one all-reduce). An opaque op, so a
    compiled training step runs it as the eager one does."""
    return _sum_over_ranks(x)


@torch.library.custom_op("ovqflex::vq_sum_over_ranks", mutates_args=())
def _sum_over_ranks(x: Tensor) -> Tensor:
    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


@_sum_over_ranks.register_fake
def _(x):
    return torch.empty_like(x)


def training_snapshot(codebook: Tensor, code_bias: Tensor | None, layer: str) -> tuple[Tensor, Tensor | None]:
    """Copies of the codebook ``[H, N, D]`` (gradients pass through) and the code bias ``[H, N]`` (or None) that a
    training forward attends with, before it updates them in place; refused by name inside a backward.

    Activation checkpointing (``torch.utils.checkpoint``) re-runs a forward inside the backward, eagerly, or
    compiled as recomputed ops: the re-run would read the updated state and give other gradients (10% off the
    plain backward's in a test). An opaque op checks at run time, so it raises there in both; compiled code that
    keeps this op's output for the backward instead of recomputing it reads the snapshot, and is right."""
    cb, bias = _training_snapshot(codebook, code_bias, layer)
    return cb, None if code_bias is None else bias


@torch.library.custom_op("ovqflex::vq_training_snapshot", mutates_args=())
def _training_snapshot(codebook: Tensor, code_bias: Tensor | None, layer: str) -> tuple[Tensor, Tensor]:
    if torch._C._current_graph_task_id() != -1:  # run by the autograd engine: inside a backward
        raise RuntimeError(
            f"{layer}: its training forward ran inside a backward, as activation checkpointing "
            "(torch.utils.checkpoint) re-runs it. The forward updates the codebook's training state in place, so "
            "the re-run would read the updated codebook (other gradients; eagerly, it would update it twice). "
            "Checkpoint the layers around it, not this one, or run it in eval mode (frozen codebook).")
    return codebook.clone(), codebook.new_empty(0) if code_bias is None else code_bias.clone()


@_training_snapshot.register_fake
def _(codebook, code_bias, layer):
    return torch.empty_like(codebook), codebook.new_empty(0) if code_bias is None else torch.empty_like(code_bias)


def _snapshot_backward(ctx, grad_codebook, grad_bias):
    return grad_codebook, None, None


_training_snapshot.register_autograd(_snapshot_backward)


def vq_aux(op_aux: dict, codebook: VQCodebook, commitment_weight: float) -> dict:
    """The layer aux dict from the op's: loss, metrics (detached), dead codes."""
    aux = {"loss": commitment_weight * op_aux["commitment"], "commitment": op_aux["commitment"].detach()}
    for name in ("usage", "perplexity", "unused_codes", "rel_quant_error"):
        aux[name] = op_aux[name]
    aux["dead_codes"] = codebook.dead_codes()
    return aux


@dataclass
class VQInputs:
    """What a VQ layer's ``_project`` gives its attention hooks: q, k ``[B, H, T, D]``, v ``[B, H, T, Dv]``,
    and the fields of a new cache besides the VQ state (``conv``; LongVQ's ``ema``)."""

    q: Tensor
    k: Tensor
    v: Tensor
    cache_fields: dict


class VQMemory:
    """The attention hooks (:class:`~ovqflex.layers.base.AttentionLayer`) of a layer that owns
    ``quantizer``, ``beta``, ``local_bias``, ``commitment_weight``, ``backend``, ``options`` and
    ``cache_type`` (``VQAttention``, ``LongVQBlock``); ``inputs`` is a :class:`VQInputs`. The full
    forward returns the aux dict and updates the EMA codebook in training mode; a prefill runs the
    fused op and builds the cache from its codes; a decode step assigns codes to the new keys."""

    def _vq_attention(self, inputs: VQInputs) -> tuple[Tensor, dict]:
        codebook, code_bias = self.quantizer.codebook, self.quantizer.code_bias()
        if self.training:  # the forward updates them after the attention: it reads a snapshot
            codebook, code_bias = training_snapshot(codebook, code_bias, type(self).__name__)
        return vq_attention(inputs.q, inputs.k, inputs.v, codebook, self.beta, local_bias=self.local_bias,
                            code_bias=code_bias, backend=self.backend, options=self.options)

    def _full(self, inputs: VQInputs) -> tuple[Tensor, dict]:
        o, op_aux = self._vq_attention(inputs)
        if self.training:
            with stage("routing"):
                self.quantizer.update_(inputs.k, op_aux["codes"])
        return o, vq_aux(op_aux, self.quantizer, self.commitment_weight)

    def _unit_codebook(self, dtype) -> tuple[Tensor, Tensor]:
        """The unit codebook ``[H, N, D]`` as the op makes it (:func:`~masks.program.unit_rows`, the codebook's
        dtype), and in ``dtype``."""
        cb = unit_rows(self.quantizer.codebook.detach())
        return cb, cb.to(dtype)

    def _prefill(self, inputs: VQInputs) -> tuple[Tensor, VQCache]:
        cb, cb_v = self._unit_codebook(inputs.v.dtype)
        o, op_aux = self._vq_attention(inputs)
        codes = op_aux["codes"]
        fields = vq_prefill(gather_codes(cb_v, codes), inputs.v, codes, cb.shape[1], self.options.chunk_size)
        return o, self.cache_type(**fields, **inputs.cache_fields)

    def _decode_inputs(self, inputs: VQInputs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """New tokens' ``q_scaled = beta * q̂``, quantized unit keys ``[B, H, T, D]``, codes
        ``[B, H, T]`` (assigned as the op assigns them) and the unit codebook ``[H, N, D]``: what a decode step
        reads."""
        cb, cb_v = self._unit_codebook(inputs.v.dtype)
        codes = assign_codes(inputs.k, self.quantizer.codebook, self.quantizer.code_bias())
        q_scaled = scaled_unit_queries(inputs.q, self.beta)
        return q_scaled, gather_codes(cb_v, codes), codes, cb

    def _decode_step(self, inputs: VQInputs, cache: VQCache) -> tuple[Tensor, VQCache]:
        q_scaled, k_hat, codes, cb = self._decode_inputs(inputs)
        o, fields = vq_decode(cache, q_scaled, k_hat, inputs.v, codes, cb, self.local_bias, self.options.chunk_size)
        return o, self.cache_type(**fields, **inputs.cache_fields)

    def _static_cache(self, cache: VQCache, capacity: int) -> StaticVQCache:
        return vq_static(cache, self.static_cache_type, self.options.chunk_size)  # bounded: capacity does not matter

    def _decode_static(self, inputs: VQInputs, cache: StaticVQCache) -> Tensor:
        q_scaled, k_hat, codes, cb = self._decode_inputs(inputs)
        o = vq_decode_static(cache, q_scaled, k_hat, inputs.v, codes, cb, self.local_bias, self.options.chunk_size)
        for name, t in inputs.cache_fields.items():  # the conv tail, LongVQ's EMA state
            if t is not None:
                getattr(cache, name).copy_(t)
        return o

    def _static_boundary(self, cache: StaticVQCache, position: int, *, compile: bool = False) -> None:
        """When a query chunk ``>= 2`` is next, absorb the oldest window chunk in place
        (:func:`~ovqflex.ops.vq_decode.vq_static_boundary`: a scatter-add, eager either way)."""
        vq_static_boundary(cache, self.options.chunk_size, position)


class VQAttention(VQMemory, OptionAttributes, MultiHeadProjection):
    """x ``[B, T, hidden]`` -> y ``[B, T, hidden]`` (``(y, aux)`` with ``return_aux=True``). NoPE; unit q/k; per-head ``beta``
    (init ``sqrt(head_dim)``); keys quantized by a ``codebook_size``-code codebook per head;
    ``local_bias=True`` adds a learned per-head bias (init 0) to the window rows' scores.
    Options: a :class:`~ovqflex.ops.vq.VQOptions` (``options=``) or its fields as keywords
    (``chunk_size``, ``estimator``, ``state_layout``, ``checkpoint_every``, ``block_size``), each an
    attribute; ``estimator`` is fixed once built (the codebook is a buffer or a parameter by it)."""

    cache_type = VQCache  # forward(x, cache=None, use_cache=False): docs/design.md §6
    static_cache_type = StaticVQCache
    options_type = VQOptions
    fixed_options = ("estimator",)

    def __init__(self, hidden_size: int, num_heads: int, *, head_dim: int | None = None, codebook_size: int = 512,
                 commitment_weight: float = 1e-4, ema_decay: float = 0.99, dead_threshold: float = 0.01,
                 penalty_rate: float = 0.0025, local_bias: bool = False, qk_conv: int = 0, backend: str = "auto",
                 options: VQOptions | None = None, **option_kwargs):
        super().__init__(hidden_size, num_heads, head_dim, backend, qk_conv)
        self.options = options_of(VQOptions, options, option_kwargs, "VQ options")
        check_number("commitment_weight", commitment_weight, minimum=0.0, strict=False)
        self.commitment_weight = commitment_weight
        self.quantizer = VQCodebook(num_heads, codebook_size, self.head_dim, estimator=self.options.estimator,
                                    ema_decay=ema_decay, dead_threshold=dead_threshold, penalty_rate=penalty_rate)
        self.beta = nn.Parameter(torch.full((num_heads,), math.sqrt(self.head_dim)))
        self.local_bias = nn.Parameter(torch.zeros(num_heads)) if local_bias else None

    def program(self, x: Tensor) -> AttentionProgram:
        """The layer's attention program for x ``[B, T, hidden]`` (what the visualizer draws)."""
        with stage("proj"):
            q, k, v = self.split_heads(x)
        return vq_program(q, k, v, self.quantizer.codebook, self.beta, local_bias=self.local_bias,
                          code_bias=self.quantizer.code_bias(), options=self.options)[0]

    # forward(x, cache=None, use_cache=False, *, return_aux=False): AttentionLayer; the attention: VQMemory

    def _project(self, x: Tensor, cache: VQCache | None, use_cache: bool = False) -> VQInputs:
        q, k, v, tail = super()._project(x, cache)
        return VQInputs(q, k, v, {"conv": tail})

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"chunk_size={self.chunk_size}, local_bias={self.local_bias is not None}, backend={self.backend!r}")
