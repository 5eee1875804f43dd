"""KVM state budgets (docs/design.md §4.3): how many state rows each query chunk reads.

The state length never depends on the data, only on the chunk index, so the
whole schedule is a list of Python ints computed before routing. Query chunk
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

import math
from dataclasses import dataclass

from ..checks import check_chunk, check_choice, check_int

BUDGETS = ("fixed", "power_law", "saturation")


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
        for name in ("growth_factor", "growth_exponent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
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
    check_chunk("chunk_size", chunk_size)
    check_int("n_bswa_chunks", n_bswa_chunks)
    budget = budget or KVMBudget()
    n_chunks = -(-seq_len // chunk_size)
    cap = math.inf if budget.max_state_chunks is None else chunk_size * budget.max_state_chunks
    sizes = [0 for _ in range(min(n_chunks, n_bswa_chunks))]  # (torch 2.11's dynamo cannot append to `[0] * n`)
    for c in range(n_bswa_chunks, n_chunks):
        if c == n_bswa_chunks:
            sizes.append(chunk_size)  # the initial state: the first chunk, one row per token
            continue
        m, u = sizes[-1], c - n_bswa_chunks
        target = max(min(budget.rows(c * chunk_size, chunk_size), (u + 1) * chunk_size, cap), m)
        sizes.append(m + min(max(target - m, 0), chunk_size))
    return sizes
