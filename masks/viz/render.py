"""Render a program: choose the views, write PNG / SVG / HTML, return the terminal text."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from torch import Tensor

from ..program import AttentionProgram
from recurrences.checks import check_int
from .block_view import BLOCK_COLORS, BlockView, block_view
from .figures import block_figure, token_figure
from .html import html_page
from .inspect_query import inspect_query, segment_rows
from .labels import check_batch_head, label_styles
from .stats import ProgramStats, program_stats
from .terminal import block_text, token_text
from .token_view import MAX_TOKEN_CELLS, TokenView, token_view

VIEWS = ("token", "block")
FORMATS = ("png", "svg", "html", "term")
#: The outputs :class:`VizOptions` writes unless told otherwise.
DEFAULT_FORMATS = ("png", "html", "term")


@dataclass
class VizOptions:
    """``views``: subset of ``("token", "block")``; the token view is skipped (with a note)
    when it would exceed ``max_token_cells``. ``formats``: subset of ``("png", "svg", "html",
    "term")``. ``queries``: query indices for the inspector. ``temperatures``: per region
    name an ``[H]`` tensor or float folded into that region's logits. ``chunk``: query
    grouping of the state-rows-per-chunk statistic (default: the block size)."""

    views: tuple[str, ...] = VIEWS
    formats: tuple[str, ...] = DEFAULT_FORMATS
    batch: int = 0
    head: int = 0
    queries: tuple[int, ...] = ()
    max_token_cells: int = MAX_TOKEN_CELLS
    chunk: int | None = None
    title: str = "attention program"
    meta: dict = field(default_factory=dict)
    temperatures: dict[str, Tensor | float] = field(default_factory=dict)
    term_width: int = 120
    term_height: int = 48
    color: bool = False

    def __post_init__(self):
        for name, values, allowed in (("views", self.views, VIEWS), ("formats", self.formats, FORMATS)):
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise ValueError(f"{name} must be a non-empty subset of {allowed}, got {tuple(values)!r}")
        for name in ("max_token_cells", "term_width", "term_height"):
            check_int(name, getattr(self, name))
        for q in self.queries:
            check_int("queries", q, minimum=0)


@dataclass
class VizResult:
    """What :func:`render` drew: the statistics, the views (None: not drawn), the files written, the terminal
    text, the notes (a view skipped), and per inspected query its segment rows (:func:`segment_rows`)."""

    stats: ProgramStats
    token: TokenView | None
    block: BlockView | None
    files: list[Path]
    text: str
    notes: list[str]
    inspections: list[tuple[int, list[dict]]]


def render(program: AttentionProgram, options: VizOptions, out_dir: str | Path | None = None,
           stem: str = "program") -> VizResult:
    """Draw ``program`` into ``out_dir/<stem>-{token,block}.{png,svg}``, ``<stem>.html`` and
    ``<stem>-stats.json`` (files only when ``out_dir`` is given); returns views, stats, the query
    tables and the terminal text (empty unless ``"term"`` is among the formats)."""
    check_batch_head(program, options.batch, options.head)
    for q in options.queries:
        if q >= program.q_len:
            raise ValueError(f"queries must be < q_len={program.q_len}, got {q}")
    notes: list[str] = []
    stats = program_stats(program, chunk=options.chunk)
    tv = bv = None
    if "token" in options.views:
        g = program.geom
        cells = g.q_len * (g.n_state + g.q_len)
        if cells <= options.max_token_cells:
            tv = token_view(program, batch=options.batch, head=options.head, max_cells=options.max_token_cells)
        else:
            notes.append(f"token view skipped: {cells:,} cells > max_token_cells={options.max_token_cells:,}")
    if "block" in options.views:
        bv = block_view(program)
    inspections = [(q, segment_rows(inspect_query(program, q, batch=options.batch, head=options.head,
                                                  temperatures=options.temperatures)))
                   for q in options.queries]
    figures = []
    if tv is not None:
        figures.append(("token", "Token view (cells coloured by region)", token_figure(tv, options.title)))
    if bv is not None:
        figures.append(("block", "Block view (full / partial / empty)", block_figure(bv, options.title)))
    files: list[Path] = []
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for fmt in ("png", "svg"):
            if fmt in options.formats:
                for kind, _, fig in figures:
                    path = out / f"{stem}-{kind}.{fmt}"
                    fig.savefig(path, dpi=110)
                    files.append(path)
        if "html" in options.formats:
            legend = []
            if tv is not None:
                styles = label_styles(tv.names)
                legend += [(n, styles[n][1], c) for n, c in tv.counts().items()]
            if bv is not None:
                legend += [(f"{n} block", BLOCK_COLORS[n], c) for n, c in bv.counts().items()]
            meta = [(k, str(v)) for k, v in options.meta.items()] + [("note", n) for n in notes]
            page = html_page(options.title, meta=meta, legend=legend, stats=stats.summary(),
                             figures=[(h, f) for _, h, f in figures], inspections=inspections)
            path = out / f"{stem}.html"
            path.write_text(page)
            files.append(path)
        path = out / f"{stem}-stats.json"
        path.write_text(json.dumps({"meta": {k: str(v) for k, v in options.meta.items()}, **stats.as_dict()},
                                   indent=1))
        files.append(path)
    text = ""
    if "term" in options.formats:
        kw = dict(width=options.term_width, height=options.term_height, color_output=options.color)
        parts = [f"{options.title}"]
        if tv is not None:
            parts += ["token view (rows: queries, columns: kv rows)", token_text(tv, **kw)]
        if bv is not None:
            parts += ["block view (rows: query blocks, columns: kv blocks)", block_text(bv, **kw)]
        text = "\n".join(parts + notes)
    return VizResult(stats, tv, bv, files, text, notes, inspections)

