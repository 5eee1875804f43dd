"""In-context recall tasks: basic ICR and positional ICR (OVQ paper, arXiv 2602.03922, §4.1, §8.4), needle in a haystack.

Special tokens (all three tasks): ``pad=0, assign=1 (→), next=2 (|), query=3 (Q)``;
content tokens are ``[4, vocab_size)``. Keys and values are runs of ``key_len`` /
``value_len`` content tokens; within one sequence all keys are distinct and all
values are distinct (``distinct_rows``: iid draws, duplicates redrawn).

Every sequence ends with the last value token of the last query; the targets are
the query-section value tokens: ``labels[t] = inputs[t+1]`` where ``inputs[t+1]`` is
such a value token (so the label sits on the ``→`` and on the value tokens but the
last), ``IGNORE`` elsewhere, and ``labels[-1] = IGNORE``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from recurrences.checks import ConfigTypeError

from .base import PAD, TRAIN_ONLY, Task, check_fields, distinct_rows, labels_from_targets, pad_start

ASSIGN, NEXT, QUERY = 1, 2, 3
N_SPECIAL = 4


def _pair_rows(keys: Tensor, values: Tensor, delim: Tensor) -> Tensor:
    """``[N, k+v+2]`` rows ``K → V delim``."""
    n = keys.shape[0]
    return torch.cat([keys, keys.new_full((n, 1), ASSIGN), values, delim.view(n, 1)], dim=1)


def _pairs_sequence(keys: Tensor, values: Tensor, n_context: int) -> tuple[Tensor, Tensor]:
    """``K1→V1 | … | Kn→Vn Q Kq1→Vq1 | … | Kqm→Vqm`` and the mask of query-section value tokens."""
    n_rows, k = keys.shape
    v = values.shape[1]
    delim = torch.full((n_rows,), NEXT, dtype=torch.int64)
    delim[n_context - 1] = QUERY
    rows = _pair_rows(keys, values, delim)
    target = torch.zeros_like(rows, dtype=torch.bool)
    target[n_context:, k + 1:k + 1 + v] = True
    return rows.flatten()[:-1], target.flatten()[:-1]


class _KVTask(Task):
    """Shared option checks of the key/value tasks."""

    def special_tokens(self) -> dict[str, int]:
        return {"pad": PAD, "assign": ASSIGN, "next": NEXT, "query": QUERY}

    @property
    def _n_content(self) -> int:
        return self.vocab_size - N_SPECIAL

    def _check_kv(self, n_keys: int, n_values: int) -> None:
        check_fields(self, {"vocab_size": N_SPECIAL + 1, "key_len": 1, "value_len": 1})
        c = self._n_content
        if c**self.key_len < n_keys or c**self.value_len < n_values:
            raise ValueError(f"vocab_size={self.vocab_size} ({c} content tokens) cannot make {n_keys} distinct keys of "
                             f"key_len={self.key_len} and {n_values} distinct values of value_len={self.value_len}")

    def _pair_len(self) -> int:
        return self.key_len + self.value_len + 2


@dataclass
class ICR(_KVTask):
    """Basic in-context recall (OVQ paper, arXiv 2602.03922, §8.4).

    The context is filled with key→value pairs, then a query token starts the query
    section, which repeats ``n_queries`` pairs sampled (without replacement, random
    order) from the context; the targets are their value tokens::

        inputs  K1 → V1 | K2 → V2 | … | Kn → Vn Q K6 → V6 | … | K2 → V2
        labels  ϕ  ϕ  ϕ  ϕ ϕ  ϕ  ϕ  ϕ … ϕ  ϕ  ϕ  ϕ ϕ  V6 ϕ … ϕ  V2 ϕ

    (``V6`` under ``→`` means the value tokens are the labels of the positions just
    before them.) Each pair with its delimiter is ``key_len + value_len + 2`` tokens;
    the context holds as many pairs as fit, ``n = (seq_len + 1) // pair - n_queries``,
    and the remainder is padded at the start.

    ``min_pairs`` (training only; :meth:`Task.evaluation` drops it): each example instead
    holds a number of context pairs drawn uniformly from ``[min(min_pairs, n), n]``, with
    ``min(n_queries, pairs)`` queries, padded at the start. The easy examples in every batch
    (one pair: copy its value; two: tell two keys apart) give the key-matching circuit a
    strong gradient from the first steps; on full contexts alone a small model can sit on
    the loss plateau for a seed-dependent 1,000-2,500 steps. Measured on the ``tiny``
    sw-ovq (vocab 64, 1-token keys, 64 tokens, 4,000-step schedule): with ``min_pairs=1``
    training accuracy passed 0.5 at step 460 (seed 1) and ~1,000 (seed 2), against
    ~1,000-2,500 on full contexts (seed 1: ~2,500 on a 4,000-step schedule; seed 0: ~1,000
    on a 2,000-step one). With vocab 256 (the ``tiny`` preset's task, which reaches 1,024
    tokens with distinct keys): 1,050 / 440 / 1,370 / 440 for seeds 0-3, against none of 3
    seeds by step 1,700 on full contexts (these runs predate deterministic CPU training and
    had the window layer first, ``swa,ovq``; the main job's deterministic runs of that order:
    1,240 / 1,260 / 970 for seeds 0-2, and 630 / 370 / 860 before a change of the blocked
    backend's float summation order). With the OVQ layer first (the ``tiny`` preset's
    ``ovq,swa``), the main job's runs pass 0.5 within the first few hundred steps (README).
    """

    name: ClassVar[str] = "icr"
    vocab_size: int = 10000
    key_len: int = 8
    value_len: int = 8
    n_queries: int = 6
    min_pairs: int | None = field(default=None, metadata={TRAIN_ONLY: True})

    def __post_init__(self) -> None:
        check_fields(self, {"n_queries": 1})
        if self.min_pairs is not None:
            check_fields(self, {"min_pairs": 1})
        self._check_kv(self.n_queries, self.n_queries)

    def min_len(self) -> int:
        return 2 * self.n_queries * self._pair_len() - 1

    def n_pairs(self, seq_len: int) -> int:
        """Number of context pairs at ``seq_len``."""
        return (seq_len + 1) // self._pair_len() - self.n_queries

    def describe(self) -> str:
        mix = "" if self.min_pairs is None else f" (training mix: >= {self.min_pairs} context pairs)"
        return (f"basic ICR: context of unique {self.key_len}-token keys → unique {self.value_len}-token values, "
                f"{self.n_queries} queried pairs, vocab {self.vocab_size}{mix}")

    def _example(self, seq_len: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        n = self.n_pairs(seq_len)
        if self.min_pairs is not None:
            n = int(torch.randint(min(self.min_pairs, n), n + 1, (), generator=gen))
        keys = distinct_rows(n, self.key_len, N_SPECIAL, self.vocab_size, gen, "key")
        values = distinct_rows(n, self.value_len, N_SPECIAL, self.vocab_size, gen, "value")
        q = torch.randperm(n, generator=gen)[:self.n_queries]  # min(n_queries, n) queries
        seq, target = _pairs_sequence(torch.cat([keys, keys[q]]), torch.cat([values, values[q]]), n)
        return pad_start(seq, labels_from_targets(seq, target), seq_len)


@dataclass
class PICR(_KVTask):
    """Positional in-context recall (OVQ paper, arXiv 2602.03922, §8.4).

    Each of the ``n`` context keys appears ``copies`` times, at random places, each
    copy with its own distinct value. The query section presents the ``copies``
    copies of ``n_queries`` random keys (paper: one); the model must output each
    key's values in the order they appeared in the context::

        inputs  K1 → V1 | K2 → V2 | K3 → V3 | K2 → V4 | … Q K2 → V2 | K2 → V4 | …
        labels  ϕ …                                       ϕ  ϕ  V2 ϕ ϕ  ϕ  V4 ϕ …

    The context holds ``n = (seq_len + 1) // pair // copies - n_queries`` keys
    (``copies * n`` pairs); the remainder is padded at the start.
    """

    name: ClassVar[str] = "picr"
    vocab_size: int = 10000
    key_len: int = 8
    value_len: int = 8
    copies: int = 4
    n_queries: int = 1

    def __post_init__(self) -> None:
        check_fields(self, {"copies": 1, "n_queries": 1})
        self._check_kv(self.n_queries, self.n_queries * self.copies)

    def min_len(self) -> int:
        return 2 * self.n_queries * self.copies * self._pair_len() - 1

    def n_keys(self, seq_len: int) -> int:
        """Number of distinct context keys at ``seq_len`` (each appears ``copies`` times)."""
        return (seq_len + 1) // self._pair_len() // self.copies - self.n_queries

    def describe(self) -> str:
        return (f"positional ICR: {self.copies} copies of each unique {self.key_len}-token key, each with a unique "
                f"{self.value_len}-token value; query = all copies of {self.n_queries} key(s), values in context "
                f"order; vocab {self.vocab_size}")

    def _example(self, seq_len: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        n, c, m = self.n_keys(seq_len), self.copies, self.n_queries
        keys = distinct_rows(n, self.key_len, N_SPECIAL, self.vocab_size, gen, "key")
        values = distinct_rows(n * c, self.value_len, N_SPECIAL, self.vocab_size, gen, "value")
        slot_key = torch.randperm(n * c, generator=gen) // c  # key of each context slot, each key c times
        slots_of_key = torch.sort(slot_key, stable=True).indices.view(n, c)  # context order per key
        qslots = slots_of_key[torch.randperm(n, generator=gen)[:m]].flatten()
        seq, target = _pairs_sequence(torch.cat([keys[slot_key], keys[slot_key[qslots]]]),
                                      torch.cat([values, values[qslots]]), n * c)
        return pad_start(seq, labels_from_targets(seq, target), seq_len)


@dataclass
class NIAH(_KVTask):
    """Needle in a haystack: ``n_needles`` key→value needles hidden in filler, one (or more) queried at the end.

    Layout (filler tokens ``f`` are content tokens only, so the delimited needles are
    unambiguous)::

        inputs  f f f … | K → V | f f … f Q K → V
        labels  ϕ …                      ϕ ϕ  V ϕ

    A needle is ``| K → V |`` (``key_len + value_len + 3`` tokens); the query
    section is ``Q K → V`` per queried needle (``|`` between queries). Needle keys
    are distinct, values distinct. Each needle's position is uniform over the
    haystack (needles with ``n_needles > 1`` are distractors, as in RULER's
    multi-key NIAH); ``depth`` in ``[0, 1]`` pins the first queried needle at that
    fraction of the haystack (for depth sweeps). ``filler``: ``"random"`` = iid
    content tokens (continuously novel distractor text), ``"repeat"`` = one random
    ``period``-token phrase repeated (RULER's repeated-noise haystack). The
    haystack takes all remaining length, so no padding is ever needed.
    """

    name: ClassVar[str] = "niah"
    vocab_size: int = 10000
    key_len: int = 8
    value_len: int = 8
    n_needles: int = 1
    n_queries: int = 1
    depth: float | None = None
    filler: str = "random"
    period: int = 16

    def __post_init__(self) -> None:
        check_fields(self, {"n_needles": 1, "n_queries": 1, "period": 1})
        if self.n_queries > self.n_needles:
            raise ValueError(f"n_queries={self.n_queries} must be <= n_needles={self.n_needles}")
        if self.depth is not None:
            if isinstance(self.depth, bool) or not isinstance(self.depth, (int, float)):
                raise ConfigTypeError(f"depth must be a float in [0, 1] or None, got {self.depth!r}")
            if not 0.0 <= float(self.depth) <= 1.0:
                raise ValueError(f"depth must be in [0, 1] or None, got {self.depth}")
        if self.filler not in ("random", "repeat"):
            raise ValueError(f"filler must be 'random' or 'repeat', got {self.filler!r}")
        self._check_kv(self.n_needles, self.n_needles)

    def _needle_len(self) -> int:
        return self.key_len + self.value_len + 3

    def min_len(self) -> int:
        return self.n_needles * self._needle_len() + self.n_queries * self._pair_len()

    def describe(self) -> str:
        where = "random depth" if self.depth is None else f"depth {self.depth:g}"
        return (f"needle in a haystack: {self.n_needles} needle(s) | {self.key_len}-token key → "
                f"{self.value_len}-token value | at {where} in {self.filler} filler, {self.n_queries} queried; "
                f"vocab {self.vocab_size}")

    def _example(self, seq_len: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        n, m = self.n_needles, self.n_queries
        hay = seq_len - self.min_len()
        keys = distinct_rows(n, self.key_len, N_SPECIAL, self.vocab_size, gen, "key")
        values = distinct_rows(n, self.value_len, N_SPECIAL, self.vocab_size, gen, "value")
        if self.filler == "random":
            filler = torch.randint(N_SPECIAL, self.vocab_size, (hay,), generator=gen)
        else:
            phrase = torch.randint(N_SPECIAL, self.vocab_size, (self.period,), generator=gen)
            filler = phrase.repeat(hay // self.period + 1)[:hay]
        points = torch.randint(0, hay + 1, (n,), generator=gen)
        q = torch.randperm(n, generator=gen)[:m]
        if self.depth is not None:
            points[q[0]] = round(float(self.depth) * hay)
        needles = _pair_rows(keys, values, torch.full((n,), NEXT, dtype=torch.int64))
        needles = torch.cat([needles.new_full((n, 1), NEXT), needles], dim=1)
        pieces, last = [], 0
        for i in torch.argsort(points, stable=True).tolist():
            p = int(points[i])
            pieces += [filler[last:p], needles[i]]
            last = p
        pieces.append(filler[last:])
        delim = torch.full((m,), NEXT, dtype=torch.int64)
        qrows = _pair_rows(keys[q], values[q], delim)
        qtarget = torch.zeros_like(qrows, dtype=torch.bool)
        qtarget[:, self.key_len + 1:self.key_len + 1 + self.value_len] = True
        context = torch.cat(pieces + [torch.tensor([QUERY])])
        seq = torch.cat([context, qrows.flatten()[:-1]])
        target = torch.cat([torch.zeros_like(context, dtype=torch.bool), qtarget.flatten()[:-1]])
        return pad_start(seq, labels_from_targets(seq, target), seq_len)
