"""Commands on training runs: ``train``, ``eval``, ``probe``, ``experiment``, ``generate``."""
from __future__ import annotations

import os
import time
from pathlib import Path

from tabulate import tabulate

from ..models.hybrid import DECODES
from .flags import (add_config_flags, add_device, comma_list, config_from_args, id_list, int_list, label_list,
                    parse_options, seed_list)

#: the help of eval's, probe's and generate's --checkpoint (:func:`ovqflex.training.checkpoint.run_checkpoint`)
CHECKPOINT_HELP = "one of the run's checkpoints, by directory or name (step_00004000); default: its latest"


def _cmd_train(args) -> int:
    """Train a model on the config the flags make (or resume one)."""
    from ..training import TrainConfig, train

    cfg = config_from_args(TrainConfig, args)
    result = train(cfg, resume=args.resume, resume_from=args.resume_from, stop_after=args.stop_after)
    if result.loss is not None and int(os.environ.get("RANK", "0")) == 0:
        of = f" of {cfg.steps} (--stop-after; --resume continues)" if result.step < cfg.steps else ""
        print(f"trained {result.step} steps{of} -> {result.out}: {result.describe()}")
    return 0


def _cmd_eval(args) -> int:
    """Evaluate a run at several context lengths; print the table, write ``<name>.json`` / ``.png``
    (default name: ``eval``, or one naming the overrides)."""
    from ..training import evaluate
    from ..training.evaluate import report_name

    def show(row):
        print(f"  length {row.length:>7}: accuracy {row.accuracy:.4f}  ({row.seconds:.1f} s)", flush=True)

    overrides = parse_options(args.override, "--override")
    name = args.name or report_name(overrides)
    doc = evaluate(args.run, args.lengths, n_examples=args.examples, batch_size=args.batch_size,
                   overrides=overrides, checkpoint=args.checkpoint, device=args.device, progress=show, name=name)
    over = ", ".join(f"{k}={v}" for k, v in doc["overrides"].items()) or "none"
    print(f"\n{doc['task']} ({doc['task_description']}), pattern {doc['pattern']}, step {doc['step']}, "
          f"trained at {doc['train_seq_len']} tokens, overrides: {over}")
    # numbers, formatted per column (tabulate would parse strings such as "0.7500" and print them as 0.75)
    print(tabulate([(r["length"], r["accuracy"], r["loss"], r["targets"], r["seconds"]) for r in doc["rows"]],
                   headers=["length", "accuracy", "loss", "targets", "seconds"],
                   floatfmt=("", ".4f", ".4f", "", ".1f")))
    png = f" and {name}.png" if doc.get("plot") else " (no plot: matplotlib is not installed)"
    print(f"wrote {Path(args.run) / name}.json{png}")
    return 0


def _cmd_probe(args) -> int:
    """Print where each attention layer of an icr run looks when it recalls."""
    from ..training.probe import probe_run

    doc = probe_run(args.run, args.length, n_examples=args.examples, batch_size=args.batch_size,
                    checkpoint=args.checkpoint, device=args.device)
    print(f"{doc['run']} step {doc['step']}, pattern {doc['pattern']}, {doc['length']} tokens: {doc['queries']} "
          f"queries, accuracy {doc['accuracy']:.4f} on their first value token")
    rows = [(h["layer"], h["mixer"], h["head"], h["pair_weight"], h["pair_weight_q10"],
             "  ".join(f"{o:+d}: {share:.0%}" for o, share in h["offsets"])) for h in doc["heads"]]
    print(tabulate(rows, headers=["layer", "mixer", "head", "weight on pair", "10th pct", "most-weighted token "
                                  "(offset from the key: share of queries)"], floatfmt=".3f"))
    for layer, mixer in doc["not_probed"]:
        print(f"layer {layer} ({mixer}): not probed")
    return 0


def _cmd_experiment(args) -> int:
    """Plan an experiment and print the plan (``--dry-run``) or run it and print its table."""
    from ..experiments import get_experiment, plan, run_experiment
    from ..experiments.report import trained

    exp = get_experiment(args.name)
    out = args.out or f"runs/experiments/{exp.name}-{args.scale}"
    p = plan(exp, args.scale, out, seeds=args.seeds, models=args.models, steps=args.steps, device=args.device,
             progress=not args.no_progress)
    if args.dry_run:
        print(p.describe())
        return 0
    results = run_experiment(p, resume=args.resume, log=lambda line: print(line, flush=True), jobs=args.jobs,
                             drop_checkpoints=args.drop_checkpoints)
    print(f"\n{results['experiment']} ({results['scale']} scale): {results['task_description']}; "
          f"{trained(results)}; accuracy, mean over seeds (min-max)")
    print(results["table"])
    print("wrote " + ", ".join(results["files"]))
    return 0


def _cmd_pilot(args) -> int:
    """Train the first steps of an experiment's runs at several learning rates; print the table."""
    from ..experiments import get_experiment, plan
    from ..experiments.pilot import lr_pilot

    exp = get_experiment(args.name)
    out = args.out or f"runs/experiments/{exp.name}-{args.scale}-pilot"
    p = plan(exp, args.scale, out, seeds=args.seeds or exp.seeds[:1], models=args.models, steps=args.steps,
             device=args.device, progress=False)
    lr_pilot(p, args.lrs, args.stop_after, out=out, log=lambda line: print(line, flush=True),
             keep_checkpoints=args.keep_checkpoints)
    print(f"wrote {Path(out) / 'pilot.md'} and pilot.json")
    return 0


def _prompt_tokens(args, vocab_size: int):
    """The prompt ``[1, n]`` of ``--prompt`` (UTF-8 bytes) or ``--tokens``, checked against the vocab."""
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
    """Continue a prompt with a run's model; print the tokens and the rate."""
    import torch

    from ..quantize import quantize_model
    from ..training.evaluate import load_run

    cfg, _, model, step = load_run(args.run, args.checkpoint, args.device)
    model.set_overrides(**parse_options(args.override, "--override"))
    quantize_model(model, args.quantize)
    prompt = _prompt_tokens(args, model.config.vocab_size).to(next(model.parameters()).device)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    out = model.generate(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                         generator=gen, decode=args.decode)
    dt = time.perf_counter() - t0
    new = out[0, prompt.shape[1]:].tolist()
    print(f"{args.run} step {step}, pattern {model.config.pattern}, quantize {args.quantize}, decode {args.decode}")
    print("prompt tokens:", ",".join(map(str, prompt[0].tolist())))
    print("generated:    ", ",".join(map(str, new)))
    if model.config.vocab_size == 256:
        print("as text:", repr(bytes(new).decode("utf-8", errors="replace")))
    print(f"{len(new)} tokens in {dt:.2f} s ({len(new) / max(dt, 1e-9):.1f} tokens/s, prefill"
          f"{' and compile' if args.decode in ('compiled', 'graph') else ''} included)")
    return 0


def add_train(sub) -> None:
    """The ``train`` command under the subparsers ``sub``: a flag per :class:`TrainConfig` field, and
    ``--resume``, ``--resume-from``, ``--stop-after``."""
    from ..training.config import TrainConfig

    s = sub.add_parser("train", help="train a hybrid model on a task (torch.compile, AdamW, checkpoints)")
    add_config_flags(s, TrainConfig)  # every TrainConfig field, its default and help
    s.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    s.add_argument("--resume-from", default=None, help="continue from this checkpoint directory")
    s.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="stop with a checkpoint once the run has done STEP of its --steps steps (its learning-rate "
                        "and length schedules stay the whole run's); --resume continues it")
    s.set_defaults(fn=_cmd_train)


def add_eval(sub) -> None:
    """The ``eval`` command under the subparsers ``sub``."""
    s = sub.add_parser("eval", help="per-token accuracy of a trained run at several context lengths")
    s.add_argument("run", help="run directory written by ovqflex train")
    s.add_argument("--lengths", type=int_list, default=None, help="comma-separated, e.g. 256,512,1024 "
                   "(default: the training length, x2, x4)")
    s.add_argument("--examples", type=int, default=64, help="examples per length")
    s.add_argument("--batch-size", type=int, default=8)
    s.add_argument("--override", action="append", metavar="NAME=VALUE",
                   help="test-time mixer override, e.g. max_centroids=4096 or backend=blocked (repeatable)")
    s.add_argument("--checkpoint", default=None, help=CHECKPOINT_HELP)
    s.add_argument("--name", default=None, help="report file stem in the run directory (default: eval, or with "
                   "overrides e.g. eval-max_centroids-4096, so evaluations with other overrides keep their reports)")
    add_device(s)
    s.set_defaults(fn=_cmd_eval)


def add_probe(sub) -> None:
    """The ``probe`` command under the subparsers ``sub``."""
    s = sub.add_parser("probe", help="where each attention layer of an icr run looks when it recalls "
                       "(weight on the queried key/value pair, offset of the most-weighted token)")
    s.add_argument("run", help="run directory written by ovqflex train (task icr)")
    s.add_argument("--length", type=int, default=None, help="context length (default: the training length)")
    s.add_argument("--examples", type=int, default=64, help="examples (those ovqflex eval measures at this length)")
    s.add_argument("--batch-size", type=int, default=16)
    s.add_argument("--checkpoint", default=None, help=CHECKPOINT_HELP)
    add_device(s)
    s.set_defaults(fn=_cmd_probe)


def add_experiment(sub) -> None:
    """The ``experiment`` command under the subparsers ``sub``."""
    from ..experiments import EXPERIMENTS

    known = "; ".join(f"{e.name}: {e.description} (models {', '.join(e.labels)}; scales {', '.join(e.scales)})"
                      for e in EXPERIMENTS.values())
    s = sub.add_parser("experiment", help="train several hybrids on one task and seeds, evaluate them from the "
                       "training length to 16x it: one table, JSON and plot",
                       description=f"experiments: {known}. Writes OUT/experiment.json, OUT/<model>-s<seed>/ (train "
                       "runs and eval-<variant>.json), OUT/results.json, results.md and results.png.")
    s.add_argument("name", help=f"the experiment: {', '.join(sorted(EXPERIMENTS))}")
    s.add_argument("--scale", default="cpu", help="cpu (a 2-core CPU in about an hour), gpu (one GPU) or smoke "
                   "(a few steps: checks the pipeline) (default: cpu)")
    s.add_argument("--seeds", type=seed_list, default=None, help="comma-separated, e.g. 0,1 (default: the "
                   "experiment's, 0,1)")
    s.add_argument("--models", type=label_list, default=None, help="comma-separated model labels, e.g. "
                   "sw-ovq,sw-nope (default: all)")
    s.add_argument("--steps", type=int, default=None, help="training steps per run instead of the scale's (its "
                   "warmup and checkpoint interval kept); experiment.json records them, so --resume must give the "
                   "same (default: the scale's)")
    s.add_argument("--out", default=None, help="output directory (default: runs/experiments/NAME-SCALE)")
    add_device(s)
    s.add_argument("--resume", action="store_true", help="continue the experiment in --out after a crash: "
                   "complete units are skipped, interrupted training resumes from its latest checkpoint; "
                   "with more --seeds or --models than the directory holds, adds them (and the test-time "
                   "evaluations a newer version of the experiment has)")
    s.add_argument("--dry-run", action="store_true", help="print the plan (models, configs, units, token counts) "
                   "and exit without training")
    s.add_argument("--no-progress", action="store_true", help="no training progress bar")
    s.add_argument("--drop-checkpoints", action="store_true", help="delete a run's checkpoints once all its "
                   "evaluations are written (and those of runs already complete): OUT keeps the reports, metrics "
                   "and configs alone, small enough to copy between machines; such a run cannot be trained "
                   "further or evaluated anew")
    s.add_argument("--jobs", type=int, default=1, help="runs (a model at a seed: training, then its evaluations) "
                   "in progress at once, each in a process of its own with the CPU threads / JOBS; for a GPU that "
                   "one small model leaves idle. Progress: a line per minute with each run's step, loss and "
                   "tokens/s (default: 1, in this process)")
    s.set_defaults(fn=_cmd_experiment)


def add_pilot(sub) -> None:
    """The ``pilot`` command under the subparsers ``sub``."""
    from ..experiments import EXPERIMENTS

    s = sub.add_parser("pilot", help="the first steps of an experiment's runs at several learning rates: which "
                       "one learns (one table)",
                       description="Trains each run of the plan (ovqflex experiment NAME with --scale, --models, "
                       "--seeds, --steps) at each --lrs for its first --stop-after steps, under the whole run's "
                       "schedules, into OUT/<model>-s<seed>-lr<lr>/; writes OUT/pilot.md and pilot.json: training "
                       "accuracy along the way, the step it reached 0.5, tokens/s.")
    s.add_argument("name", help=f"the experiment: {', '.join(sorted(EXPERIMENTS))}")
    s.add_argument("--scale", default="cpu", help="the experiment's scale (default: cpu)")
    s.add_argument("--models", type=label_list, default=None, help="comma-separated model labels (default: all)")
    s.add_argument("--seeds", type=seed_list, default=None, help="comma-separated (default: the experiment's "
                   "first)")
    s.add_argument("--steps", type=int, default=None, help="the runs' steps instead of the scale's: their "
                   "schedules' length (default: the scale's)")
    s.add_argument("--lrs", type=comma_list(float), required=True, help="comma-separated peak learning rates, "
                   "e.g. 1e-3,3e-3")
    s.add_argument("--stop-after", type=int, required=True, metavar="STEP", help="steps of each pilot run")
    s.add_argument("--out", default=None, help="output directory (default: runs/experiments/NAME-SCALE-pilot)")
    s.add_argument("--keep-checkpoints", action="store_true", help="keep each pilot run's checkpoint (ovqflex "
                   "train --resume with its config continues that run)")
    add_device(s)
    s.set_defaults(fn=_cmd_pilot)


def add_generate(sub) -> None:
    """The ``generate`` command under the subparsers ``sub``."""
    s = sub.add_parser("generate", help="continue a prompt with a trained run's model (prefill + cached decode)")
    s.add_argument("run", help="run directory written by ovqflex train")
    s.add_argument("--prompt", default=None, help="prompt text, encoded as UTF-8 bytes (byte-level models)")
    s.add_argument("--tokens", type=id_list, default=None, help="prompt token ids, comma-separated")
    s.add_argument("--max-new-tokens", type=int, default=32)
    s.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--seed", type=int, default=0, help="sampling seed")
    s.add_argument("--quantize", default="none", choices=["none", "int8"],
                   help="int8: torchao int8 weight-only linears (CPU inference; pip install 'ovqflex[quant]')")
    s.add_argument("--override", action="append", metavar="NAME=VALUE",
                   help="test-time mixer override, e.g. max_centroids=4096 (repeatable)")
    s.add_argument("--decode", default="functional", choices=list(DECODES),
                   help="the decode path (HybridLM.generate): functional caches, or the in-place static caches "
                        "eager, compiled, or compiled and replayed from a CUDA graph (CUDA only)")
    s.add_argument("--checkpoint", default=None, help=CHECKPOINT_HELP)
    add_device(s)
    s.set_defaults(fn=_cmd_generate)
