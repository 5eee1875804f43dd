"""The ``ovqflex`` command line: ``info``, ``demo``, ``bench``."""
from __future__ import annotations

import argparse
import sys
import time

from tabulate import tabulate


def _cmd_info(args) -> int:
    from .info import collect

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
    from .bench import run_profile

    run_profile(args.profile, device=args.device, out_dir=args.out, only=args.only)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ovqflex", description="compressed-memory attention as FlexAttention programs")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="torch, device, which backends work forward/backward here")
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    s.set_defaults(fn=_cmd_info)

    s = sub.add_parser("demo", help="run a sliding-window attention layer forward and one training step")
    s.add_argument("--seq-len", type=int, default=1024)
    s.add_argument("--batch", type=int, default=2)
    s.add_argument("--hidden", type=int, default=256)
    s.add_argument("--heads", type=int, default=4)
    s.add_argument("--window", type=int, default=256)
    s.add_argument("--sinks", type=int, default=4)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=_cmd_demo)

    s = sub.add_parser("bench", help="run a benchmark profile (TOML) and print its table")
    s.add_argument("profile", help="path to a profile, e.g. profiles/blockmask.toml")
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    s.add_argument("--out", default="bench-out", help="directory for the JSON results (default: bench-out)")
    s.add_argument("--only", default=None, help="run only scenarios whose name contains this string")
    s.set_defaults(fn=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"ovqflex {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
