"""KVM state budgets (docs/design.md §4.3): how many state rows each query chunk reads.

The state length never depends on the data, only on the chunk index: the schedule
(:class:`KVMSchedule`) is Python ints from the recurrence below, computed before routing. Query chunk
``c`` (``[c*C, (c+1)*C)``) reads ``sizes[c]`` rows: 0 for the front chunks
``c < Nb`` (plain causal attention), ``C`` for chunk ``Nb`` (the initial state is the
first chunk), and afterwards the length reached after the overflow chunk
``u = c - Nb`` was absorbed following query chunk ``c - 1`` (context ``ctx = c*C``):

    target  = max(min(B(ctx), available=(u+1)*C, C*max_state_chunks), m)
    n_append = min(max(target - m, 0), C)

Budgets ``B(ctx)``: ``fixed`` (``state_min_len``, default ``C``), ``power_law``
(``floor(f * ctx**e)``), ``saturation`` (``floor(N * ctx / (N + ctx))``); the last two
are rounded down to a multiple of ``round_down`` and kept ``>= state_min_len``.
"""
from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from ..checks import check_chunk, check_choice, check_int, check_number
from ..compiling import device_constant, is_symbolic, plain_float, plain_int

BUDGETS = ("fixed", "power_law", "saturation")
_FLOAT_FIELDS = ("growth_factor", "growth_exponent")  # the budget's float fields; the others are ints, str or None


@dataclass(frozen=True)
class KVMBudget:
    """State budget options (the op's keyword arguments of the same names)."""

    budget: str = "fixed"
    state_min_len: int | None = None
    growth_factor: float = 16.0
    growth_exponent: float = 0.5
    round_down: int = 1
    saturation_n: int = 1024
    max_state_chunks: int | None = 1

    def __post_init__(self):
        check_choice("budget", self.budget, BUDGETS)
        if self.state_min_len is not None:
            check_int("state_min_len", self.state_min_len, minimum=0)
        for name in _FLOAT_FIELDS:
            check_number(name, getattr(self, name), strict=False)
        check_int("round_down", self.round_down)
        check_int("saturation_n", self.saturation_n)
        if self.max_state_chunks is not None:
            check_int("max_state_chunks", self.max_state_chunks)

    def rows(self, ctx: int, chunk_size: int) -> int:
        """``B(ctx)``: the state length wished for after ``ctx`` tokens."""
        if self.budget == "fixed":
            return chunk_size if self.state_min_len is None else self.state_min_len
        if self.budget == "power_law":
            raw = math.floor(self.growth_factor * ctx ** self.growth_exponent)
        else:
            raw = self.saturation_n * ctx // (self.saturation_n + ctx)
        return max(raw // self.round_down * self.round_down, self.state_min_len or 0)


def kvm_state_sizes(seq_len: int, chunk_size: int, n_bswa_chunks: int, budget: KVMBudget | None = None) -> list[int]:
    """``sizes[c]``: state rows query chunk ``c`` reads, for ``c`` in ``range(ceil(T / C))``."""
    check_int("seq_len", seq_len, minimum=0)
    return KVMSchedule(chunk_size, n_bswa_chunks, budget).sizes(-(-seq_len // chunk_size))


#: the fields of :class:`KVMBudget`, in order: what the opaque ops below take in its place
BUDGET_FIELDS = tuple(f.name for f in fields(KVMBudget))


def check_sink_len(sink_len: object, chunk_size: int) -> int:
    """``sink_len``, the rows at the start of the state that no token merges into, refused by name unless an
    int in ``[0, chunk_size)``: the initial state is the first chunk's ``chunk_size`` rows, and a state of sinks
    alone would leave a merging token no row to join (its argmax over nothing would put it in row 0)."""
    check_int("sink_len", sink_len, minimum=0)
    if sink_len >= chunk_size:
        raise ValueError(f"sink_len must be < chunk_size={chunk_size} (the initial state), got {sink_len}")
    return sink_len


@dataclass(frozen=True)
class KVMSchedule:
    """The state rows each query chunk of ``chunk_size`` tokens reads, with a block window of
    ``n_bswa_chunks`` chunks and a state ``budget`` (the recurrence in the module docstring).

    Unlike OVQ's dictionary sizes, these have no closed form in the chunk index (each is the last
    one plus what the budget lets in), so the ops read them in two ways that keep a length out of
    a compiled graph's guards: the sizes as a tensor (:meth:`live`, an opaque op of the chunk
    count) and the largest state as a plain int (:meth:`rows`, bucketed for a symbolic count).
    """

    chunk_size: int
    n_bswa_chunks: int
    budget: KVMBudget | None = None  # None: KVMBudget() (not a default instance: torch 2.11's dynamo cannot wrap one)

    def __post_init__(self):
        check_chunk("chunk_size", self.chunk_size)
        check_int("n_bswa_chunks", self.n_bswa_chunks)
        if self.budget is None:
            object.__setattr__(self, "budget", KVMBudget())
        if not isinstance(self.budget, KVMBudget):
            raise TypeError(f"budget must be a KVMBudget, got {type(self.budget).__name__}")

    def args(self) -> tuple:
        """``(chunk_size, n_bswa_chunks, *budget)`` (the budget's :data:`BUDGET_FIELDS`) as plain values, what
        the opaque ops and the constant functions below take. Under ``torch.compile`` an option may be
        symbolic (a float attribute of a module, any number in an argument with ``dynamic=True``): each
        is specialized to its value (:func:`~recurrences.compiling.plain_int`, ``plain_float``), with a
        guard, so options of other values compile anew."""
        return (plain_int(self.chunk_size), plain_int(self.n_bswa_chunks),
                *(_plain(name, getattr(self.budget, name)) for name in BUDGET_FIELDS))

    def sizes(self, n_chunks: int) -> list[int]:
        """``[sizes[0], ..., sizes[n_chunks - 1]]`` (a plain ``n_chunks``)."""
        return list(_table(n_chunks, *self.args())[:n_chunks])

    def size(self, c: int) -> int:
        """``sizes[c]``: rows query chunk ``c`` reads (a plain ``c``)."""
        return _table(c + 1, *self.args())[c]

    def live(self, n_chunks, device) -> Tensor:
        """The sizes of chunks ``0..n_chunks-1`` as ``[n_chunks]`` int64 on ``device``. ``n_chunks`` may be
        symbolic: an opaque op computes them when the graph runs, so a graph does not guard the count."""
        return _live_op(n_chunks, *self.args(), torch.device(device))

    @property
    def bound(self) -> int | None:
        """The largest size of any chunk at any length (None: the state grows without bound)."""
        return _bound(*self.args())

    def rows(self, n_chunks: int) -> int:
        """Rows of a state holding the state of each of chunks ``0..n_chunks-1``: the largest size.

        For a symbolic ``n_chunks`` (a length under ``torch.compile`` with dynamic shapes): that size
        rounded up to a power of two (at most :attr:`bound`), found by comparing ``n_chunks`` with the
        plain count of chunks each bucket holds, so a graph guards a range of lengths, not one; the rows
        past a chunk's size are dead (outside its state region). The counts come from the recurrence run
        on plain values, not traced."""
        args = self.args()
        if not is_symbolic(n_chunks):
            return _largest(n_chunks, *args)
        bound, bucket = self.bound, 0
        while bound is None or bucket < bound:
            if n_chunks <= _chunks_within(bucket, *args):
                return bucket
            bucket = max(1, 2 * bucket)
        return bound


def _plain(field: str, value):
    """A budget field's value as a plain value (:meth:`KVMSchedule.args`)."""
    if value is None or isinstance(value, str):
        return value
    return plain_float(value) if field in _FLOAT_FIELDS else plain_int(value)


def _table(n_chunks: int, chunk_size: int, n_bswa_chunks: int, *budget_args) -> tuple[int, ...]:
    """The sizes of at least ``n_chunks`` chunks: of a power of two of them, at least 64 (a size depends only
    on the chunks before it, so every shorter schedule is a prefix of this one), kept per process."""
    return _table_of(1 << max(6, (n_chunks - 1).bit_length()), chunk_size, n_bswa_chunks, *budget_args)


@functools.lru_cache(maxsize=32)
def _table_of(n_chunks: int, chunk_size: int, n_bswa_chunks: int, *budget_args) -> tuple[int, ...]:
    """The recurrence of the module docstring, for chunks ``0..n_chunks-1``."""
    budget = KVMBudget(*budget_args)
    cap = math.inf if budget.max_state_chunks is None else chunk_size * budget.max_state_chunks
    sizes = [0] * min(n_chunks, n_bswa_chunks)
    for c in range(n_bswa_chunks, n_chunks):
        if c == n_bswa_chunks:
            sizes.append(chunk_size)  # the initial state: the first chunk, one row per token
            continue
        m, u = sizes[-1], c - n_bswa_chunks
        target = max(min(budget.rows(c * chunk_size, chunk_size), (u + 1) * chunk_size, cap), m)
        sizes.append(m + min(max(target - m, 0), chunk_size))
    return tuple(sizes)


# Constants to torch.compile: run on plain values, not traced (not behind an lru_cache, which dynamo traces).

@torch.compiler.assume_constant_result
def _largest(n_chunks: int, chunk_size: int, n_bswa_chunks: int, *budget_args) -> int:
    """The largest size of chunks ``0..n_chunks-1`` (the last: sizes never decrease)."""
    return _table(n_chunks, chunk_size, n_bswa_chunks, *budget_args)[n_chunks - 1] if n_chunks > 0 else 0


@torch.compiler.assume_constant_result
def _bound(chunk_size: int, n_bswa_chunks: int, *budget_args) -> int | None:
    """:attr:`KVMSchedule.bound`: the sizes approach ``max(C, min(B(ctx), cap))`` (B never decreases), which
    they reach, or grow without bound."""
    b = KVMBudget(*budget_args)
    cap = None if b.max_state_chunks is None else chunk_size * b.max_state_chunks
    if b.budget == "power_law" and b.growth_factor > 0 and b.growth_exponent > 0:
        wish = None
    elif b.budget == "saturation":  # floor(n ctx / (n + ctx)) reaches n - 1 at ctx = n (n - 1)
        wish = b.rows(b.saturation_n ** 2, chunk_size)
    else:  # fixed, or a power law that does not grow
        wish = b.rows(1, chunk_size)
    if wish is None and cap is None:
        return None
    return max(chunk_size, min(x for x in (wish, cap) if x is not None))


@torch.compiler.assume_constant_result
def _chunks_within(rows: int, chunk_size: int, n_bswa_chunks: int, *budget_args) -> int:
    """How many leading chunks read at most ``rows`` rows (the sizes never decrease). The caller makes sure
    some chunk reads more (``rows`` below :attr:`KVMSchedule.bound`)."""
    n = 64
    while _table(n, chunk_size, n_bswa_chunks, *budget_args)[-1] <= rows:
        n *= 2
    return bisect.bisect_right(_table(n, chunk_size, n_bswa_chunks, *budget_args), rows)


@torch.library.custom_op("ovqflex::kvm_state_sizes", mutates_args=())
def _live_op(n_chunks: int, chunk_size: int, n_bswa_chunks: int, budget: str, state_min_len: int | None,
             growth_factor: float, growth_exponent: float, round_down: int, saturation_n: int,
             max_state_chunks: int | None, device: torch.device) -> Tensor:
    sizes = _table(n_chunks, chunk_size, n_bswa_chunks, budget, state_min_len, growth_factor, growth_exponent,
                   round_down, saturation_n, max_state_chunks)[:n_chunks]
    return device_constant(tuple(sizes), torch.long, device).clone()  # made once per length and device


@_live_op.register_fake
def _(n_chunks, chunk_size, n_bswa_chunks, budget, state_min_len, growth_factor, growth_exponent, round_down,
      saturation_n, max_state_chunks, device):
    return torch.empty(n_chunks, dtype=torch.long, device=device)
