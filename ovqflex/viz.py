"""What ``ovqflex viz`` draws: the program of a drawable method's layer on a random input.

The drawable methods are those of :data:`ovqflex.methods.METHODS` whose layer has
``program(x [B, T, hidden]) -> AttentionProgram`` (the attention program of that input, built
without running attention); their ``defaults`` size the drawn layer and their
``temperatures`` fill the inspector's logit-scale column. Registering a method
(:func:`ovqflex.methods.register_method`) is all it takes to draw it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from masks.program import AttentionProgram
from recurrences.checks import check_int

from .methods import METHODS, Method, method_names


def _drawable(m: Method) -> bool:
    return m.drawable


def drawable_methods() -> list[str]:
    """Sorted names of the methods ``ovqflex viz`` can draw."""
    return method_names(_drawable)


@dataclass
class VizShape:
    """Input of the drawn layer: ``x [batch, seq_len, heads * head_dim]`` ~ N(0, 1) from ``seed``."""

    seq_len: int = 512
    batch: int = 1
    heads: int = 1
    head_dim: int = 16
    seed: int = 0

    def __post_init__(self):
        for name in ("seq_len", "batch", "heads", "head_dim"):
            check_int(name, getattr(self, name))
        check_int("seed", self.seed, minimum=0)


def method_program(method: str, shape: VizShape, options: dict | None = None
                   ) -> tuple[AttentionProgram, nn.Module, dict[str, Tensor | float]]:
    """Build the layer of ``method`` (seeded init) and its program on a random input.

    Returns ``(program, layer, temperatures)``. Unknown methods and options are refused.
    """
    if method not in drawable_methods():
        raise ValueError(f"method must be one of {drawable_methods()}, got {method!r}")
    torch.manual_seed(shape.seed)
    layer = METHODS[method].example(shape.heads, shape.head_dim, options)
    g = torch.Generator().manual_seed(shape.seed)
    x = torch.randn(shape.batch, shape.seq_len, shape.heads * shape.head_dim, generator=g)
    with torch.no_grad():
        program = layer.program(x)
    temperatures = METHODS[method].temperatures
    return program, layer, temperatures(layer) if temperatures else {}
