"""Training scenario: throughput of whole models, one row per mixer pattern."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...compile_watch import CompileWatch
from ..measure import measure, progress
from .base import ZERO_MEANS_DEFAULT, Scenario, register


@dataclass(kw_only=True)
class TrainScenario(Scenario):
    patterns: list[str]          # the first is the baseline of x_vs_baseline
    seq_len: int
    preset: str = "tiny"
    batch_size: int = 8
    task: str = "icr"
    task_options: dict = field(default_factory=dict)
    model_options: dict = field(default_factory=dict)
    steps: int = 10              # timed steps
    warmup_steps: int = field(default=3, metadata=ZERO_MEANS_DEFAULT)  # untimed, include compile (the first step always is)
    compile: bool = True

    def __post_init__(self):
        from ...training.setup import build_task, model_config

        for pattern in self.patterns:  # its task, at its length, and its model's config, by name
            cfg = self.train_config(pattern)
            model_config(cfg, build_task(cfg))

    def train_config(self, pattern: str):
        """The :class:`~ovqflex.training.TrainConfig` of the row of ``pattern``."""
        from ...training import TrainConfig

        return TrainConfig(task=self.task, preset=self.preset, pattern=pattern, seq_len=self.seq_len,
                           batch_size=self.batch_size, compile=self.compile, model_options=dict(self.model_options),
                           task_options=dict(self.task_options))


@register("train", TrainScenario)
def train(sc: TrainScenario, device: str) -> list[dict]:
    """Training throughput of whole models: ``torch.compile(model)`` AdamW steps on a task's
    batches, for each mixer ``patterns`` entry, with what compiling did (:class:`CompileWatch`): the
    graphs its first step compiled (``graphs_first_step``), the graph breaks met and the recompiles
    over all its steps, which all have one shape (expected: 0 and 0)."""
    import time

    from ...devices import to_device
    from ...tasks import make_batch
    from ...training.setup import autocast_dtype, build_model, build_optimizer, build_task
    from ...training.trainer import forward_loss

    dev = torch.device(device)
    steps, warm = sc.steps, sc.warmup_steps
    rows = []
    for pattern in sc.patterns:
        cfg = sc.train_config(pattern)
        torch.manual_seed(0)
        task = build_task(cfg)
        model = build_model(cfg, task).to(dev)
        opt = build_optimizer(model, cfg)
        fwd = torch.compile(model) if cfg.compile else model
        amp = autocast_dtype(cfg, dev)

        def step(i):
            x, y = make_batch(task, seed=0, step=i, start=0, count=cfg.batch_size, seq_len=cfg.seq_len)
            x, y = to_device(dev, x, y)
            forward_loss(fwd, x, y, amp)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        with CompileWatch() as watch:
            def watched(i):
                step(i)
                for note in watch.step(i + 1, (cfg.batch_size, cfg.seq_len)):
                    progress(f"train {pattern}: warning: {note}")

            t0 = time.perf_counter()
            watched(0)
            first = time.perf_counter() - t0
            for i in range(1, warm):
                watched(i)
            m = measure(lambda: [watched(warm + i) for i in range(steps)], device=dev, repeats=1, warmup=0)
        compiled = watch.counts()
        rows.append({"pattern": pattern, "T": cfg.seq_len, "batch": cfg.batch_size,
                     "params_m": model.num_parameters() / 1e6, "first_step_s": first,
                     "step_s": m.seconds / steps, "tokens_per_s": steps * cfg.batch_size * cfg.seq_len / m.seconds,
                     "peak_mb": m.peak_mb, "graphs_first_step": watch.first_graphs,
                     "graph_breaks": compiled["graph_breaks"], "recompiles": compiled["recompiles"]})
        progress(f"train {pattern} (first step {first:.1f} s, {rows[-1]['tokens_per_s']:,.0f} tokens/s; "
                 f"{watch.summary()})", m.seconds / steps)
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["x_vs_baseline"] = r["tokens_per_s"] / base
    return rows
