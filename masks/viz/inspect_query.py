"""Per-query inspector: which kv rows query ``i`` sees, their region, bias and temperature."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..program import AttentionProgram
from recurrences.checks import check_int
from .labels import MASKED, label_cells, label_names, row_bias


@dataclass
class Segment:
    """A run of consecutive kv rows ``[lo, hi)`` with one label, as seen by one query.

    ``what``: ``"state rows a..b"`` or ``"tokens a..b"`` (token index ``j = row - S``);
    ``bias_min/max`` over the run's biases (None without a score_mod; a row of bias ``-inf`` is
    masked, never in a run); ``logit_scale``: ``scale x temperature`` that multiplies ``<q, k>``."""

    region: str
    lo: int
    hi: int
    what: str
    bias_min: float | None
    bias_max: float | None
    temperature: float
    logit_scale: float

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def _describe(lo: int, hi: int, n_state: int) -> str:
    if hi <= n_state:
        return f"state rows {lo}..{hi - 1}"
    if lo >= n_state:
        return f"tokens {lo - n_state}..{hi - 1 - n_state}"
    return f"state rows {lo}..{n_state - 1} + tokens 0..{hi - 1 - n_state}"


def inspect_query(program: AttentionProgram, i: int, *, batch: int = 0, head: int = 0,
                  temperatures: dict[str, Tensor | float] | None = None) -> list[Segment]:
    """Visible runs of kv rows for query ``i`` (``0 <= i < q_len``), in kv order.

    ``temperatures``: per region name a ``[H]`` tensor or a float folded into that
    region's rows (OVQ: ``beta`` on q for every region; KVM: ``tau_state``, ``tau_bswa``);
    default 1. Work ``O(KV x regions)`` for the one query.
    """
    check_int("query", i, minimum=0)
    g = program.geom
    if i >= g.q_len:
        raise ValueError(f"query must be < q_len={g.q_len}, got {i}")
    bias = row_bias(program, batch, head)
    dev = program.q.device
    kv = torch.arange(g.kv_len, device=dev)
    labels = label_cells(program, torch.tensor([i], device=dev), kv, bias, batch=batch, head=head).cpu()
    names = label_names(program)
    change = torch.nonzero(labels[1:] != labels[:-1]).flatten() + 1
    starts = [0, *change.tolist()]
    ends = [*change.tolist(), g.kv_len]
    out = []
    for lo, hi in zip(starts, ends):
        name = names[int(labels[lo])]
        if name == MASKED:
            continue
        b_min = b_max = None
        if bias is not None:
            b_min, b_max = float(bias[lo:hi].min()), float(bias[lo:hi].max())
        t = (temperatures or {}).get(name, 1.0)
        t = float(t[head]) if isinstance(t, Tensor) else float(t)
        out.append(Segment(name, lo, hi, _describe(lo, hi, g.n_state), b_min, b_max, t, t * program.scale))
    return out


def segment_rows(segments: list[Segment]) -> list[dict]:
    """Table rows (dicts) of an inspection, for tabulate / HTML."""
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    return [{"region": s.region, "kv rows": f"{s.lo}..{s.hi - 1}", "n": s.rows, "what": s.what,
             "bias min": fmt(s.bias_min), "bias max": fmt(s.bias_max), "temperature": f"{s.temperature:.4g}",
             "logit scale": f"{s.logit_scale:.4g}"} for s in segments]
