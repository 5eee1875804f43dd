"""Statistics of a program, from the regions' interval bounds (``O(T x regions)``, no T x KV).

Query ``i`` sees the union of its regions' intervals ``[lo, hi)``; counting its
length per query needs only the bounds. Rows the mask admits but whose bias is
``-inf`` (empty state rows) are counted separately by the token view, not here; a region
with a per-row predicate inside its interval (the versioned layout's liveness,
:mod:`masks.versioned`) is counted over its whole interval, live rows or not: an upper
bound of what its queries see (the token view draws the live ones).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from ..program import AttentionProgram
from recurrences.checks import check_int


def _union_length(intervals: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Length of the union of per-query intervals; each ``(lo [Q], hi [Q])`` int64."""
    if not intervals:
        raise ValueError("need at least one interval")
    lo = torch.stack([a for a, _ in intervals], -1)
    hi = torch.stack([b for _, b in intervals], -1)
    lo, order = lo.sort(-1)
    hi = hi.gather(-1, order)
    total = torch.zeros(lo.shape[0], dtype=torch.long, device=lo.device)
    end = torch.full_like(total, torch.iinfo(torch.long).min)
    for j in range(lo.shape[-1]):
        start = torch.maximum(lo[:, j], end)
        total += (hi[:, j] - start).clamp(min=0)
        end = torch.maximum(end, hi[:, j])
    return total


def visible_per_query(program: AttentionProgram, names: tuple[str, ...] | None = None) -> Tensor:
    """``[q_len]`` int64: kv rows query ``i`` sees (only regions named in ``names``, if given)."""
    q = torch.arange(program.q_len, device=program.q.device)
    iv = []
    for region, p in zip(program.regions, program.params):
        if names is None or region.name in names:
            lo, hi = region.bounds(p, q)
            iv.append((lo.long().expand_as(q), hi.long().expand_as(q)))
    if not iv:
        return torch.zeros_like(q)
    return _union_length(iv)


@dataclass
class ProgramStats:
    """What the HTML page and the CLI print. ``sparsity``: 1 - visible / (q_len x kv rows);
    ``density_vs_causal``: visible / causal pairs ``q_len (q_len + 1) / 2``;
    ``state_rows_per_chunk[c]``: state rows the first query of chunk ``c`` sees;
    ``kv_bytes``: bytes of the program's k and v (all B, H, padding included); ``upper_bound``: a region sees
    its rows by a per-row predicate (the versioned layout's liveness), so the pair and key counts are its
    interval's rows, live or not."""

    q_len: int
    kv_rows: int
    state_rows: int
    regions: list[str]
    visible_pairs: int
    sparsity: float
    density_vs_causal: float
    keys_per_query_min: int
    keys_per_query_mean: float
    keys_per_query_max: int
    chunk: int
    state_rows_per_chunk: list[int]
    visible_blocks: int
    total_blocks: int
    block_sparsity: float
    kv_bytes: int
    upper_bound: bool = False

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> list[tuple[str, str]]:
        """(name, value) pairs for tables; the per-chunk list is summarized."""
        spc = self.state_rows_per_chunk
        spc_text = f"min {min(spc)}, mean {sum(spc) / len(spc):.1f}, max {max(spc)} over {len(spc)} chunks"
        at_most = " (at most: every row of the state's intervals, live or not)" if self.upper_bound else ""
        return [
            ("queries", f"{self.q_len:,}"),
            ("kv rows (state + tokens, padded)", f"{self.kv_rows:,} ({self.state_rows:,} + {self.kv_rows - self.state_rows:,})"),
            ("regions", ", ".join(self.regions)),
            ("visible (query, row) pairs", f"{self.visible_pairs:,}{at_most}"),
            ("sparsity", f"{self.sparsity:.4%}"),
            ("density vs full causal", f"{self.density_vs_causal:.4f}"),
            ("visible keys per query", f"min {self.keys_per_query_min:,}, mean {self.keys_per_query_mean:,.1f}, "
                                       f"max {self.keys_per_query_max:,}"),
            (f"state rows per chunk ({self.chunk} tokens)", spc_text),
            ("blocks listed / total", f"{self.visible_blocks:,} / {self.total_blocks:,} "
                                      f"(block sparsity {self.block_sparsity:.4%})"),
            ("kv bytes (k + v)", f"{self.kv_bytes:,} ({self.kv_bytes / 2**20:.1f} MiB)"),
        ]


def program_stats(program: AttentionProgram, *, chunk: int | None = None) -> ProgramStats:
    """Statistics of ``program``; ``chunk`` (default the query block) groups queries for the
    state-rows-per-chunk figure."""
    g = program.geom
    chunk = g.block_q if chunk is None else check_int("chunk", chunk)
    counts = visible_per_query(program)
    state = visible_per_query(program, ("state",))
    firsts = torch.arange(0, g.q_len, chunk, device=state.device)
    visible = int(counts.sum())
    T = g.q_len
    blocks = int(program.layout.visible_blocks())
    total_blocks = g.n_q_blocks * g.n_kv_blocks
    return ProgramStats(
        q_len=T, kv_rows=g.kv_len, state_rows=g.n_state, regions=[r.name for r in program.regions],
        visible_pairs=visible, sparsity=1 - visible / (T * g.kv_len),
        density_vs_causal=visible / (T * (T + 1) / 2),
        keys_per_query_min=int(counts.min()), keys_per_query_mean=float(counts.double().mean()),
        keys_per_query_max=int(counts.max()), chunk=chunk, state_rows_per_chunk=state[firsts].tolist(),
        visible_blocks=blocks, total_blocks=total_blocks, block_sparsity=1 - blocks / total_blocks,
        kv_bytes=program.k.numel() * program.k.element_size() + program.v.numel() * program.v.element_size(),
        upper_bound=not all(r.exact for r in program.regions),
    )
