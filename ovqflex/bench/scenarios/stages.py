"""Where a stateful op's forward spends its time (``stages``): each stage of its program build per
state layout, the flex kernel on that program, the whole op and causal SDPA, in one process."""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from masks.blocks import build_block_layout
from masks.regions import StateBank
from masks.versioned import CheckpointBank
from recurrences.checks import check_choice

from ...attention import attend
from ...profiling import stage_timer
from ..measure import measure, progress, saved_for_backward_mb
from .base import Scenario, register
from .op import DTYPES, StateMethodKeys, op_inputs


@dataclass(kw_only=True)
class StagesScenario(Scenario, StateMethodKeys):
    """The method keys of :class:`~ovqflex.bench.scenarios.op.StateMethodKeys`; inputs ``[1, heads, T,
    head_dim]`` in ``dtype`` (``"fp32"`` or ``"bf16"``), as the op scenarios draw them; ``layouts``: the state
    layouts whose programs are built and run."""

    seq_lens: list[int]
    heads: int = 8
    head_dim: int = 64
    dtype: str = "bf16"
    repeats: int = 3

    def __post_init__(self):
        super().__post_init__()
        check_choice("dtype", self.dtype, DTYPES)


def layout_of(program) -> str:
    """The state layout of a program: ``"snapshot"``, ``"versioned"`` or ``"none"`` (no state rows)."""
    for region in program.regions:
        if isinstance(region, StateBank):
            return "snapshot"
        if isinstance(region, CheckpointBank):
            return "versioned"
    return "none"


def _row_costs(by_layout: dict[str, dict]) -> None:
    """Adds ``row_cost_vs_snapshot`` to the versioned row of one length (``by_layout``: its rows by
    layout): its build plus kernel time per state row over the snapshot row's, the constant
    ``state_layout="auto"`` weighs rows by (:data:`recurrences.versioned.LAYOUT_ROW_COST`)."""
    if {"snapshot", "versioned"} <= by_layout.keys():
        snap, ver = by_layout["snapshot"], by_layout["versioned"]
        per_row = [(r["program_s"] + r["kernel_s"]) / max(r["state_rows"], 1) for r in (snap, ver)]
        ver["row_cost_vs_snapshot"] = per_row[1] / per_row[0]


@register("stages", StagesScenario)
def stages(sc: StagesScenario, device: str) -> list[dict]:
    """The stage breakdown of an OVQ, KVM or VQ forward (no grad) at each ``seq_len``: per layout, one
    row with the median time of each stage of the program build (``proj``, ``routing``,
    ``state_build``, ``block_mask``: :func:`~ovqflex.profiling.stage_timer`, synchronized at each
    stage boundary), the whole build unsynchronized (``program_s``), what the build keeps for a
    backward (``program_saved_mb``: built once with grad,
    :func:`~ovqflex.bench.measure.saved_for_backward_mb`), the flex kernel on the built program
    (``kernel_s``: compiled, as ``attend(program, "flex")`` runs it, its ``BlockMask`` object made per
    call; ``kernel_first_call_s``: its first call, the flex compile for this program's shapes), its kv
    rows, listed blocks and the full ones among them (no ``mask_mod`` runs on those; for the versioned layout
    also ``kernel_unrefined_s``, the kernel on the same program with every state block partial, its candidate
    lists of ``build_block_layout(refine=False)``: what its liveness order and full blocks save); then the op
    itself (``state_layout="auto"``, flex, eager: which layout it took) and causal SDPA on the same q, k, v.
    ``x_vs_sdpa``: SDPA's time over the row's (kernel and program rows: over the kernel and the build). The
    versioned row's ``row_cost_vs_snapshot``: its (build + kernel) time per state row over the snapshot's (the
    cost ``state_layout="auto"`` weighs).
    """
    program_of, op, extra, options = sc.method_parts()
    dev, dtype = torch.device(device), DTYPES[sc.dtype]
    H, D, repeats = sc.heads, sc.head_dim, sc.repeats
    rows: list[dict] = []
    for T in sc.seq_lens:
        t = op_inputs(T, H, D, extra, dev, dtype)
        by_layout: dict[str, dict] = {}
        with torch.no_grad():
            sdpa = measure(lambda: F.scaled_dot_product_attention(t["q"], t["k"], t["v"], is_causal=True),
                           device=dev, repeats=repeats).seconds
            for layout in sc.layouts:
                def build(layout=layout):
                    return program_of(**t, state_layout=layout, **options)[0]

                whole = measure(build, device=dev, repeats=repeats)
                per_stage: dict[str, list[float]] = {}
                for _ in range(repeats):
                    with stage_timer(dev) as times:
                        build()
                    for name, s in times.items():
                        per_stage.setdefault(name, []).append(s)
                leaves = {n: x.detach().requires_grad_(x.is_floating_point()) for n, x in t.items()}
                saved = saved_for_backward_mb(lambda: program_of(**leaves, state_layout=layout, **options)[0],
                                              leaves.values())
                program = build()
                kernel = measure(lambda: attend(program, "flex"), device=dev, repeats=repeats)
                lay = program.layout
                row = {"T": T, "case": f"{layout} program + flex kernel",
                       **{f"{name}_s": statistics.median(s) for name, s in per_stage.items()},
                       "program_s": whole.seconds, "program_peak_mb": whole.peak_mb, "program_saved_mb": saved,
                       "kernel_s": kernel.seconds,
                       "kernel_first_call_s": kernel.first_s,
                       "kernel_x_vs_sdpa": sdpa / kernel.seconds, "program_x_vs_sdpa": sdpa / whole.seconds,
                       "kv_rows": program.geom.kv_len, "state_rows": program.geom.n_state,
                       "visible_blocks": int(lay.visible_blocks()), "full_blocks": int(lay.full_num.sum())}
                if layout == "versioned":  # the same program with every state block partial (no refinement)
                    unrefined = dataclasses.replace(program, layout=build_block_layout(
                        program.regions, program.params, program.geom, refine=False))
                    row["kernel_unrefined_s"] = measure(lambda: attend(unrefined, "flex"), device=dev,
                                                        repeats=repeats).seconds
                    del unrefined
                progress(f"T={T} {layout}: program {whole.seconds * 1e3:.2f} ms, kernel {kernel.seconds * 1e3:.2f} ms")
                rows.append(row)
                by_layout[layout] = row
                del program
            _row_costs(by_layout)
            auto = layout_of(program_of(**t, **options)[0])
            whole_op = measure(lambda: op(**t, backend="flex", **options), device=dev, repeats=repeats)
        progress(f"T={T} op (auto: {auto})", whole_op.seconds)
        rows += [{"T": T, "case": f"op, flex, eager (auto: {auto})", "time_s": whole_op.seconds,
                  "peak_mb": whole_op.peak_mb, "x_vs_sdpa": sdpa / whole_op.seconds},
                 {"T": T, "case": "sdpa causal fwd", "time_s": sdpa, "x_vs_sdpa": 1.0}]
        for row in rows[-len(sc.layouts) - 2:]:
            row["dtype"] = sc.dtype
    return rows
