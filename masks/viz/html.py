"""A self-contained HTML page: the figures inline as SVG, legend, statistics, inspector."""
from __future__ import annotations

import html
import io

from matplotlib.figure import Figure


def svg_text(fig: Figure) -> str:
    """The figure as an inline ``<svg>`` element (no XML prolog, no external references)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg"):]


class Raw(str):
    """A table cell that is already HTML (not escaped)."""


def _cell(c) -> str:
    return c if isinstance(c, Raw) else html.escape(str(c))


def _table(rows: list[dict] | list[tuple], headers: list[str] | None = None) -> str:
    if rows and isinstance(rows[0], dict):
        headers = list(rows[0])
        rows = [tuple(r.values()) for r in rows]
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers or [])
    body = "".join("<tr>" + "".join(f"<td>{_cell(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table>{'<tr>' + head + '</tr>' if head else ''}{body}</table>"


_STYLE = """body{font-family:sans-serif;margin:1.5em;max-width:1400px}
table{border-collapse:collapse;margin:.5em 0 1.2em}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}
.sw{display:inline-block;width:1em;height:1em;border:1px solid #888;vertical-align:middle}
svg{max-width:100%;height:auto}"""


def html_page(title: str, *, meta: list[tuple[str, str]], legend: list[tuple[str, str, int]],
              stats: list[tuple[str, str]], figures: list[tuple[str, Figure]],
              inspections: list[tuple[int, list[dict]]]) -> str:
    """legend: ``(name, hex colour, cells drawn)``; figures: ``(heading, figure)``;
    inspections: ``(query, segment rows)``."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>",
             "<h2>Program</h2>", _table(meta, ["option", "value"]),
             "<h2>Legend</h2>",
             _table([(Raw(f"<span class='sw' style='background:{c}'></span>"), n, f"{k:,}")
                     for n, c, k in legend], ["colour", "region", "cells drawn"]),
             "<h2>Statistics</h2>", _table(stats, ["statistic", "value"])]
    for heading, fig in figures:
        parts += [f"<h2>{html.escape(heading)}</h2>", svg_text(fig)]
    for q, rows in inspections:
        parts += [f"<h2>Query {q}</h2>", _table(rows) if rows else "<p>sees no rows</p>"]
    parts.append("</body></html>")
    return "\n".join(parts)
