"""Long in-context learning of linear functions (OVQ paper, arXiv 2602.03922, §4.1, §8.5)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from .base import PAD, TRAIN_ONLY, Task, check_fields, labels_from_targets, pad_start

NEXT = 1
FN0 = 2  # function-id tokens are FN0 .. FN0 + n_function_tokens - 1


@dataclass
class ICL(Task):
    """Long ICL linear regression (OVQ paper, arXiv 2602.03922, §8.5).

    Each sequence draws ``n_functions`` distinct function ids out of the
    ``n_function_tokens`` id tokens (paper: 128), each with its own
    ``f(x) = b + a·P·x`` — integers ``1 <= a <= a_max``, ``1 <= b <= b_max`` (paper:
    ``0 < a < 6``, ``0 < b < 6``) and a random permutation ``P`` of the ``io_len``
    positions, i.e. ``y[j] = b + a * x[perm[j]]``. Examples are iid: a uniformly
    chosen function of the sequence and an input ``x`` of ``io_len`` integers uniform
    in ``[1, x_max]``. The function-id token is the arrow between input and output::

        inputs  I1 →f4 O1 | I2 →f1 O2 | I3 →f3 O3 | …
        labels  ϕ   O1  ϕ ϕ ϕ   O2  ϕ ϕ ϕ   O3  ϕ …

    Every example's output tokens are targets. Integer ``i`` is token
    ``content0 + i`` with ``content0 = 2 + n_function_tokens``; ``x_max=None`` picks
    the largest ``x_max`` whose outputs ``b_max + a_max * x_max`` still fit in the
    vocab (paper vocab 10,000 → ``x_max = 1972``). An example with its ``|`` is
    ``2 * io_len + 2`` tokens; the sequence holds as many as fit, ends with the last
    output token, and the remainder is padded at the start.

    Special tokens: ``pad=0, next=1 (|), fn_i = 2 + i`` for ``i < n_function_tokens``.

    ``min_functions`` (training only; :meth:`Task.evaluation` drops it): each example instead
    draws its number of functions uniformly from ``[min_functions, n_functions]`` (same
    length, same layout). With one or two functions most examples repeat a function seen
    one or two examples earlier, so the in-context part (read ``a``, ``b``, ``P`` off an
    earlier example of the same function) has more targets that reward it.

    What a model can get without reading earlier examples: the outputs of one example
    constrain ``(a, b, P)``, so its later output tokens are partly (the last one fully)
    determined by its earlier ones; a Bayes-optimal reader of the current example alone
    scores ~0.46-0.56 of all targets, one that also reads the earlier examples ~0.82 (4
    functions, ``io_len=4``: 12 examples) to ~0.90 (``io_len=2``: 21) at 128 tokens, 0.99 at 2,048.
    Measured on the ``tiny`` sw-nope (128 tokens, 16 × 128 per step, lr 5e-3, seed 0;
    accuracy on 32 evaluation sequences, "in-ctx y0": the first output token of examples
    whose function occurred before, the one target only earlier examples can give):

    - vocab 512, ``io_len=4``, ``a, b <= 5``, ``x <= 75``, 1,200 steps: 0.08 (seed 1: 0.06);
      even the last output token, fixed by the example's own earlier outputs, only 0.18.
    - vocab 256 (16 id tokens), ``io_len=4``, ``a, b <= 3``, ``x <= 16``, 2,000 steps: 0.50,
      the within-example part learned (last token 1.00) but in-ctx y0 0.13 (first
      occurrences: 0.04); with ``min_functions=1`` the same (0.49, 0.14).
    - ``io_len=2`` (21 examples), ``a, b <= 3``, ``min_functions=1``: 0.57 at 128, 0.58 at
      2,048; in-ctx y0 0.22. ``a, b <= 2``: 0.63, in-ctx y0 0.32 (0.61 and 0.28 without
      the mix); the same with ``x <= 8`` (0.64), 4 heads (0.64), 3 layers (0.62), or 4,000
      steps of 8 sequences (0.63). Training accuracy stops rising at ~0.65 by step ~600.

    Where it stops (``a, b <= 2``, ``io_len=2``, mix): on sequences of one function the
    in-context ``a, b`` are right 99.8% of the time but ``P`` is a coin flip (first output
    right 47%, the other input's image 53%); with 4 functions ``a, b`` are right ~55% (of 4
    possibilities). The tiny models read the slope and offset off earlier examples, but not
    which input went to which output.

    Whether the five ``cpu``-scale models (``ovqflex experiment icl``, seed 0) differ on the
    in-context targets alone (the first output token of an example whose function occurred
    before): no. They score 0.19-0.25 at every length from 128 to 2,048 with 4 functions, and
    0.29-0.32 at 128 falling to 0.15 at 2,048 when the function count grows with the length
    (one function per 8 examples), sw-linear and sw-vq as high as sw-nope and sw-ovq.

    Without the permutation (``io_len=1``: ``y = b + a·x``, 64 id tokens, vocab 256, ``x <= 16``,
    mix ``min_functions=1`` of 8 functions, tiny sw-nope at 128 tokens), on one-function
    sequences ``b`` is read off the context (``a_max=1, b_max=4``: 0.98 once 4 examples were
    seen), but with 8 functions the model does not single out the examples of the queried
    function: accuracy given >= 4 earlier examples of it, after 1,200-3,000 steps: 0.37
    (``a, b <= 3``), 0.50 (``a, b <= 2``), 0.47 (``a = 1, b <= 4``), 0.47 with 4 layers,
    0.55 with 4 heads and lr 2e-3 (3,000 steps), 0.41 without the mix; a reader of the
    context gets ~1.0 there (one example fixes ``b``), one that ignores it 0.26.
    """

    name: ClassVar[str] = "icl"
    vocab_size: int = 10000
    n_functions: int = 16
    n_function_tokens: int = 128
    io_len: int = 12
    a_max: int = 5
    b_max: int = 5
    x_max: int | None = None
    min_functions: int | None = field(default=None, metadata={TRAIN_ONLY: True})

    def __post_init__(self) -> None:
        check_fields(self, {"vocab_size": 1, "n_functions": 1, "n_function_tokens": 1, "io_len": 1,
                            "a_max": 1, "b_max": 1})
        if self.n_functions > self.n_function_tokens:
            raise ValueError(f"n_functions={self.n_functions} must be <= n_function_tokens={self.n_function_tokens}")
        if self.min_functions is not None:
            check_fields(self, {"min_functions": 1})
            if self.min_functions > self.n_functions:
                raise ValueError(f"min_functions={self.min_functions} must be <= n_functions={self.n_functions}")
        fit = (self.vocab_size - self.content0 - 1 - self.b_max) // self.a_max  # largest x with y in vocab
        if self.x_max is None:
            if fit < 1:
                raise ValueError(f"vocab_size={self.vocab_size} is too small: with {self.content0} special tokens, "
                                 f"a_max={self.a_max} and b_max={self.b_max} not even x=1 has its output in the vocab")
            self.x_max = fit
        else:
            check_fields(self, {"x_max": 1})
            if self.x_max > fit:
                raise ValueError(f"x_max={self.x_max} makes outputs up to b_max + a_max * x_max = "
                                 f"{self.b_max + self.a_max * self.x_max}, which needs vocab_size >= "
                                 f"{self.content0 + self.b_max + self.a_max * self.x_max + 1} (got {self.vocab_size})")

    @property
    def content0(self) -> int:
        """Token id of the integer 0."""
        return FN0 + self.n_function_tokens

    def special_tokens(self) -> dict[str, int]:
        return {"pad": PAD, "next": NEXT, **{f"fn{i}": FN0 + i for i in range(self.n_function_tokens)}}

    def _example_len(self) -> int:
        return 2 * self.io_len + 2

    def min_len(self) -> int:
        return self._example_len() - 1

    def n_examples(self, seq_len: int) -> int:
        """Number of input/output examples at ``seq_len``."""
        return (seq_len + 1) // self._example_len()

    def describe(self) -> str:
        mix = "" if self.min_functions is None else f" (training mix: >= {self.min_functions} functions)"
        return (f"long ICL: {self.n_functions} functions y = b + a·P·x in context "
                f"(a≤{self.a_max}, b≤{self.b_max}, P a permutation), {self.io_len}-token inputs in "
                f"[1, {self.x_max}], vocab {self.vocab_size}{mix}")

    def _example(self, seq_len: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        f, L, n = self.n_functions, self.io_len, self.n_examples(seq_len)
        if self.min_functions is not None:
            f = int(torch.randint(self.min_functions, f + 1, (), generator=gen))
        ids = torch.randperm(self.n_function_tokens, generator=gen)[:f]
        a = torch.randint(1, self.a_max + 1, (f,), generator=gen)
        b = torch.randint(1, self.b_max + 1, (f,), generator=gen)
        perm = torch.argsort(torch.rand(f, L, generator=gen), dim=1)
        which = torch.randint(0, f, (n,), generator=gen)
        x = torch.randint(1, self.x_max + 1, (n, L), generator=gen)
        y = b[which, None] + a[which, None] * torch.gather(x, 1, perm[which])
        rows = torch.cat([x + self.content0, (FN0 + ids[which])[:, None], y + self.content0,
                          torch.full((n, 1), NEXT, dtype=torch.int64)], dim=1)
        target = torch.zeros_like(rows, dtype=torch.bool)
        target[:, L + 1:2 * L + 1] = True
        seq, target = rows.flatten()[:-1], target.flatten()[:-1]
        return pad_start(seq, labels_from_targets(seq, target), seq_len)
