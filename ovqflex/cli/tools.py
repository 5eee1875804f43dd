"""Commands on layers and the machine: ``info``, ``demo``, ``bench``, ``viz``, ``profile``."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from tabulate import tabulate

from .flags import add_config_flags, add_device, config_from_args, int_list


@dataclass
class DemoConfig:
    """What ``ovqflex demo`` runs: a :class:`ovqflex.SlidingWindowAttention` layer on ``x [batch, seq_len,
    hidden]`` (one flag per field)."""

    seq_len: int = field(default=1024, metadata={"help": "tokens T"})
    batch: int = field(default=2, metadata={"help": "batch size"})
    hidden: int = field(default=256, metadata={"help": "model width"})
    heads: int = field(default=4, metadata={"help": "attention heads"})
    window: int = field(default=256, metadata={"help": "sliding window (tokens)"})
    sinks: int = field(default=4, metadata={"help": "attention sinks (first tokens every query sees)"})
    seed: int = field(default=0, metadata={"help": "seed of the layer init and the input"})


def _cmd_info(args) -> int:
    """Print what runs on the device: versions, and which backends work forward/backward."""
    from ..info import collect

    print(tabulate(collect(args.device), tablefmt="simple"))
    return 0


def _cmd_demo(args) -> int:
    """A short demo: a sliding-window layer forward (flex) and a training step (auto backend)."""
    import torch

    import ovqflex
    from ovqflex.attention import training_backend

    cfg = config_from_args(DemoConfig, args)
    torch.manual_seed(cfg.seed)
    layer = ovqflex.SlidingWindowAttention(cfg.hidden, cfg.heads, window=cfg.window, n_sinks=cfg.sinks)
    x = torch.randn(cfg.batch, cfg.seq_len, cfg.hidden)
    with torch.no_grad():
        t0 = time.perf_counter()
        y = layer(x)
        t_fwd = time.perf_counter() - t0
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    loss = layer(x).square().mean()
    loss.backward()
    opt.step()
    t_step = time.perf_counter() - t0
    print(layer)
    print(tabulate([
        ("input x", tuple(x.shape)),
        ("output y", tuple(y.shape)),
        ("forward (no grad)", f"auto -> flex, {t_fwd:.2f} s (first call includes compile)"),
        ("train step", f"auto -> {training_backend(x.device)}, {t_step:.2f} s, "
                       f"loss {loss.item():.4f}"),
    ], tablefmt="simple"))
    return 0


def _cmd_bench(args) -> int:
    """Run a benchmark profile (its table and JSON)."""
    from ..bench import run_profile

    run_profile(args.profile, device=args.device, out_dir=args.out, only=args.only,
                fresh_compile_cache=args.fresh_compile_cache, seq_lens=args.seq_lens)
    return 0


def _cmd_viz(args) -> int:
    """Draw a method's attention program: token and block views, statistics, per-query tables."""
    from masks.viz import render

    from ..viz import VizConfig, method_program

    cfg = config_from_args(VizConfig, args)
    t0 = time.perf_counter()
    program, layer, temps = method_program(cfg.method, cfg, cfg.options)
    t_program = time.perf_counter() - t0
    opts = cfg.render_options(layer, temps)
    t0 = time.perf_counter()
    result = render(program, opts, cfg.out, stem=cfg.stem)
    t_render = time.perf_counter() - t0
    if result.text:
        print(result.text)
    print(tabulate(result.stats.summary(), tablefmt="simple"))
    if result.block is not None:
        print(f"block view: {tuple(result.block.grid.shape)} blocks; "
              f"program built in {t_program:.2f} s, views rendered in {t_render:.2f} s")
    for q, rows in result.inspections:
        print(f"\nquery {q}:")
        print(tabulate(rows, headers="keys", disable_numparse=True))  # as inspect_query formatted them
    for path in result.files:
        print(f"wrote {path}")
    return 0


def _cmd_profile(args) -> int:
    """Profile a layer or model step: the per-stage table and a Chrome/Perfetto trace."""
    from ..bench.profiler import profile_target
    from ..devices import resolve_device
    from ..profiling import ProfileConfig

    cfg = config_from_args(ProfileConfig, args)
    tables = profile_target(cfg, args.trace)
    what = f"model {cfg.preset} {cfg.pattern or ''}".rstrip() if cfg.target == "model" else f"layer {cfg.target}"
    print(f"{what}, x [{cfg.batch}, {cfg.seq_len}, ...], {cfg.steps} profiled steps per mode, "
          f"device {resolve_device(cfg.device)}")
    print(tabulate(tables.stages, headers="keys", floatfmt=".3g", missingval="-"))
    if tables.kernels:
        device = "kernels by device time" if "kernel" in tables.kernels[0] else "operators by self time"
        print(f"\ntop {cfg.kernels} {device}, per stage:")
        print(tabulate(tables.kernels, headers="keys", floatfmt=".3g", missingval="-"))
    print(f"wrote {args.trace} (open in chrome://tracing or https://ui.perfetto.dev)")
    return 0


def add_info(sub) -> None:
    """The ``info`` command under the subparsers ``sub``."""
    s = sub.add_parser("info", help="torch, device, which backends work forward/backward here")
    add_device(s)
    s.set_defaults(fn=_cmd_info)


def add_demo(sub) -> None:
    """The ``demo`` command under the subparsers ``sub``."""
    s = sub.add_parser("demo", help="run a sliding-window attention layer forward and one training step")
    add_config_flags(s, DemoConfig)
    s.set_defaults(fn=_cmd_demo)


def add_bench(sub) -> None:
    """The ``bench`` command under the subparsers ``sub``."""
    s = sub.add_parser("bench", help="run a benchmark profile (TOML) and print its table")
    s.add_argument("profile", help="path to a profile, e.g. profiles/blockmask.toml")
    add_device(s)
    s.add_argument("--out", default="bench-out", help="directory for the JSON results (default: bench-out)")
    s.add_argument("--only", default=None, help="run only scenarios whose name contains this string")
    s.add_argument("--fresh-compile-cache", action="store_true",
                   help="compile with empty inductor/Triton caches (a temporary directory), so the compiled "
                        "cases' first_call_s is a cold compile")
    s.add_argument("--seq-lens", type=int_list, default=None,
                   help="comma-separated lengths that replace each chosen scenario's seq_lens, e.g. 65536: one "
                        "length of a long GPU scenario per run (every chosen scenario must have seq_lens)")
    s.set_defaults(fn=_cmd_bench)


def add_viz(sub) -> None:
    """The ``viz`` command under the subparsers ``sub``: a flag per :class:`ovqflex.viz.VizConfig` field."""
    from ..viz import VizConfig

    s = sub.add_parser("viz", help="draw the attention program of a layer: token, block and per-query views")
    add_config_flags(s, VizConfig)
    s.set_defaults(fn=_cmd_viz)


def add_profile(sub) -> None:
    """The ``profile`` command under the subparsers ``sub``: a flag per :class:`ovqflex.profiling.ProfileConfig`
    field, and ``--trace``."""
    from ..profiling import ProfileConfig  # (not ovqflex.bench: the CLI stays light for `train`)

    s = sub.add_parser("profile", help="run a layer or model step under torch.profiler: stage table + trace")
    add_config_flags(s, ProfileConfig)
    s.add_argument("--trace", default="profile-trace.json", help="Chrome/Perfetto trace file to write "
                   "(default: profile-trace.json)")
    s.set_defaults(fn=_cmd_profile)
