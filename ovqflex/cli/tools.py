"""Commands on layers and the machine: ``info``, ``demo``, ``bench``, ``viz``, ``profile``."""
from __future__ import annotations

import time

from tabulate import tabulate

from .flags import add_config_flags, add_device, config_from_args, name_list, parse_options


def _cmd_info(args) -> int:
    """Print what runs on the device: versions, and which backends work forward/backward."""
    from ..info import collect

    print(tabulate(collect(args.device), tablefmt="simple"))
    return 0


def _cmd_demo(args) -> int:
    """A short demo: a sliding-window layer forward (flex) and a training step (auto backend)."""
    import torch

    import ovqflex
    from ovqflex.attention import flex_trains_on

    torch.manual_seed(args.seed)
    layer = ovqflex.SlidingWindowAttention(args.hidden, args.heads, window=args.window, n_sinks=args.sinks)
    x = torch.randn(args.batch, args.seq_len, args.hidden)
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
        ("train step", f"auto -> {'flex' if flex_trains_on(x.device) else 'blocked'}, {t_step:.2f} s, "
                       f"loss {loss.item():.4f}"),
    ], tablefmt="simple"))
    return 0


def _cmd_bench(args) -> int:
    """Run a benchmark profile (its table and JSON)."""
    from ..bench import run_profile

    run_profile(args.profile, device=args.device, out_dir=args.out, only=args.only)
    return 0


def _cmd_viz(args) -> int:
    """Draw a method's attention program: token and block views, statistics, per-query tables."""
    from masks.viz import VizOptions, render

    from ..viz import VizShape, method_program

    shape = VizShape(seq_len=args.seq_len, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                     seed=args.seed)
    options = parse_options(args.opt, "--opt")
    t0 = time.perf_counter()
    program, layer, temps = method_program(args.method, shape, options)
    t_program = time.perf_counter() - t0
    meta = {"method": args.method, "layer": repr(layer).replace("\n", " "), "seq_len": args.seq_len,
            "batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "seed": args.seed,
            "drawn batch, head": f"{args.batch_index}, {args.head}", "options": options or "defaults"}
    opts = VizOptions(views=args.view, formats=args.format, batch=args.batch_index, head=args.head,
                      queries=tuple(args.query or ()), max_token_cells=args.max_cells,
                      chunk=args.chunk or getattr(layer, "chunk_size", None),
                      title=f"{args.method}, T={args.seq_len}", meta=meta, temperatures=temps,
                      term_width=args.width, term_height=args.height, color=args.color)
    t0 = time.perf_counter()
    result = render(program, opts, args.out, stem=f"{args.method}-T{args.seq_len}")
    t_render = time.perf_counter() - t0
    if result.text:
        print(result.text)
    print(tabulate(result.stats.summary(), tablefmt="simple"))
    if result.block is not None:
        print(f"block view: {tuple(result.block.grid.shape)} blocks; "
              f"program built in {t_program:.2f} s, views rendered in {t_render:.2f} s")
    from masks.viz import inspect_query, segment_rows

    for q in opts.queries:
        print(f"\nquery {q}:")
        print(tabulate(segment_rows(inspect_query(program, q, batch=opts.batch, head=opts.head,
                                                  temperatures=temps)), headers="keys"))
    for path in result.files:
        print(f"wrote {path}")
    return 0


def _cmd_profile(args) -> int:
    """Profile a layer or model step: the per-stage table and a Chrome/Perfetto trace."""
    from ..bench.profiler import profile_target
    from ..devices import resolve_device
    from ..profiling import ProfileConfig

    cfg = config_from_args(ProfileConfig, args)
    rows = profile_target(cfg, args.trace)
    what = f"model {cfg.preset} {cfg.pattern or ''}".rstrip() if cfg.target == "model" else f"layer {cfg.target}"
    print(f"{what}, x [{cfg.batch}, {cfg.seq_len}, ...], {cfg.steps} profiled steps per mode, "
          f"device {resolve_device(cfg.device)}")
    print(tabulate(rows, headers="keys", floatfmt=".3g", missingval="-"))
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
    s.add_argument("--seq-len", type=int, default=1024)
    s.add_argument("--batch", type=int, default=2)
    s.add_argument("--hidden", type=int, default=256)
    s.add_argument("--heads", type=int, default=4)
    s.add_argument("--window", type=int, default=256)
    s.add_argument("--sinks", type=int, default=4)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=_cmd_demo)


def add_bench(sub) -> None:
    """The ``bench`` command under the subparsers ``sub``."""
    s = sub.add_parser("bench", help="run a benchmark profile (TOML) and print its table")
    s.add_argument("profile", help="path to a profile, e.g. profiles/blockmask.toml")
    add_device(s)
    s.add_argument("--out", default="bench-out", help="directory for the JSON results (default: bench-out)")
    s.add_argument("--only", default=None, help="run only scenarios whose name contains this string")
    s.set_defaults(fn=_cmd_bench)


def add_viz(sub) -> None:
    """The ``viz`` command under the subparsers ``sub``."""
    from masks.viz import FORMATS, MAX_TOKEN_CELLS, VIEWS

    from ..viz import drawable_methods

    s = sub.add_parser("viz", help="draw the attention program of a layer: token, block and per-query views")
    s.add_argument("method", help=f"one of {', '.join(drawable_methods())}")
    s.add_argument("--seq-len", type=int, default=512, help="tokens T (default 512)")
    s.add_argument("--heads", type=int, default=1)
    s.add_argument("--head-dim", type=int, default=16)
    s.add_argument("--batch", type=int, default=1, help="batch size of the random input")
    s.add_argument("--seed", type=int, default=0, help="seed of the layer init and the input")
    s.add_argument("--opt", action="append", metavar="NAME=VALUE",
                   help="layer option, e.g. max_centroids=256, chunk_size=64, window=64 (repeatable)")
    s.add_argument("--view", type=name_list(VIEWS), default=VIEWS,
                   help="comma-separated views: token,block (default both; token only if small enough)")
    s.add_argument("--format", type=name_list(FORMATS), default=("png", "html", "term"),
                   help="comma-separated outputs: png,svg,html,term (default png,html,term)")
    s.add_argument("--query", type=int, action="append", help="inspect this query index (repeatable)")
    s.add_argument("--head", type=int, default=0, help="head whose bias is drawn (default 0)")
    s.add_argument("--batch-index", type=int, default=0, help="batch element whose bias is drawn")
    s.add_argument("--chunk", type=int, default=None, help="query grouping of the state-rows-per-chunk "
                   "statistic (default: the layer's chunk_size, else the block size)")
    s.add_argument("--max-cells", type=int, default=MAX_TOKEN_CELLS, help="largest token view drawn (cells)")
    s.add_argument("--width", type=int, default=120, help="terminal columns")
    s.add_argument("--height", type=int, default=48, help="terminal rows per view")
    s.add_argument("--color", action="store_true", help="ANSI colours in the terminal view")
    s.add_argument("--out", default="viz-out", help="directory for PNG/SVG/HTML/JSON (default viz-out)")
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
