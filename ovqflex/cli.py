"""The ``ovqflex`` command line: ``info``, ``demo``, ``train``, ``eval``, ``experiment``, ``generate``, ``bench``,
``viz``, ``profile``."""
from __future__ import annotations

import argparse
import os
import sys
import time

from tabulate import tabulate

from .devices import AUTO, NAMES

DEVICE_HELP = f"{NAMES} (default: {AUTO})"


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


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 512,1024, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 512,1024, got {text!r}")
    return values


def _id_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 3,0,17, got {text!r}") from None


def _options(items: list[str] | None, what: str) -> dict:
    from .training.evaluate import parse_overrides

    try:
        return parse_overrides(items or [])
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


def _cmd_train(args) -> int:
    from .tasks import TASKS
    from .training import TrainConfig, train

    if args.task not in TASKS:
        raise ValueError(f"--task must be one of {sorted(TASKS)}, got {args.task!r}")
    cfg = TrainConfig(
        out=args.out, task=args.task, task_options=_options(args.task_opt, "--task-opt"), data=args.data,
        preset=args.preset, pattern=args.pattern, model_options=_options(args.model_opt, "--model-opt"),
        steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, min_lr=args.min_lr,
        warmup=args.warmup, weight_decay=args.weight_decay, grad_clip=args.grad_clip, seed=args.seed,
        compile=not args.no_compile, dtype=args.dtype, device=args.device, log_every=args.log_every,
        ckpt_every=args.ckpt_every, keep_checkpoints=args.keep, deterministic=args.deterministic,
        progress=not args.no_progress,
    )
    result = train(cfg, resume=args.resume, resume_from=args.resume_from)
    if result.loss is not None and int(os.environ.get("RANK", "0")) == 0:
        print(f"trained {result.step} steps -> {result.out}: loss {result.loss:.4f}, "
              f"target accuracy {result.accuracy:.3f}, {result.tokens_per_s:,.0f} tokens/s")
    return 0


def _cmd_eval(args) -> int:
    from .training import evaluate

    def show(row):
        print(f"  length {row.length:>7}: accuracy {row.accuracy:.4f}  ({row.seconds:.1f} s)", flush=True)

    doc = evaluate(args.run, args.lengths, n_examples=args.examples, batch_size=args.batch_size,
                   overrides=_options(args.override, "--override"), checkpoint=args.checkpoint,
                   device=args.device, progress=show)
    over = ", ".join(f"{k}={v}" for k, v in doc["overrides"].items()) or "none"
    print(f"\n{doc['task']} ({doc['task_description']}), pattern {doc['pattern']}, step {doc['step']}, "
          f"trained at {doc['train_seq_len']} tokens, overrides: {over}")
    print(tabulate([(r["length"], f"{r['accuracy']:.4f}", f"{r['loss']:.4f}", r["targets"], f"{r['seconds']:.1f}")
                    for r in doc["rows"]], headers=["length", "accuracy", "loss", "targets", "seconds"]))
    png = " and eval.png" if doc.get("plot") else " (no plot: matplotlib is not installed)"
    print(f"wrote {args.run}/eval.json{png}")
    return 0


def _seed_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values) or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct comma-separated integers >= 0 like 0,1, got {text!r}")
    return values


def _label_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated model labels like sw-ovq,sw-nope, got {text!r}")
    return values


def _cmd_experiment(args) -> int:
    from .experiments import get_experiment, plan, run_experiment

    exp = get_experiment(args.name)
    out = args.out or f"runs/experiments/{exp.name}-{args.scale}"
    p = plan(exp, args.scale, out, seeds=args.seeds, models=args.models, device=args.device,
             progress=not args.no_progress)
    if args.dry_run:
        print(p.describe())
        return 0
    results = run_experiment(p, resume=args.resume, log=lambda line: print(line, flush=True))
    print(f"\n{results['experiment']} ({results['scale']} scale): {results['task_description']}; trained at "
          f"{results['train_seq_len']:,} tokens; accuracy, mean over seeds (min-max)")
    print(results["table"])
    print("wrote " + ", ".join(results["files"]))
    return 0


def _prompt_tokens(args, vocab_size: int):
    import torch

    if (args.prompt is None) == (args.tokens is None):
        raise ValueError("give exactly one of --prompt TEXT (UTF-8 bytes, vocab >= 256) or --tokens ID,ID,...")
    if args.prompt is not None:
        if vocab_size < 256:
            raise ValueError(f"--prompt encodes UTF-8 bytes, but the model's vocab_size is {vocab_size} "
                             "(use --tokens with ids below it)")
        ids = list(args.prompt.encode("utf-8"))
    else:
        ids = args.tokens
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if not ids or bad:
        raise ValueError(f"--tokens must be non-empty ids in [0, {vocab_size}), got {bad or ids}")
    return torch.tensor([ids], dtype=torch.long)


def _cmd_generate(args) -> int:
    import torch

    from .quantize import quantize_model
    from .training.evaluate import load_run

    cfg, _, model, step = load_run(args.run, args.checkpoint, args.device)
    model.set_overrides(**_options(args.override, "--override"))
    quantize_model(model, args.quantize)
    prompt = _prompt_tokens(args, model.config.vocab_size).to(next(model.parameters()).device)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    out = model.generate(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         generator=gen)
    dt = time.perf_counter() - t0
    new = out[0, prompt.shape[1]:].tolist()
    print(f"{args.run} step {step}, pattern {model.config.pattern}, quantize {args.quantize}")
    print("prompt tokens:", ",".join(map(str, prompt[0].tolist())))
    print("generated:    ", ",".join(map(str, new)))
    if model.config.vocab_size == 256:
        print("as text:", repr(bytes(new).decode("utf-8", errors="replace")))
    print(f"{len(new)} tokens in {dt:.2f} s ({len(new) / max(dt, 1e-9):.1f} tokens/s, prefill included)")
    return 0


def _cmd_bench(args) -> int:
    from .bench import run_profile

    run_profile(args.profile, device=args.device, out_dir=args.out, only=args.only)
    return 0


def _name_list(allowed):
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}, got {text!r}")
        return values

    return parse


def _cmd_viz(args) -> int:
    from masks.viz import VizOptions, render

    from .viz import VizShape, method_program

    shape = VizShape(seq_len=args.seq_len, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                     seed=args.seed)
    options = _options(args.opt, "--opt")
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
    from .bench.profiler import ProfileConfig, profile_target
    from .devices import resolve_device

    cfg = ProfileConfig(target=args.target, seq_len=args.seq_len, batch=args.batch, heads=args.heads,
                        head_dim=args.head_dim, options=_options(args.opt, "--opt"), preset=args.preset,
                        pattern=args.pattern, modes=args.mode, steps=args.steps, warmup=args.warmup,
                        seed=args.seed, device=args.device)
    rows = profile_target(cfg, args.trace)
    what = f"model {cfg.preset} {cfg.pattern or ''}".rstrip() if cfg.target == "model" else f"layer {cfg.target}"
    print(f"{what}, x [{cfg.batch}, {cfg.seq_len}, ...], {cfg.steps} profiled steps per mode, "
          f"device {resolve_device(cfg.device)}")
    print(tabulate(rows, headers="keys", floatfmt=".3g", missingval="-"))
    print(f"wrote {args.trace} (open in chrome://tracing or https://ui.perfetto.dev)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ovqflex", description="compressed-memory attention as FlexAttention programs")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="torch, device, which backends work forward/backward here")
    s.add_argument("--device", default=AUTO, help=DEVICE_HELP)
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

    from .training.config import TrainConfig

    D = TrainConfig()  # the CLI's defaults are the config's (the README main job)
    s = sub.add_parser("train", help="train a hybrid model on a task (torch.compile, AdamW, checkpoints)")
    s.add_argument("--task", default="icr", help="icr, picr, icl, mqar, copy, niah or text (default: icr)")
    s.add_argument("--pattern", default=None, help="mixer pattern, e.g. swa,ovq (default: the preset's, swa,ovq)")
    s.add_argument("--preset", default="tiny", help="model preset: tiny, small, paper-icr (default: tiny)")
    s.add_argument("--steps", type=int, default=D.steps)
    s.add_argument("--seq-len", type=int, default=D.seq_len)
    s.add_argument("--batch-size", type=int, default=D.batch_size, help="global batch (split over torchrun ranks)")
    s.add_argument("--out", default=D.out, help="run directory (metrics.jsonl, checkpoints/)")
    s.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    s.add_argument("--resume-from", default=None, help="continue from this checkpoint directory")
    s.add_argument("--data", default=None, help="--task text: a text file (bytes) or .bin/.u16 uint16 tokens")
    s.add_argument("--task-opt", action="append", metavar="NAME=VALUE", help="task option (repeatable)")
    s.add_argument("--model-opt", action="append", metavar="NAME=VALUE", help="model config override (repeatable)")
    s.add_argument("--lr", type=float, default=D.lr)
    s.add_argument("--min-lr", type=float, default=D.min_lr)
    s.add_argument("--warmup", type=int, default=D.warmup)
    s.add_argument("--weight-decay", type=float, default=D.weight_decay)
    s.add_argument("--grad-clip", type=float, default=D.grad_clip)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--no-compile", action="store_true", help="run the model eagerly")
    s.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    s.add_argument("--device", default=AUTO, help=DEVICE_HELP)
    s.add_argument("--log-every", type=int, default=D.log_every)
    s.add_argument("--ckpt-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    s.add_argument("--keep", type=int, default=D.keep_checkpoints, help="checkpoints to keep")
    s.add_argument("--deterministic", action="store_true", help="deterministic algorithms (exact resume on GPU)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(fn=_cmd_train)

    s = sub.add_parser("eval", help="per-token accuracy of a trained run at several context lengths")
    s.add_argument("run", help="run directory written by ovqflex train")
    s.add_argument("--lengths", type=_int_list, default=None, help="comma-separated, e.g. 256,512,1024 "
                   "(default: the training length, x2, x4)")
    s.add_argument("--examples", type=int, default=64, help="examples per length")
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--override", action="append", metavar="NAME=VALUE",
                   help="test-time mixer override, e.g. max_centroids=4096 or backend=blocked (repeatable)")
    s.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: the run's latest)")
    s.add_argument("--device", default=AUTO, help=DEVICE_HELP)
    s.set_defaults(fn=_cmd_eval)

    from .experiments import EXPERIMENTS

    known = "; ".join(f"{e.name}: {e.description} (models {', '.join(e.labels)}; scales {', '.join(e.scales)})"
                      for e in EXPERIMENTS.values())
    s = sub.add_parser("experiment", help="train several hybrids on one task and seeds, evaluate them from the "
                       "training length to 16x it: one table, JSON and plot",
                       description=f"experiments: {known}. Writes OUT/experiment.json, OUT/<model>-s<seed>/ (train "
                       "runs and eval-<variant>.json), OUT/results.json, results.md and results.png.")
    s.add_argument("name", help=f"the experiment: {', '.join(sorted(EXPERIMENTS))}")
    s.add_argument("--scale", default="cpu", help="cpu (a 2-core CPU in about an hour), gpu (one GPU) or smoke "
                   "(a few steps: checks the pipeline) (default: cpu)")
    s.add_argument("--seeds", type=_seed_list, default=None, help="comma-separated, e.g. 0,1 (default: the "
                   "experiment's, 0,1)")
    s.add_argument("--models", type=_label_list, default=None, help="comma-separated model labels, e.g. "
                   "sw-ovq,sw-nope (default: all)")
    s.add_argument("--out", default=None, help="output directory (default: runs/experiments/NAME-SCALE)")
    s.add_argument("--device", default=AUTO, help=DEVICE_HELP)
    s.add_argument("--resume", action="store_true", help="continue the experiment in --out after a crash: "
                   "complete units are skipped, interrupted training resumes from its latest checkpoint")
    s.add_argument("--dry-run", action="store_true", help="print the plan (models, configs, units, token counts) "
                   "and exit without training")
    s.add_argument("--no-progress", action="store_true", help="no training progress bar")
    s.set_defaults(fn=_cmd_experiment)

    s = sub.add_parser("generate", help="continue a prompt with a trained run's model (prefill + cached decode)")
    s.add_argument("run", help="run directory written by ovqflex train")
    s.add_argument("--prompt", default=None, help="prompt text, encoded as UTF-8 bytes (byte-level models)")
    s.add_argument("--tokens", type=_id_list, default=None, help="prompt token ids, comma-separated")
    s.add_argument("--max-new-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--seed", type=int, default=0, help="sampling seed")
    s.add_argument("--quantize", default="none", choices=["none", "int8"],
                   help="int8: torchao int8 weight-only linears (CPU inference; pip install 'ovqflex[quant]')")
    s.add_argument("--override", action="append", metavar="NAME=VALUE",
                   help="test-time mixer override, e.g. max_centroids=4096 (repeatable)")
    s.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: the run's latest)")
    s.add_argument("--device", default=AUTO, help=DEVICE_HELP)
    s.set_defaults(fn=_cmd_generate)

    s = sub.add_parser("bench", help="run a benchmark profile (TOML) and print its table")
    s.add_argument("profile", help="path to a profile, e.g. profiles/blockmask.toml")
    s.add_argument("--device", default=AUTO, help=DEVICE_HELP)
    s.add_argument("--out", default="bench-out", help="directory for the JSON results (default: bench-out)")
    s.add_argument("--only", default=None, help="run only scenarios whose name contains this string")
    s.set_defaults(fn=_cmd_bench)

    from masks.viz import FORMATS, MAX_TOKEN_CELLS, VIEWS

    from .methods import method_names
    from .viz import drawable_methods

    s = sub.add_parser("viz", help="draw the attention program of a layer: token, block and per-query views")
    s.add_argument("method", help=f"one of {', '.join(drawable_methods())}")
    s.add_argument("--seq-len", type=int, default=512, help="tokens T (default 512)")
    s.add_argument("--heads", type=int, default=1)
    s.add_argument("--head-dim", type=int, default=16)
    s.add_argument("--batch", type=int, default=1, help="batch size of the random input")
    s.add_argument("--seed", type=int, default=0, help="seed of the layer init and the input")
    s.add_argument("--opt", action="append", metavar="NAME=VALUE",
                   help="layer option, e.g. max_centroids=256, chunk_size=64, window=64 (repeatable)")
    s.add_argument("--view", type=_name_list(VIEWS), default=VIEWS,
                   help="comma-separated views: token,block (default both; token only if small enough)")
    s.add_argument("--format", type=_name_list(FORMATS), default=("png", "html", "term"),
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

    from .profiling import MODES  # (not ovqflex.bench: the CLI stays light for `train`)

    s = sub.add_parser("profile", help="run a layer or model step under torch.profiler: stage table + trace")
    s.add_argument("target", help=f"'model' or a layer: one of {', '.join(method_names())}")
    s.add_argument("--seq-len", type=int, default=1024)
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--heads", type=int, default=4, help="layer targets: heads")
    s.add_argument("--head-dim", type=int, default=32, help="layer targets: head dim")
    s.add_argument("--opt", action="append", metavar="NAME=VALUE",
                   help="layer option (e.g. backend=blocked, max_centroids=512) or model config override")
    s.add_argument("--preset", default="tiny", help="model target: preset (default tiny)")
    s.add_argument("--pattern", default=None, help="model target: mixer pattern, e.g. swa,ovq")
    s.add_argument("--mode", type=_name_list(MODES), default=MODES,
                   help="comma-separated: fwd (no grad), fwd+bwd (default both)")
    s.add_argument("--steps", type=int, default=2, help="profiled steps per mode")
    s.add_argument("--warmup", type=int, default=1, help="unprofiled steps per mode first (compilation)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", default=AUTO, help=DEVICE_HELP)
    s.add_argument("--trace", default="profile-trace.json", help="Chrome/Perfetto trace file to write")
    s.set_defaults(fn=_cmd_profile)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError, ImportError) as e:
        print(f"ovqflex {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
