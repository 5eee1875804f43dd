"""MQAR and copy (VLA paper, arXiv 2605.11196, §5.2; MQAR after Arora et al., Zoology). Vocab 128 as in the paper.

Special tokens: ``pad=0, sep=1``; content tokens ``[2, vocab_size)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from recurrences.checks import ConfigTypeError

from .base import IGNORE, PAD, Task, check_fields, distinct_rows, labels_from_targets, pad_start

SEP = 1
N_SPECIAL = 2


@dataclass
class MQAR(Task):
    """Multi-query associative recall (VLA paper, arXiv 2605.11196, §5.2, Figure 1).

    The context holds ``n`` single-token key/value pairs (keys distinct, values iid
    uniform), a separator, then all ``n`` keys again in a random order; the model
    must output each key's value. Default layout (the VLA paper's, arXiv 2605.11196: ``T = 3n + 1``), the
    label of each query key is its value — which is *not* in the input, so this
    layout has ``next_token_labels = False``::

        inputs  k1 v1 k2 v2 … kn vn SEP kσ1 kσ2 … kσn
        labels  ϕ  ϕ  ϕ  ϕ  … ϕ  ϕ  ϕ   vσ1 vσ2 … vσn

    ``answers_in_input=True`` gives the Zoology layout (``T = 4n + 1``), where each
    query key is followed by its value and the labels are next tokens::

        inputs  k1 v1 … kn vn SEP kσ1 vσ1 kσ2 vσ2 … kσn vσn
        labels  ϕ  ϕ  … ϕ  ϕ  ϕ   vσ1 ϕ   vσ2 ϕ   … vσn ϕ

    ``n_pairs`` fixed (paper's long-context variant: ``n = 8``, ``T`` in 64…512): the
    extra length is a gap between the context and ``SEP`` (``gap="pad"``: pad
    tokens; ``"noise"``: iid content tokens), so a longer ``seq_len`` means a longer
    retention distance. ``n_pairs=None`` (paper's capacity curve, ``T = 3n + 1``):
    as many pairs as fit, remainder padded at the start.
    """

    name: ClassVar[str] = "mqar"
    vocab_size: int = 128
    n_pairs: int | None = 8
    answers_in_input: bool = False
    gap: str = "pad"

    def __post_init__(self) -> None:
        check_fields(self, {"vocab_size": N_SPECIAL + 1})
        if self.n_pairs is not None:
            check_fields(self, {"n_pairs": 1})
            if self.n_pairs > self.vocab_size - N_SPECIAL:
                raise ValueError(f"n_pairs={self.n_pairs} distinct keys need vocab_size >= "
                                 f"{self.n_pairs + N_SPECIAL} (got {self.vocab_size})")
        if not isinstance(self.answers_in_input, bool):
            raise ConfigTypeError(f"answers_in_input must be a bool, got {self.answers_in_input!r}")
        if self.gap not in ("pad", "noise"):
            raise ValueError(f"gap must be 'pad' or 'noise', got {self.gap!r}")

    @property
    def next_token_labels(self) -> bool:  # type: ignore[override]
        return self.answers_in_input

    def special_tokens(self) -> dict[str, int]:
        return {"pad": PAD, "sep": SEP}

    def _per_query(self) -> int:
        return 2 if self.answers_in_input else 1

    def min_len(self) -> int:
        n = 1 if self.n_pairs is None else self.n_pairs
        return (2 + self._per_query()) * n + 1

    def pairs_at(self, seq_len: int) -> int:
        """Number of key/value pairs at ``seq_len``."""
        if self.n_pairs is not None:
            return self.n_pairs
        return (seq_len - 1) // (2 + self._per_query())

    def describe(self) -> str:
        n = "as many pairs as fit" if self.n_pairs is None else f"{self.n_pairs} pairs"
        lay = "Zoology layout (answers in input)" if self.answers_in_input else "VLA-paper layout (T = 3n+1)"
        return (f"MQAR: {n} of single-token key→value, all keys queried in shuffled order, {lay}, "
                f"vocab {self.vocab_size}")

    def _example(self, seq_len: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        n = self.pairs_at(seq_len)
        keys = distinct_rows(n, 1, N_SPECIAL, self.vocab_size, gen, "key")[:, 0]
        values = torch.randint(N_SPECIAL, self.vocab_size, (n,), generator=gen)
        order = torch.randperm(n, generator=gen)
        context = torch.stack([keys, values], dim=1).flatten()
        gap_len = seq_len - self.min_len() if self.n_pairs is not None else 0
        if self.gap == "noise":
            gap = torch.randint(N_SPECIAL, self.vocab_size, (gap_len,), generator=gen)
        else:
            gap = torch.full((gap_len,), PAD, dtype=torch.int64)
        if self.answers_in_input:
            queries = torch.stack([keys[order], values[order]], dim=1).flatten()
        else:
            queries = keys[order]
        seq = torch.cat([context, gap, torch.tensor([SEP]), queries])
        if self.answers_in_input:
            target = torch.zeros_like(seq, dtype=torch.bool)
            target[-2 * n + 1::2] = True
            labels = labels_from_targets(seq, target)
        else:
            labels = torch.full_like(seq, IGNORE)
            labels[-n:] = values[order]
        return pad_start(seq, labels, seq_len)


@dataclass
class Copy(Task):
    """Copy task (VLA paper, arXiv 2605.11196, §5.2): reproduce the first half after a separator.

    ``x1 … xm`` are iid uniform content tokens::

        inputs  x1 x2 … xm SEP x1 x2 … xm
        labels  ϕ  ϕ  … ϕ  x1  x2 x3 … ϕ

    ``n_tokens=None``: ``m = (seq_len - 1) // 2`` (paper: ``T = 64``); a fixed
    ``n_tokens`` pads the rest at the start.
    """

    name: ClassVar[str] = "copy"
    vocab_size: int = 128
    n_tokens: int | None = None

    def __post_init__(self) -> None:
        check_fields(self, {"vocab_size": N_SPECIAL + 1})
        if self.n_tokens is not None:
            check_fields(self, {"n_tokens": 1})

    def special_tokens(self) -> dict[str, int]:
        return {"pad": PAD, "sep": SEP}

    def min_len(self) -> int:
        return 2 * (self.n_tokens or 1) + 1

    def describe(self) -> str:
        m = "(seq_len-1)//2" if self.n_tokens is None else str(self.n_tokens)
        return f"copy: {m} random tokens, SEP, then the same tokens again; vocab {self.vocab_size}"

    def _example(self, seq_len: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        m = self.n_tokens if self.n_tokens is not None else (seq_len - 1) // 2
        x = torch.randint(N_SPECIAL, self.vocab_size, (m,), generator=gen)
        seq = torch.cat([x, torch.tensor([SEP]), x])
        target = torch.zeros_like(seq, dtype=torch.bool)
        target[m + 1:] = True
        return pad_start(seq, labels_from_targets(seq, target), seq_len)
