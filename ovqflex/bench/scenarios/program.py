"""Scenarios of the attention program itself: the analytic block mask and the visualizer at scale."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from masks.blocks import build_block_layout
from masks.regions import Geometry, OwnChunk, StateBank
from recurrences.checks import check_choice, check_chunk

from ...methods import METHODS
from ..measure import measure
from .base import Scenario, register


@dataclass(kw_only=True)
class BlockmaskScenario(Scenario):
    seq_len: int
    chunk_size: int
    state_rows: int           # rows of each chunk's bank
    block_size: int = 128
    with_q_side: bool = False  # also the backward's transposed lists
    repeats: int = 3

    def __post_init__(self):
        check_chunk("chunk_size", self.chunk_size)  # (as the state bank's region checks it)


@register("blockmask", BlockmaskScenario)
def blockmask(sc: BlockmaskScenario, device: str) -> list[dict]:
    """Build the analytic block mask of a per-chunk state bank program (docs/design.md §3.2)."""
    T, C, N, blk, with_q = sc.seq_len, sc.chunk_size, sc.state_rows, sc.block_size, sc.with_q_side
    dev = torch.device(device)
    n_chunks = -(-T // C)
    live = torch.clamp(torch.arange(n_chunks, device=dev) * C * N // (torch.arange(n_chunks, device=dev) * C + N), max=N)
    geom = Geometry(T, T, -(-n_chunks * N // blk) * blk, T, blk, blk)
    regions = (StateBank(N, C, live), OwnChunk(C))

    def build():
        params = tuple(r.params(geom, dev) for r in regions)
        lay = build_block_layout(regions, params, geom)
        bm = lay.block_mask(lambda b, h, q, kv: q >= 0, with_q_side=with_q)
        return lay, bm

    m = measure(build, device=dev, repeats=sc.repeats)
    lay, bm = build()
    visible = int(lay.visible_blocks())
    total = geom.n_q_blocks * geom.n_kv_blocks
    return [{
        "scenario": sc.name or sc.kind,
        "T": T,
        "kv_rows": geom.kv_len,
        "q_side": with_q,
        "visible_blocks": visible,
        "block_sparsity": 1 - visible / total,
        "time_s": m.seconds,
        "peak_mb": m.peak_mb,
        "dense_mask_would_be_gb": T * geom.kv_len / 2**30,
    }]


@dataclass(kw_only=True)
class VizScenario(Scenario):
    method: str                # a drawable method (ovqflex.viz.drawable_methods)
    seq_lens: list[int]
    heads: int = 1
    head_dim: int = 16
    options: dict = field(default_factory=dict)  # layer options
    views: list[str] = field(default_factory=lambda: ["block"])
    repeats: int = 1

    def __post_init__(self):
        from masks.viz import VizOptions

        from ...viz import drawable_methods

        check_choice("method", self.method, drawable_methods())
        VizOptions(views=tuple(self.views), formats=("png",))
        METHODS[self.method].example(self.heads, self.head_dim, dict(self.options))  # its options, by name


@register("viz", VizScenario)
def viz(sc: VizScenario, device: str) -> list[dict]:
    """The visualizer at scale: build a method's program (random input), then its block view
    (grid, statistics, PNG) — timed and memory-measured separately, for each ``seq_len``."""
    import tempfile

    from masks.viz import VizOptions, render

    from ...viz import VizShape, method_program

    method, repeats = sc.method, sc.repeats
    opts = VizOptions(views=tuple(sc.views), formats=("png",))
    rows = []
    for T in sc.seq_lens:
        shape = VizShape(seq_len=T, heads=sc.heads, head_dim=sc.head_dim)
        build = lambda: method_program(method, shape, dict(sc.options))[0]  # noqa: E731
        m_prog = measure(build, device=device, repeats=repeats, warmup=1)
        program = build()
        with tempfile.TemporaryDirectory() as tmp:
            m_view = measure(lambda: render(program, opts, tmp), device=device, repeats=repeats, warmup=0)
        g = program.geom
        for case, m in (("program (op, random input)", m_prog), (f"{'+'.join(opts.views)} view + PNG", m_view)):
            rows.append({"T": T, "case": case, "kv_rows": g.kv_len,
                         "blocks": f"{g.n_q_blocks}x{g.n_kv_blocks}", "time_s": m.seconds, "peak_mb": m.peak_mb})
    return rows
