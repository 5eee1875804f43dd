"""``evaluate(run_dir, lengths)``: per-token accuracy on the target positions at several
context lengths (length extrapolation), with optional test-time overrides (e.g. OVQ
``max_centroids``). Writes ``eval.json`` and ``eval.png`` into the run directory (``name=`` picks
another stem, e.g. one per test-time variant; ``ovqflex eval`` names them by their overrides,
:func:`report_name`).

Evaluation examples come from a stream disjoint from training (seed offset), so the
numbers are on unseen sequences.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..devices import resolve_device, to_device
from ..files import write_atomic
from ..tasks import IGNORE, make_batch
from .checkpoint import load_checkpoint, run_checkpoint
from .setup import build_task, check_lengths, model_from_checkpoint, train_config_of
from .trainer import forward_loss

EVAL_SEED_OFFSET = 1_000_003  # eval examples: seed + offset, so never a training example


@dataclass
class EvalRow:
    length: int
    accuracy: float
    loss: float
    targets: int
    examples: int
    seconds: float


def load_run(run_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None, device: str = "auto"):
    """(TrainConfig, task, model in eval mode, checkpoint step) of a trained run; the model is
    rebuilt from the checkpoint's model_config, checked against its train_config."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    path = run_checkpoint(run_dir, checkpoint)
    dev = resolve_device(device)
    ckpt = load_checkpoint(path, map_location=dev)
    cfg = train_config_of(ckpt)
    task = build_task(cfg)
    model = model_from_checkpoint(ckpt, cfg, task).to(dev)
    model.eval()
    return cfg, task, model, ckpt.step


def check_counts(n_examples: object, batch_size: object) -> None:
    """Refuse, before any model work, an example count or batch size that is not an int >= 1."""
    for arg, value in (("n_examples", n_examples), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg} must be an int >= 1, got {value!r}")


def eval_batches(task, length: int, *, n_examples: int, batch_size: int, seed: int):
    """The batches ``(x, y)`` ``[count, length]`` of the ``n_examples`` unseen examples measured at
    ``length`` (drawn from ``seed + EVAL_SEED_OFFSET``, so never a training example)."""
    for start in range(0, n_examples, batch_size):
        count = min(batch_size, n_examples - start)
        yield make_batch(task, seed=seed + EVAL_SEED_OFFSET, step=length, start=start, count=count, seq_len=length)


@torch.no_grad()
def evaluate_model(model, task, lengths: list[int], *, n_examples: int, batch_size: int, seed: int,
                   device: torch.device, progress=None) -> list[EvalRow]:
    """Per-token accuracy of ``model`` on ``task.evaluation()`` (training-only options such as
    ICR's ``min_pairs`` dropped) at each length, on unseen examples."""
    task = task.evaluation()
    check_lengths(task, lengths)
    rows = []
    for length in lengths:
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # correct, targets, loss: read once per length
        t0 = time.perf_counter()
        for x, y in eval_batches(task, length, n_examples=n_examples, batch_size=batch_size, seed=seed):
            x, y = to_device(device, x, y)
            logits, batch_loss = forward_loss(model, x, y, None)
            target = y != IGNORE
            sums += torch.stack([((logits.argmax(-1) == y) & target).sum().double(), target.sum().double(),
                                 batch_loss.double()])
        correct, total, loss_sum = sums.tolist()
        total = int(total)
        rows.append(EvalRow(length, int(correct) / max(total, 1), loss_sum / max(total, 1), total, n_examples,
                            time.perf_counter() - t0))
        if progress is not None:
            progress(rows[-1])
    return rows


def parse_overrides(items: list[str]) -> dict:
    """``["max_centroids=4096", "backend=blocked"]`` -> ``{"max_centroids": 4096, "backend": "blocked"}``."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override must look like NAME=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _stem_char(c: str) -> bool:
    """A character a report stem may hold: a letter, a digit, ``-``, ``_`` or ``.``."""
    return c.isalnum() or c in "-_."


def report_name(overrides: dict | None) -> str:
    """The report stem ``ovqflex eval`` writes for ``overrides``, so evaluations with different
    overrides keep their own files: ``eval`` without, else e.g. ``eval-max_centroids-4096`` (keys in
    the given order; characters other than letters, digits, ``-``, ``_``, ``.`` become ``_``)."""
    parts = [f"{k}-{v}" for k, v in (overrides or {}).items()]
    stem = "-".join(["eval", *parts])
    return "".join(c if _stem_char(c) else "_" for c in stem)


def write_report(run_dir: Path, doc: dict, name: str = "eval") -> tuple[Path, Path | None]:
    """``<name>.json`` (atomic) and, when matplotlib is installed, ``<name>.png``."""
    path = run_dir / f"{name}.json"
    write_atomic(path, json.dumps(doc, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return path, None
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(5.5, 3.5), dpi=120)
    ax.plot([r["length"] for r in rows], [r["accuracy"] for r in rows], marker="o")
    ax.axvline(doc["train_seq_len"], color="grey", ls="--", lw=1, label=f"train length {doc['train_seq_len']}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("per-token accuracy")
    over = ", ".join(f"{k}={v}" for k, v in doc["overrides"].items())
    ax.set_title(f"{doc['task']} · {doc['pattern']}" + (f" · {over}" if over else ""), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = run_dir / f"{name}.png"
    fig.savefig(png)
    plt.close(fig)
    return path, png


def evaluate(run_dir: str | os.PathLike, lengths: list[int] | None = None, *, n_examples: int = 64, batch_size: int = 8,
             overrides: dict | None = None, checkpoint: str | None = None, device: str = "auto",
             progress=None, name: str = "eval") -> dict:
    """Evaluate the run in ``run_dir`` at ``lengths`` (default: 1x, 2x, 4x its training length);
    returns the report dict and writes it to ``run_dir/<name>.json`` and ``<name>.png``."""
    if not name or not all(map(_stem_char, name)):
        raise ValueError(f"name must be a non-empty file stem of letters, digits, '-', '_' or '.', got {name!r}")
    if lengths is not None and not lengths:
        raise ValueError("lengths must name at least one context length")
    check_counts(n_examples, batch_size)
    run_dir = Path(run_dir)
    cfg, task, model, step = load_run(run_dir, checkpoint, device)
    lengths = lengths or [cfg.seq_len, 2 * cfg.seq_len, 4 * cfg.seq_len]
    overrides = dict(overrides or {})
    if overrides:
        model.set_overrides(**overrides)
    dev = next(model.parameters()).device
    rows = evaluate_model(model, task, sorted(set(lengths)), n_examples=n_examples, batch_size=batch_size,
                          seed=cfg.seed, device=dev, progress=progress)
    doc = {"task": cfg.task, "task_description": task.evaluation().describe(), "pattern": model.config.pattern,
           "preset": cfg.preset, "step": step, "train_seq_len": cfg.seq_len, "overrides": overrides,
           "rows": [asdict(r) for r in rows]}
    _, png = write_report(run_dir, doc, name)
    doc["plot"] = None if png is None else str(png)
    return doc
