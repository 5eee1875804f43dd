"""Mask visualizer (docs/design.md §8): draw an :class:`~masks.program.AttentionProgram`.

One stage per file: ``labels`` (which region a cell belongs to), ``token_view``
(small T, one cell per query x kv row), ``block_view`` (any T, one cell per block,
from the analytic block lists), ``stats`` (sparsity, keys per query, from interval
bounds), ``inspect_query`` (one query's rows, region, bias, temperature),
``figures`` (matplotlib PNG/SVG), ``terminal``, ``html``, and ``render`` (all of it).
Generic over regions: a new method only supplies its program.
"""
from .block_view import BlockView, block_view
from .inspect_query import Segment, inspect_query, segment_rows
from .labels import MASKED, PALETTE, REGION_ORDER, label_cells, label_names
from .render import DEFAULT_FORMATS, FORMATS, VIEWS, VizOptions, VizResult, render
from .stats import ProgramStats, program_stats, visible_per_query
from .token_view import MAX_TOKEN_CELLS, TokenView, token_view

__all__ = ["BlockView", "DEFAULT_FORMATS", "FORMATS", "MASKED", "MAX_TOKEN_CELLS", "PALETTE", "ProgramStats",
           "REGION_ORDER", "Segment", "TokenView", "VIEWS", "VizOptions", "VizResult", "block_view", "inspect_query",
           "label_cells", "label_names", "program_stats", "render", "segment_rows", "token_view", "visible_per_query"]
