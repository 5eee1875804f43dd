"""What ``ovqflex viz`` draws: the program of a drawable method's layer on a random input.

The drawable methods are those of :data:`ovqflex.methods.METHODS` whose layer has
``program(x [B, T, hidden]) -> AttentionProgram`` (the attention program of that input, built
without running attention); their ``defaults`` size the drawn layer and their
``temperatures`` fill the inspector's logit-scale column. Registering a method
(:func:`ovqflex.methods.register_method`) is all it takes to draw it. :class:`VizConfig` is
everything the command is told; each of its fields' ``metadata`` makes its flag
(``ovqflex/cli/flags.py``), so a new field is a new flag.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from masks.program import AttentionProgram
from masks.viz import DEFAULT_FORMATS, FORMATS, MAX_TOKEN_CELLS, VIEWS, VizOptions
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

    seq_len: int = field(default=512, metadata={"help": "tokens T"})
    batch: int = field(default=1, metadata={"help": "batch size of the random input"})
    heads: int = field(default=1, metadata={"help": "heads of the drawn layer"})
    head_dim: int = field(default=16, metadata={"help": "head dim of the drawn layer"})
    seed: int = field(default=0, metadata={"help": "seed of the layer init and the input"})

    def __post_init__(self):
        for name in ("seq_len", "batch", "heads", "head_dim"):
            check_int(name, getattr(self, name))
        check_int("seed", self.seed, minimum=0)


def _method_help() -> str:
    return f"one of {', '.join(drawable_methods())}"  # (registered methods included: called when the flag is made)


@dataclass
class VizConfig(VizShape):
    """What ``ovqflex viz`` draws and how: the layer of ``method`` with ``options``, on the input
    of :class:`VizShape`, rendered with the :class:`masks.viz.VizOptions` of
    :meth:`render_options` into ``out``."""

    method: str = field(kw_only=True, metadata={"positional": True, "help": _method_help})
    options: dict = field(default_factory=dict, metadata={
        "flag": "--opt", "help": "layer option, e.g. max_centroids=256, chunk_size=64, window=64"})
    views: tuple[str, ...] = field(default=VIEWS, metadata={
        "flag": "--view", "choices": VIEWS, "help": "comma-separated views (token: only if small enough)"})
    formats: tuple[str, ...] = field(default=DEFAULT_FORMATS, metadata={
        "flag": "--format", "choices": FORMATS, "help": "comma-separated outputs"})
    queries: tuple[int, ...] = field(default=(), metadata={
        "flag": "--query", "repeatable": True, "help": "inspect this query index"})
    head: int = field(default=0, metadata={"help": "head drawn (its bias, and the versioned layout's live rows)"})
    batch_index: int = field(default=0, metadata={"help": "batch element drawn (as --head)"})
    chunk: int | None = field(default=None, metadata={
        "help": "query grouping of the state-rows-per-chunk statistic (default: the layer's chunk_size, "
                "else the block size)"})
    max_token_cells: int = field(default=MAX_TOKEN_CELLS, metadata={
        "flag": "--max-cells", "help": "largest token view drawn (cells)"})
    term_width: int = field(default=120, metadata={"flag": "--width", "help": "terminal columns"})
    term_height: int = field(default=48, metadata={"flag": "--height", "help": "terminal rows per view"})
    color: bool = field(default=False, metadata={"help": "ANSI colours in the terminal view"})
    out: str = field(default="viz-out", metadata={"help": "directory for PNG/SVG/HTML/JSON"})

    def __post_init__(self):
        """Checks what the command line gives, by its flags' names, before the layer is built."""
        super().__post_init__()
        ranges = [("--head", self.head, "--heads", self.heads), ("--batch-index", self.batch_index, "--batch", self.batch),
                  *(("--query", q, "--seq-len", self.seq_len) for q in self.queries)]
        for flag, value, bound_flag, bound in ranges:
            check_int(flag, value, minimum=0)
            if value >= bound:
                raise ValueError(f"{flag} must be < {bound_flag} ({bound}), got {value}")
        for flag, value in (("--max-cells", self.max_token_cells), ("--width", self.term_width),
                            ("--height", self.term_height), ("--chunk", self.chunk)):
            if value is not None:
                check_int(flag, value)

    @property
    def stem(self) -> str:
        """The stem of the files written: ``<method>-T<seq_len>``."""
        return f"{self.method}-T{self.seq_len}"

    def render_options(self, layer: nn.Module, temperatures: dict[str, Tensor | float]) -> VizOptions:
        """The render options of the drawn ``layer`` (whose ``chunk_size``, if any, groups the
        state-rows statistic unless ``chunk`` is given) and its ``temperatures``; the page's
        metadata says what was drawn."""
        meta = {"method": self.method, "layer": repr(layer).replace("\n", " "), "seq_len": self.seq_len,
                "batch": self.batch, "heads": self.heads, "head_dim": self.head_dim, "seed": self.seed,
                "drawn batch, head": f"{self.batch_index}, {self.head}", "options": self.options or "defaults"}
        return VizOptions(views=self.views, formats=self.formats, batch=self.batch_index, head=self.head,
                          queries=self.queries, max_token_cells=self.max_token_cells,
                          chunk=getattr(layer, "chunk_size", None) if self.chunk is None else self.chunk,
                          title=f"{self.method}, T={self.seq_len}", meta=meta, temperatures=temperatures,
                          term_width=self.term_width, term_height=self.term_height, color=self.color)


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
