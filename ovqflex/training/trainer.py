"""``train(cfg)``: the training loop behind ``ovqflex train``.

Per step: the step's batch slice for this rank (a pure function of seed and step; with a length
warm-up, shorter sequences and more of them for the first steps, :func:`.schedule.length_at`) ─▶
compiled model forward (bf16 autocast where supported) ─▶ cross-entropy summed over the
target tokens / global target count ─▶ backward ─▶ gradient all-reduce (torchrun) ─▶
clip ─▶ AdamW at the scheduled lr. Metrics go to ``DIR/metrics.jsonl`` every
``log_every`` steps; checkpoints every ``ckpt_every`` steps and at the end. SIGINT or SIGTERM
stops the run after the step in flight with a checkpoint of it (:mod:`.interrupt`). A compiled run
watches what ``torch.compile`` does (:class:`~ovqflex.compile_watch.CompileWatch`): a graph break, a
recompile at a shape an earlier step ran, or dynamo giving up at its recompile limit is a warning on
stderr when it happens, and the totals end the run's result (``TrainResult.compiled``).

A run that diverges stops (:class:`TrainingDiverged`) rather than train on and checkpoint non-finite
weights, which would rotate its good checkpoints out: the loss is checked where it is read anyway
(every logged step) and the weights before every checkpoint (one host sync per checkpoint). It
leaves ``DIR/diverged.json`` (step and message, :func:`diverged_step` reads it), which the next
``train`` on the directory removes.

The run directory has one writer: rank 0 holds ``DIR/run.lock`` (:mod:`.lock`) from before it
reads the directory until it returns; a second ``train`` on the same directory is refused
with the holder named.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from recurrences.checks import check_int

from ..compile_watch import CompileWatch
from ..devices import resolve_device, to_device
from ..files import write_atomic
from ..tasks import IGNORE, make_batch
from .checkpoint import (CheckpointError, latest_checkpoint, load_checkpoint, load_optimizer, remove_leftovers,
                         save_checkpoint, set_rng_state)
from .config import TrainConfig
from .distributed import DistInfo, all_reduce_sum_, barrier, init_distributed, shutdown
from .interrupt import StopRequest, TrainingInterrupted
from .lock import RunLock
from .schedule import length_at, lr_at
from .setup import (autocast_dtype, bf16_cpu_codegen, build_model, build_optimizer, build_task, model_from_checkpoint,
                    train_config_of)

CONFIG_FILE, METRICS_FILE, DIVERGED_FILE = "config.json", "metrics.jsonl", "diverged.json"
# fault injection for the resume tests: SIGKILL this process right after that step
FAULT_KILL_ENV = "OVQFLEX_FAULT_KILL_AFTER_STEP"
# and for the clean-stop tests: send this process a signal right after a step: "STEP" (SIGTERM),
# "STEP:INT" (SIGINT), "STEP:TERM:RANK" (only that rank of a torchrun job)
FAULT_SIGNAL_ENV = "OVQFLEX_FAULT_SIGNAL_AFTER_STEP"
# and for the divergence tests: the loss is NaN from that step on (1: the first)
FAULT_NAN_ENV = "OVQFLEX_FAULT_NAN_FROM_STEP"
# what must match between a checkpoint and the run that resumes it
_RESUME_KEYS = ("task", "task_options", "data", "preset", "pattern", "model_options", "seq_len", "length_warmup",
                "length_warmup_steps", "batch_size", "seed", "lr", "min_lr", "warmup", "weight_decay", "beta1",
                "beta2", "grad_clip")


def forward_loss(fwd, x: torch.Tensor, y: torch.Tensor, amp: torch.dtype | None, *, with_aux: bool = False):
    """tokens ``x`` ``[B, T]``, labels ``y`` ``[B, T]`` -> (logits ``[B, T, V]``, cross-entropy summed
    over the target positions); the forward runs under ``amp`` autocast when it is not None.
    ``with_aux=True`` appends the model's auxiliary loss (e.g. VQ commitment; a mean, not a sum)."""
    with torch.autocast(x.device.type, dtype=amp, enabled=amp is not None):
        if with_aux:
            logits, aux = fwd(x, return_aux=True)
        else:
            logits = fwd(x)
    ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
    return (logits, ce, aux) if with_aux else (logits, ce)


class TrainingDiverged(RuntimeError):
    """Training met a non-finite loss (at a logged step) or non-finite weights (before a checkpoint) and
    stopped without checkpointing them; ``checkpoint``: the run's latest (finite) checkpoint, if any.
    The ``ovqflex`` command reports it in one line, exit status 3."""

    exit_code = 3

    def __init__(self, step: int, what: str, checkpoint: Path | None):
        self.step, self.checkpoint = step, checkpoint
        where = (f"its latest checkpoint, {checkpoint}, is finite and kept" if checkpoint is not None
                 else "it has no checkpoint")
        super().__init__(f"training diverged: {what} after step {step:,}; the run stopped without checkpointing "
                         f"it ({where}). A resume would repeat the same steps: train again with a lower learning "
                         f"rate (--lr) or a longer warmup (--warmup), in a new run directory")


def diverged_step(run_dir: str | os.PathLike) -> int | None:
    """The step after which the run in ``run_dir`` diverged, from its ``diverged.json`` (None: it did not)."""
    path = Path(run_dir) / DIVERGED_FILE
    return int(json.loads(path.read_text())["step"]) if path.exists() else None


def _finite(params: list[torch.Tensor]) -> bool:
    """Whether every parameter is finite (one host sync)."""
    return bool(torch.stack([p.detach().isfinite().all() for p in params]).all())


@dataclass
class TrainResult:
    out: Path
    step: int
    loss: float | None
    accuracy: float | None
    tokens_per_s: float | None
    compiled: str | None = None  # what torch.compile did (:meth:`CompileWatch.summary`); None: not compiled

    def describe(self) -> str:
        """The last logged step's loss, accuracy and speed, and what compiling did (needs a logged step)."""
        text = f"loss {self.loss:.4f}, target accuracy {self.accuracy:.3f}, {self.tokens_per_s:,.0f} tokens/s"
        return text + (f"; {self.compiled}" if self.compiled else "")


def deterministic_on(cfg: TrainConfig, device: torch.device) -> bool:
    """Whether a run of ``cfg`` on ``device`` uses deterministic algorithms: ``cfg.deterministic``,
    or when that is None, on for the CPU (threaded float sums, e.g. inductor's scatter-adds, then
    add in a fixed order, at no measured cost) and off for CUDA."""
    return device.type != "cuda" if cfg.deterministic is None else cfg.deterministic


@contextlib.contextmanager
def _determinism(cfg: TrainConfig, device: torch.device):
    """Seed, and switch deterministic algorithms on or off per :func:`deterministic_on` for the
    run; the process's setting is restored after it (a Python caller's own code is not changed)."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.manual_seed(cfg.seed)
    on = deterministic_on(cfg, device)
    if on and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def _check_resumable(cfg: TrainConfig, saved: dict, path: Path) -> None:
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs now {getattr(cfg, k)!r}"
             for k in _RESUME_KEYS if saved.get(k) != getattr(cfg, k)]
    if diffs:
        raise CheckpointError(f"cannot resume from {path}: the run's settings differ ({'; '.join(diffs)})")
    if cfg.steps <= saved["_step"]:
        raise CheckpointError(f"cannot resume from {path}: it is at step {saved['_step']}, already >= "
                              f"--steps {cfg.steps} (raise --steps to train further)")


def _schedule_change(saved: TrainConfig, cfg: TrainConfig, start: int) -> str:
    """What resuming a run of ``saved.steps`` steps as one of ``cfg.steps`` does to its learning rate:
    the remaining steps follow the new run's cosine decay, not the old one's."""
    def at(steps: int) -> float:
        return lr_at(start, lr=cfg.lr, min_lr=cfg.min_lr, warmup=cfg.warmup, total=steps)
    return (f"the run was one of {saved.steps:,} steps and now is one of {cfg.steps:,} (--steps): its learning "
            f"rate from step {start:,} on follows the {cfg.steps:,}-step schedule, {at(cfg.steps):.3g} at step "
            f"{start + 1:,} where the {saved.steps:,}-step one gave {at(saved.steps):.3g}")


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop metric lines past the checkpoint the run starts from (``0``: a fresh start), written
    by a run that died."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut by a crash
    write_atomic(path, "".join(f"{line}\n" for line in keep))


def _progress(cfg: TrainConfig, info: DistInfo, start: int):
    if not (cfg.progress and info.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.steps, initial=start, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)


def check_stop_after(stop_after: object, steps: int) -> int:
    """``stop_after`` of :func:`train`, refused by name unless an int in ``[1, steps]`` (the run's steps)."""
    check_int("stop_after", stop_after)
    if stop_after > steps:
        raise ValueError(f"stop_after must be at most the run's steps ({steps}), got {stop_after}")
    return stop_after


def train(cfg: TrainConfig, *, resume: bool = False, resume_from: str | os.PathLike | None = None,
          stop_after: int | None = None) -> TrainResult:
    """Train per ``cfg`` into ``cfg.out``. ``resume``: continue from the run's latest checkpoint;
    ``resume_from``: from that checkpoint directory. A fresh run refuses a directory that
    already holds checkpoints (nothing is overwritten), and any run a directory another
    ``train`` is writing (the run lock). ``stop_after``: stop once the run has done that many of
    its ``cfg.steps`` steps, with a checkpoint; its schedules (learning rate, length warm-up) are
    those of the whole run, so the steps done are the whole run's first ones and ``resume``
    continues it as if it had not stopped."""
    out = Path(cfg.out)
    if stop_after is not None:
        check_stop_after(stop_after, cfg.steps)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out={str(out)!r} is a file, not a run directory: choose another --out")
    info = init_distributed("cuda" if resolve_device(cfg.device).type == "cuda" else "cpu")
    lock, created = RunLock(out), not out.exists()
    try:
        device = resolve_device(cfg.device, info.local_rank)
        _lock_on_rank0(lock, out, info, device)
        amp = autocast_dtype(cfg, device)
        with _determinism(cfg, device), bf16_cpu_codegen(device, amp, cfg.compile):
            return _train(cfg, info, device, amp, resume, resume_from, cfg.steps if stop_after is None else stop_after)
    finally:
        lock.release()
        if info.is_main and created and out.is_dir() and not any(out.iterdir()):
            try:  # refused before writing anything: leave no empty run directory behind
                out.rmdir()
            except OSError:  # another process just began to use it
                pass
        shutdown(info)


def _lock_on_rank0(lock: RunLock, out: Path, info: DistInfo, device: torch.device) -> None:
    """Rank 0 (the writer) takes the run lock; every rank learns whether it did, so all stop together."""
    error = None
    if info.is_main:
        try:
            lock.acquire()
        except ValueError as e:
            error = e
    if info.enabled:
        failed = torch.tensor([float(error is not None)], device=device)
        all_reduce_sum_([failed], info)
        if failed.item() and error is None:
            raise ValueError(f"rank 0 could not lock the run directory {out}")
    if error is not None:
        raise error


def _fault_signal(rank: int) -> tuple[int, int]:
    """(step, signal) of :data:`FAULT_SIGNAL_ENV` for this rank; step 0: none."""
    value = os.environ.get(FAULT_SIGNAL_ENV, "")
    if not value:
        return 0, signal.SIGTERM
    step, name, only = (value.split(":") + ["", ""])[:3]
    return (int(step) if only in ("", str(rank)) else 0), signal.Signals[f"SIG{name or 'TERM'}"]


def _train(cfg: TrainConfig, info: DistInfo, device: torch.device, amp: torch.dtype | None, resume: bool,
           resume_from, end: int) -> TrainResult:
    """The training loop of :func:`train`, on ``device`` under autocast to ``amp`` (None: fp32), to step ``end``."""
    out = Path(cfg.out)
    if cfg.batch_size % info.world_size:
        raise ValueError(f"batch_size={cfg.batch_size} must be divisible by the number of ranks {info.world_size}")
    local_bs = cfg.batch_size // info.world_size
    task = build_task(cfg)

    ckpt_path = Path(resume_from) if resume_from else (latest_checkpoint(out) if resume else None)
    if resume and ckpt_path is None:
        raise CheckpointError(f"--resume: {out} has no checkpoint to resume from")
    if ckpt_path is None and latest_checkpoint(out) is not None:
        raise ValueError(f"{out} already holds a run ({latest_checkpoint(out)}); pass --resume to continue it "
                         f"or choose another --out")
    ckpt = None if ckpt_path is None else load_checkpoint(ckpt_path, map_location=device)
    if ckpt is not None:
        saved = train_config_of(ckpt)
        _check_resumable(cfg, {**saved.to_dict(), "_step": ckpt.step}, ckpt_path)
    model = (build_model(cfg, task) if ckpt is None else model_from_checkpoint(ckpt, cfg, task)).to(device)
    optimizer = build_optimizer(model, cfg)
    start = 0
    if ckpt is not None:
        load_optimizer(optimizer, ckpt)
        set_rng_state(ckpt.state["rng"])
        start = ckpt.step
        if start >= end < cfg.steps:
            raise ValueError(f"stop_after={end}: the run is already at step {start} ({ckpt_path})")
    if info.is_main:
        remove_leftovers(out)  # of writers that were killed (we hold the run lock)
        (out / DIVERGED_FILE).unlink(missing_ok=True)  # an earlier attempt's: this one may go otherwise
        _truncate_metrics(out / METRICS_FILE, start)
        doc = {"train_config": cfg.to_dict(), "model_config": model.config.to_dict(),
               "task": task.describe(), "parameters": model.num_parameters()}
        write_atomic(out / CONFIG_FILE, json.dumps(doc, indent=1))
        print(f"training {out} from step {start}" + (f", resumed from {ckpt_path}" if ckpt else ""),
              file=sys.stderr, flush=True)
        if ckpt is not None and saved.steps != cfg.steps:
            print(f"warning: {_schedule_change(saved, cfg, start)}", file=sys.stderr, flush=True)
    barrier(info)

    # one graph per batch shape (a length warm-up's few, then seq_len's), none symbolic in the length
    fwd = torch.compile(model, dynamic=False) if cfg.compile else model
    watch = CompileWatch() if cfg.compile else contextlib.nullcontext()
    params = [p for p in model.parameters() if p.requires_grad]
    bar = _progress(cfg, info, start)
    metrics = open(out / METRICS_FILE, "a") if info.is_main else None
    last = TrainResult(out, start, None, None, None)
    t_log, tokens_since = time.perf_counter(), 0
    t_start = time.perf_counter()
    kill_after = int(os.environ.get(FAULT_KILL_ENV, "0"))
    signal_after, signal_kind = _fault_signal(info.rank)
    nan_from = int(os.environ.get(FAULT_NAN_ENV, "0"))

    def save(done: int, last: TrainResult) -> Path | None:
        """Checkpoint after step ``done`` (rank 0 writes, all wait); its directory on rank 0. Refuses
        non-finite weights (every rank holds the same weights, so all refuse together)."""
        if not _finite(params):
            raise TrainingDiverged(done, "the weights are not finite", latest_checkpoint(out))
        path = None
        if info.is_main:
            path = save_checkpoint(out, done, model, optimizer, {
                "train_config": cfg.to_dict(), "model_config": model.config.to_dict(),
                "metrics": {"loss": last.loss, "accuracy": last.accuracy}}, keep=cfg.keep_checkpoints)
        barrier(info)
        return path

    def say(note: str) -> None:
        """A warning on rank 0's stderr, above the progress bar if there is one."""
        if not info.is_main:
            return
        if bar is not None:
            bar.write(f"warning: {note}", file=sys.stderr)
        else:
            print(f"warning: {note}", file=sys.stderr, flush=True)

    try:
        with StopRequest() as stop, watch:
            for step in range(start, end):
                lr = lr_at(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup=cfg.warmup, total=cfg.steps)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                length = length_at(step, seq_len=cfg.seq_len, lengths=cfg.length_warmup,
                                   warmup_steps=cfg.length_warmup_steps)
                per_rank = local_bs * (cfg.seq_len // length)  # the same tokens per step at every length
                x, y = make_batch(task, seed=cfg.seed, step=step, start=info.rank * per_rank, count=per_rank,
                                  seq_len=length)
                x, y = to_device(device, x, y)
                target = y != IGNORE
                # [loss sum, correct, targets] summed over ranks; the count normalises the loss
                n_targets = target.sum().to(torch.float32).reshape(1)
                all_reduce_sum_([n_targets], info)
                logits, loss_sum, aux_loss = forward_loss(fwd, x, y, amp, with_aux=True)
                if nan_from and step + 1 >= nan_from:
                    loss_sum = loss_sum * float("nan")
                # gradients are summed over ranks: each rank adds its share of the aux loss
                (loss_sum / n_targets.clamp_min(1) + aux_loss / info.world_size).backward()
                all_reduce_sum_([p.grad for p in params if p.grad is not None], info)
                if cfg.grad_clip > 0:  # the norm before clipping, logged either way
                    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                else:
                    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                tokens_since += cfg.batch_size * cfg.seq_len
                done = step + 1
                if cfg.compile:
                    for note in watch.step(done, tuple(x.shape)):
                        say(note)
                if done % cfg.log_every == 0 or done == end:
                    with torch.no_grad():
                        correct = ((logits.argmax(-1) == y) & target).sum().to(torch.float32)
                        stats = torch.stack([loss_sum.detach().float(), correct])
                        all_reduce_sum_([stats], info)
                        loss, acc = (stats / n_targets.clamp_min(1)).tolist()
                    if not math.isfinite(loss):  # the same value on every rank (all-reduced)
                        raise TrainingDiverged(done, f"the training loss is {loss}", latest_checkpoint(out))
                    now = time.perf_counter()
                    tps = tokens_since / max(now - t_log, 1e-9)
                    t_log, tokens_since = now, 0
                    last = TrainResult(out, done, loss, acc, tps)
                    if metrics is not None:
                        row = {"step": done, "seq_len": length, "loss": round(loss, 6), "accuracy": round(acc, 6),
                               "lr": lr, "grad_norm": round(float(grad_norm), 6),
                               "tokens_per_s": round(tps, 1), "elapsed_s": round(now - t_start, 2)}
                        metrics.write(json.dumps(row) + "\n")
                        metrics.flush()
                    if bar is not None:
                        bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.3f}", tok_s=f"{tps:,.0f}", refresh=False)
                if bar is not None:
                    bar.update(1)
                saved = (cfg.ckpt_every and done % cfg.ckpt_every == 0) or done == end
                if saved:
                    ckpt_dir = save(done, last)
                if done == kill_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                if done == signal_after:
                    os.kill(os.getpid(), signal_kind)
                signum = stop.requested(info, device, sync_point=done % cfg.log_every == 0 or done == end)
                if signum is not None:
                    if not saved:
                        ckpt_dir = save(done, last)
                    raise TrainingInterrupted(signum, done, ckpt_dir, complete=done == cfg.steps)
    except TrainingDiverged as e:
        if info.is_main:
            write_atomic(out / DIVERGED_FILE, json.dumps({"step": e.step, "message": str(e)}, indent=1))
        raise
    finally:
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
    return dataclasses.replace(last, compiled=watch.summary()) if cfg.compile else last
