"""An experiment's results: accuracy per line (a model, or a test-time variant of it) per
evaluation length, as the mean and min–max over seeds, from the runs' ``eval-<variant>.json``
reports. :func:`write_results` writes them to ``OUT/results.json``, ``OUT/results.md`` (a
tabulate table) and ``OUT/results.png`` (accuracy vs length, log x, one line per model or
variant with its min–max band; test-time variants dashed).

Only complete reports count (the planned lengths, examples, overrides and final step); a
line with fewer seeds than planned says so in its ``seeds`` column, with the seeds whose runs
diverged (``diverged``: seed -> the step after which training stopped).
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

from tabulate import tabulate

from ..files import write_atomic
from ..training import diverged_step
from ..training.schedule import length_warmup_text
from .plan import Plan, Run, Variant


def read_eval(plan: Plan, run: Run, variant: Variant) -> dict | None:
    """The report of ``run`` evaluated as ``variant`` if it is complete, else ``None``."""
    path = run.dir / f"eval-{variant.name}.json"
    try:
        doc = json.loads(path.read_text())
        rows = doc["rows"]
        ok = ([r["length"] for r in rows] == plan.lengths
              and all(r["examples"] == plan.scale.eval_examples for r in rows)
              and doc["overrides"] == json.loads(json.dumps(plan.eval_overrides(variant)))
              and doc["step"] == run.train.steps)
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None
    return doc if ok else None


def summarize(by_seed: dict[int, float]) -> dict:
    """``{seed: accuracy}`` -> ``{"mean", "min", "max", "n", "seeds"}`` (``None`` statistics when empty)."""
    values = list(by_seed.values())
    if not values:
        return {"mean": None, "min": None, "max": None, "n": 0, "seeds": {}}
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "n": len(values),
            "seeds": {str(s): a for s, a in sorted(by_seed.items())}}


def collect(plan: Plan) -> dict:
    """The results of ``plan`` from the reports on disk (see the module docstring)."""
    lines = []
    for model in plan.models:
        runs = [r for r in plan.runs if r.model is model]
        diverged = {str(r.seed): step for r in runs if (step := diverged_step(r.dir)) is not None}
        for variant in runs[0].variants:
            acc: dict[int, dict[int, float]] = {}
            for run in runs:
                doc = read_eval(plan, run, variant)
                if doc is not None:
                    acc[run.seed] = {r["length"]: r["accuracy"] for r in doc["rows"]}
            points = [{"length": n, **summarize({s: a[n] for s, a in acc.items()})} for n in plan.lengths]
            lines.append({"label": variant.label, "model": model.label, "pattern": model.pattern,
                          "variant": variant.name, "overrides": plan.eval_overrides(variant), "seeds": len(acc),
                          "diverged": diverged, "points": points})
    return {"experiment": plan.experiment.name, "scale": plan.scale_name, "task": plan.experiment.task,
            "task_description": plan.task.describe(), "train_seq_len": plan.scale.seq_len,
            "train_steps": plan.scale.steps, "train_batch_size": plan.scale.batch_size,
            "train_length_warmup": list(plan.runs[0].train.length_warmup),
            "train_length_warmup_steps": plan.runs[0].train.length_warmup_steps, "lengths": plan.lengths,
            "seeds": list(plan.seeds), "lines": lines}


def _cell(p: dict) -> str:
    if p["n"] == 0:
        return "-"
    if p["n"] == 1 or p["min"] == p["max"]:
        return f"{p['mean']:.3f}"
    return f"{p['mean']:.3f} ({p['min']:.2f}–{p['max']:.2f})"


def _diverged(line: dict) -> str:
    """``", 1 diverged"`` for a line with a seed whose run diverged ("" otherwise; results written
    before divergence was recorded have no ``diverged``)."""
    n = len(line.get("diverged", {}))
    return f", {n} diverged" if n else ""


def table(results: dict, tablefmt: str = "simple") -> str:
    """One row per line, one column per length: mean accuracy over seeds (min–max)."""
    headers = ["model", "seeds"] + [f"{n:,}" for n in results["lengths"]]
    rows = [[line["label"], f"{line['seeds']}/{len(results['seeds'])}{_diverged(line)}"]
            + [_cell(p) for p in line["points"]] for line in results["lines"]]
    return tabulate(rows, headers=headers, tablefmt=tablefmt, disable_numparse=True)


def plot(results: dict, path: Path) -> Path | None:
    """Accuracy vs length (log x): mean over seeds, min–max band; ``None`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    models = list(dict.fromkeys(line["model"] for line in results["lines"]))
    variant_styles = ["--", ":", "-."]
    for line in results["lines"]:
        pts = [p for p in line["points"] if p["n"]]
        if not pts and not _diverged(line):
            continue
        x = [p["length"] for p in pts]
        # a model's colour; its test-time variants in the same colour, dashed / dotted
        siblings = [ln["variant"] for ln in results["lines"] if ln["model"] == line["model"] and ln["variant"] != "base"]
        style = "-" if line["variant"] == "base" else variant_styles[siblings.index(line["variant"]) % 3]
        color = colors[models.index(line["model"]) % len(colors)]
        # a line whose every run diverged has no points but keeps its legend entry, which says so
        ax.plot(x, [p["mean"] for p in pts], style, marker="o", ms=3.5, color=color,
                label=f"{line['label']} ({line['seeds']} seed{'s' if line['seeds'] != 1 else ''}{_diverged(line)})")
        ax.fill_between(x, [p["min"] for p in pts], [p["max"] for p in pts], color=color,
                        alpha=0.15 if line["variant"] == "base" else 0.07, lw=0)
    train = results["train_seq_len"]
    ax.axvline(train, color="grey", ls=":", lw=1, label=f"train length {train:,}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(results["lengths"], [f"{n:,}" for n in results["lengths"]])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("per-token accuracy (mean, min–max over seeds)")
    title = f"{results['experiment']} ({results['scale']} scale): {results['task_description']}"
    ax.set_title(textwrap.fill(title, 120), fontsize=7)  # a long task description wraps, not clipped
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def trained(results: dict) -> str:
    """How the models were trained, e.g. ``trained at 64 tokens, 2,000 steps of 32 sequences`` (with
    a length warm-up: ``trained at 2,048 tokens (first 256, 512 tokens over 1,000 steps), ...``)."""
    warmup = length_warmup_text(tuple(results.get("train_length_warmup", ())),
                                results.get("train_length_warmup_steps", 0))
    return (f"trained at {results['train_seq_len']:,} tokens{warmup}, {results['train_steps']:,} steps of "
            f"{results['train_batch_size']} sequences")


def write_results(plan: Plan) -> dict:
    """Collect the results of ``plan`` and write ``results.json``, ``results.md`` and
    ``results.png`` (when matplotlib is installed) into ``plan.out``; returns the results
    with ``"table"`` (the printed table) and ``"files"`` (paths written)."""
    results = collect(plan)
    out = plan.out
    write_atomic(out / "results.json", json.dumps(results, indent=1))
    md = (f"# {results['experiment']} ({results['scale']} scale)\n\n{results['task_description']}; "
          f"{trained(results)}. Per-token accuracy on the target tokens, mean over seeds "
          f"(min–max).\n\n{table(results, 'github')}\n")
    write_atomic(out / "results.md", md)
    files = [out / "results.json", out / "results.md"]
    png = plot(results, out / "results.png")
    if png is not None:
        files.append(png)
    return {**results, "table": table(results), "files": [str(f) for f in files]}
