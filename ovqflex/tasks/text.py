"""Language modelling on a user-supplied file: raw bytes (vocab 256) or little-endian uint16 tokens."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from recurrences.checks import ConfigTypeError

from .base import Task, check_fields

_U16_SUFFIXES = (".bin", ".u16")


@dataclass
class Text(Task):
    """Next-token prediction on random windows of a file.

    ``format="auto"``: a path ending in ``.bin`` or ``.u16`` is read as little-endian
    uint16 token ids, anything else as raw bytes. ``"bytes"`` / ``"u16"`` force one.
    ``vocab_size=None``: 256 for bytes, ``max token + 1`` for a token file; a given
    ``vocab_size`` must exceed every id in the file. The file is memory-mapped
    (numpy, read-only) and checked once at construction (exists, not empty, whole
    number of uint16 tokens, ids < vocab_size).

    An example is a window ``w`` of ``seq_len + 1`` consecutive tokens starting at
    a uniform offset: ``inputs = w[:-1]``, ``labels = w[1:]`` (every position is a
    target). ``ValueError`` when the file holds fewer than ``seq_len + 1`` tokens.
    No special tokens.
    """

    name: ClassVar[str] = "text"
    path: str = ""
    vocab_size: int | None = None
    format: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)):
            raise ConfigTypeError(f"path must be a file path (str or os.PathLike), got {self.path!r}")
        if not os.fspath(self.path):
            raise ValueError("text task needs path=<file>: a text/byte file or a .bin/.u16 uint16 token file")
        self.path = os.fspath(self.path)
        if self.format not in ("auto", "bytes", "u16"):
            raise ValueError(f"format must be 'auto', 'bytes' or 'u16', got {self.format!r}")
        if self.vocab_size is not None:
            check_fields(self, {"vocab_size": 1})
        if not os.path.isfile(self.path):
            what = "a directory, not a file" if os.path.isdir(self.path) else "no such file"
            raise FileNotFoundError(f"text task: {self.path!r} is {what} (expected a text/byte file, "
                                    f"or a .bin/.u16 file of little-endian uint16 tokens)")
        size = os.path.getsize(self.path)
        if size == 0:
            raise ValueError(f"text task: file {self.path!r} is empty; expected at least seq_len + 1 tokens")
        if self.u16 and size % 2:
            raise ValueError(f"text task: file {self.path!r} has an odd number of bytes ({size}); "
                             f"expected little-endian uint16 tokens (2 bytes each)")
        top = int(self._data().max())
        if self.vocab_size is None:
            self.vocab_size = 256 if not self.u16 else top + 1
        elif top >= self.vocab_size:
            raise ValueError(f"text task: file {self.path!r} holds token id {top}, which is >= "
                             f"vocab_size={self.vocab_size}; expected ids in [0, vocab_size)")

    @property
    def u16(self) -> bool:
        """Whether the file is read as uint16 tokens."""
        if self.format == "auto":
            return self.path.lower().endswith(_U16_SUFFIXES)
        return self.format == "u16"

    def _data(self) -> Any:
        data = self.__dict__.get("_mm")
        if data is None:
            import numpy as np

            data = np.memmap(self.path, dtype="<u2" if self.u16 else np.uint8, mode="r")
            self.__dict__["_mm"] = data
        return data

    def __getstate__(self) -> dict[str, Any]:  # the memmap is reopened lazily after unpickling
        return {k: v for k, v in self.__dict__.items() if k != "_mm"}

    def n_tokens(self) -> int:
        """Number of tokens in the file."""
        return int(self._data().shape[0])

    def min_len(self) -> int:
        return 1

    def describe(self) -> str:
        kind = "uint16 tokens" if self.u16 else "bytes"
        return f"language modelling on {self.path} ({self.n_tokens()} {kind}), vocab {self.vocab_size}"

    def _example(self, seq_len: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        n = self.n_tokens()
        if n < seq_len + 1:
            raise ValueError(f"text task: file {self.path!r} holds {n} tokens, fewer than seq_len + 1 = {seq_len + 1}: "
                             f"use a longer file or a shorter length")
        import numpy as np

        s = int(torch.randint(0, n - seq_len, (1,), generator=gen))
        w = torch.from_numpy(np.array(self._data()[s:s + seq_len + 1], dtype=np.int64))
        return w[:-1].clone(), w[1:].clone()
