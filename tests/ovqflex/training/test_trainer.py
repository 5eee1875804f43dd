"""Training loop: metrics and checkpoints, exact resume after a kill, refusals, eval report."""
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ovqflex.training import (CheckpointError, TrainConfig, TrainingDiverged, diverged_step, evaluate,
                              latest_checkpoint, load_checkpoint, save_checkpoint, train)
import ovqflex.training.trainer as trainer_mod
from ovqflex.cli import main
from ovqflex.training.distributed import DistInfo
from ovqflex.training.evaluate import load_run, parse_overrides, report_name
from ovqflex.training.lock import LOCK_FILE, RunLock, RunLockError
from ovqflex.training.interrupt import TrainingInterrupted
from ovqflex.training.trainer import FAULT_KILL_ENV, FAULT_NAN_ENV, FAULT_SIGNAL_ENV, TrainResult
from tests.helpers import assert_close

# a model small enough that a step takes milliseconds: the loop is under test, not learning
MODEL = dict(d_model=32, n_heads=2, window=16, chunk_size=16, block_size=16, **{"ovq.max_centroids": 32})
CLI_MODEL = [f"--model-opt={k}={v}" for k, v in MODEL.items()]


def cfg(tmp_path: Path, **kw) -> TrainConfig:
    base = dict(out=str(tmp_path / "run"), task="icr", task_options=dict(vocab_size=64, key_len=1, value_len=1),
                seq_len=64, batch_size=4, steps=6, warmup=2, compile=False, log_every=1, progress=False,
                model_options=dict(MODEL))
    return TrainConfig(**{**base, **kw})


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_writes_metrics_config_and_a_checkpoint(tmp_path):
    c = cfg(tmp_path)
    result = train(c)
    run = Path(c.out)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["loss"] > 0 and 0 <= r["accuracy"] <= 1 and r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["lr"] < rows[1]["lr"]  # warmup
    assert result.step == 6 and result.loss == pytest.approx(rows[-1]["loss"], abs=1e-6)
    doc = json.loads((run / "config.json").read_text())
    assert doc["train_config"]["steps"] == 6 and doc["model_config"]["pattern"] == "ovq,swa"  # the tiny preset's
    assert load_checkpoint(latest_checkpoint(run)).step == 6


@pytest.mark.parametrize("pattern, grad_clip", [("ovq,swa", 0.05), ("swa,vq", 0.05), ("ovq,swa", 0.0)],
                         ids=["ovq-clipped", "vq-clipped", "ovq-unclipped"])
def test_a_step_is_adamw_on_the_mean_target_loss_clipped_with_decay_on_the_matrices(tmp_path, pattern, grad_clip):
    """Three steps of ``train`` equal three written out here: the cross-entropy averaged over the target
    positions (plus the model's aux loss: VQ's commitment term), its gradient clipped to ``grad_clip``
    (below the gradient's norm in every step, so the clip acts; 0: not clipped; the metrics log the norm
    before any clip), AdamW at the schedule's rate with weight decay on the matrices (linears, embedding) and
    none on the norms and per-head scalars."""
    import torch.nn.functional as F

    from ovqflex.tasks import IGNORE, make_batch
    from ovqflex.training.schedule import lr_at
    from ovqflex.training.setup import build_model, build_task

    c = cfg(tmp_path, steps=3, grad_clip=grad_clip, weight_decay=0.1, model_options={**MODEL, "pattern": pattern})
    train(c)
    torch.manual_seed(c.seed)  # as train() does before it builds the model
    task = build_task(c)
    model = build_model(c, task)
    params = dict(model.named_parameters())
    matrices = [name for name, p in params.items() if p.ndim >= 2]
    assert "embed.weight" in matrices and len(matrices) < len(params)  # norms and per-head scalars are not
    opt = torch.optim.AdamW([{"params": [params[n] for n in matrices], "weight_decay": c.weight_decay},
                             {"params": [p for n, p in params.items() if n not in matrices], "weight_decay": 0.0}],
                            lr=c.lr, betas=(c.beta1, c.beta2))
    norms = []
    for step in range(c.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, lr=c.lr, min_lr=c.min_lr, warmup=c.warmup, total=c.steps)
        x, y = make_batch(task, seed=c.seed, step=step, start=0, count=c.batch_size, seq_len=c.seq_len)
        logits, aux = model(x, return_aux=True)
        target = y != IGNORE
        (F.cross_entropy(logits[target], y[target]) + aux).backward()
        if c.grad_clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)))
        else:  # the norm of all gradients together, the weights left as they are
            grads = [torch.linalg.vector_norm(p.grad) for p in model.parameters() if p.grad is not None]
            norms.append(float(torch.linalg.vector_norm(torch.stack(grads))))
        opt.step()
        opt.zero_grad()
    assert min(norms) > 0.05  # (where it clips, every step)
    assert [r["grad_norm"] for r in metrics(Path(c.out))] == pytest.approx(norms, rel=1e-5)
    trained = load_checkpoint(latest_checkpoint(c.out)).model
    for name, p in params.items():
        assert_close(trained[name], p.detach(), 1e-6, name)


def test_loss_falls_when_memorising_one_batch(tmp_path, monkeypatch):
    """The loop optimises (loss, backward, clipping, AdamW, schedule): every step sees step 0's batch."""
    real = trainer_mod.make_batch
    monkeypatch.setattr(trainer_mod, "make_batch", lambda task, **kw: real(task, **{**kw, "step": 0}))
    c = cfg(tmp_path, steps=40, lr=1e-2, warmup=0)
    train(c)
    rows = metrics(Path(c.out))
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]


# swa,vq whose codebook revives codes at every step (dead_threshold above an unused code's count): the new
# codes are keys drawn with torch's generator, which a resume must continue where the checkpoint left it
REVIVING_VQ = {**MODEL, "pattern": "swa,vq", "vq.dead_threshold": 0.999, "vq.codebook_size": 64}


@pytest.mark.parametrize("model_options", [MODEL, REVIVING_VQ], ids=["tiny", "swa-vq-reviving"])
def test_resume_from_a_checkpoint_is_exact(tmp_path, model_options):
    straight = cfg(tmp_path / "a", model_options=model_options)
    train(straight)
    with_ckpts = cfg(tmp_path / "b", ckpt_every=3, keep_checkpoints=3, model_options=model_options)
    train(with_ckpts)
    resumed = cfg(tmp_path / "c", ckpt_every=3, model_options=model_options)
    train(resumed, resume_from=Path(with_ckpts.out) / "checkpoints" / "step_00000003")
    a = load_checkpoint(latest_checkpoint(straight.out)).model
    c = load_checkpoint(latest_checkpoint(resumed.out)).model
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert metrics(Path(straight.out))[-1]["loss"] == metrics(Path(resumed.out))[-1]["loss"]


# a run of 6 steps at 128 tokens whose first 3 are at 64 (the ICR task's shortest is 47)
WARMUP = dict(seq_len=128, length_warmup=(64,), length_warmup_steps=3)


def test_a_length_warmup_trains_shorter_sequences_first_at_the_same_tokens_per_step(tmp_path, monkeypatch):
    """The warm-up's steps draw twice the sequences at half the length: the stream's batches of
    those lengths (a pure function of seed and step), every step the same tokens; the metrics say
    each logged step's length."""
    real, drawn = trainer_mod.make_batch, []
    monkeypatch.setattr(trainer_mod, "make_batch", lambda task, **kw: drawn.append(kw) or real(task, **kw))
    c = cfg(tmp_path, **WARMUP)
    train(c)
    assert [(d["count"], d["seq_len"], d["start"]) for d in drawn] == [(8, 64, 0)] * 3 + [(4, 128, 0)] * 3
    assert [d["step"] for d in drawn] == list(range(6))
    assert [r["seq_len"] for r in metrics(Path(c.out))] == [64] * 3 + [128] * 3


def test_tokens_per_second_count_every_steps_tokens_during_a_length_warmup(tmp_path, monkeypatch):
    """A warm-up step trains as many tokens as any other (more sequences, shorter): with a clock that
    moves one second per reading, each logged step reports batch_size x seq_len tokens/s."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(trainer_mod, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    c = cfg(tmp_path, **WARMUP)
    train(c)
    rows = metrics(Path(c.out))
    assert [r["seq_len"] for r in rows] == [64] * 3 + [128] * 3
    # (the first interval spans two readings: the loop's start and its elapsed-time origin)
    assert [r["tokens_per_s"] for r in rows] == [c.batch_size * c.seq_len / 2] + [c.batch_size * c.seq_len] * 5


def test_resume_inside_a_length_warmup_is_exact(tmp_path):
    straight = cfg(tmp_path / "a", **WARMUP)
    train(straight)
    with_ckpts = cfg(tmp_path / "b", ckpt_every=2, keep_checkpoints=3, **WARMUP)
    train(with_ckpts)
    resumed = cfg(tmp_path / "c", **WARMUP)
    train(resumed, resume_from=Path(with_ckpts.out) / "checkpoints" / "step_00000002")  # before its last short step
    a = load_checkpoint(latest_checkpoint(straight.out)).model
    c = load_checkpoint(latest_checkpoint(resumed.out)).model
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert [r["loss"] for r in metrics(Path(straight.out))][2:] == [r["loss"] for r in metrics(Path(resumed.out))]
    with pytest.raises(CheckpointError, match="settings differ.*length_warmup_steps: checkpoint 3 vs now 4"):
        train(TrainConfig(**{**straight.to_dict(), "steps": 8, "length_warmup_steps": 4}), resume=True)


def test_resuming_with_more_steps_says_the_learning_rate_follows_the_longer_schedule(tmp_path, capsys):
    """Raising --steps on a resume is how a finished run trains further; its cosine decay is then the
    longer run's, so the learning rate rises from the old run's end: the resume says so, with the rate
    the next step uses (as its metrics line logs it) and the one the old schedule gave."""
    c = cfg(tmp_path, steps=4, warmup=1, min_lr=1e-5)
    train(c)
    capsys.readouterr()
    train(TrainConfig(**{**c.to_dict(), "steps": 8}), resume=True)
    err = capsys.readouterr().err
    used = metrics(Path(c.out))[4]
    assert used["step"] == 5 and used["lr"] > 1e-3
    assert (f"warning: the run was one of 4 steps and now is one of 8 (--steps): its learning rate from step 4 on "
            f"follows the 8-step schedule, {used['lr']:.3g} at step 5 where the 4-step one gave 1e-05") in err, err
    train(TrainConfig(**{**c.to_dict(), "steps": 8, "out": str(tmp_path / "b")}), stop_after=4)
    capsys.readouterr()
    train(TrainConfig(**{**c.to_dict(), "steps": 8, "out": str(tmp_path / "b")}), resume=True)
    assert "warning" not in capsys.readouterr().err  # the same run's schedule: nothing to say


def test_stop_after_trains_the_whole_runs_first_steps_and_resume_finishes_it_exactly(tmp_path):
    """``stop_after=4`` of a 6-step run with a 3-step length warm-up: the steps done are the whole
    run's first four (its cosine learning rate, its lengths: not those of a 4-step run), with a
    checkpoint of step 4; resuming finishes the run with the uninterrupted run's weights."""
    keys = ("step", "seq_len", "loss", "accuracy", "lr", "grad_norm")
    straight = cfg(tmp_path / "a", **WARMUP)
    train(straight)
    stopped = cfg(tmp_path / "b", **WARMUP)
    result = train(stopped, stop_after=4)
    assert result.step == 4 and latest_checkpoint(stopped.out).name == "step_00000004"
    want = [{k: r[k] for k in keys} for r in metrics(Path(straight.out))]
    assert [{k: r[k] for k in keys} for r in metrics(Path(stopped.out))] == want[:4]
    assert want[3]["lr"] != TrainConfig.lr and want[3]["seq_len"] == 128  # cosine-decayed, past the warm-up
    train(stopped, resume=True)
    assert [{k: r[k] for k in keys} for r in metrics(Path(stopped.out))] == want
    a = load_checkpoint(latest_checkpoint(straight.out)).model
    b = load_checkpoint(latest_checkpoint(stopped.out)).model
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stop_after, resume, match", [
    (0, False, "stop_after must be >= 1, got 0"),
    (7, False, r"stop_after must be at most the run's steps \(6\), got 7"),
    (2, True, r"stop_after=2: the run is already at step 3 \(.*step_00000003\)"),
    (3, True, r"stop_after=3: the run is already at step 3 \(.*step_00000003\)"),
], ids=["zero", "past-the-run", "already-past", "already-there"])
def test_a_stop_after_that_cannot_stop_the_run_is_refused(tmp_path, stop_after, resume, match):
    c = cfg(tmp_path)
    if resume:
        train(c, stop_after=3)
    with pytest.raises(ValueError, match=match):
        train(c, resume=resume, stop_after=stop_after)


@pytest.mark.slow
def test_compiled_training_with_a_length_warmup_has_one_static_graph_per_length(tmp_path):
    """The trainer compiles with ``dynamic=False``: the warm-up's length and the run's get a graph each,
    neither symbolic in the length (~80 s on two cores)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    c = cfg(tmp_path, compile=True, steps=4, batch_size=4, **{**WARMUP, "length_warmup_steps": 2})
    result = train(c)
    rows = metrics(Path(c.out))
    assert [r["seq_len"] for r in rows] == [64, 64, 128, 128] and all(r["loss"] > 0 for r in rows)
    assert counters["stats"]["unique_graphs"] == 2
    assert result.compiled == "torch.compile: 2 graphs, no graph break, no recompile"


def _break_first(forward):
    def broken(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return forward(self, *args, **kwargs)
    return broken


def _recompile_every_call(forward):
    def counting(self, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1  # a Python int dynamo guards on: a new graph every call
        return forward(self, *args, **kwargs) * (self.calls > 0)
    return counting


@pytest.mark.parametrize("fault, warnings, summary", [
    (_break_first, ["step 1: torch.compile split the model at 1 graph break(s), and runs the code between the graphs "
                    "unfused: Call to `torch._dynamo.graph_break()`"],
     "torch.compile: 1 graph, 1 graph break, no recompile"),  # (nothing to compile before the break)
    (_recompile_every_call, [f"step {s}: torch.compile compiled 1 new graph(s) for inputs of shape 4x64, which step 1 "
                             f"ran already: a recompile" for s in (2, 3)],
     "torch.compile: 3 graphs, no graph break, 2 recompiles"),
], ids=["graph-break", "recompile"])
def test_compiled_training_warns_of_graph_breaks_and_recompiles_as_they_happen(tmp_path, monkeypatch, capsys, fault,
                                                                                 warnings, summary,
                                                                                 eager_backend_compile):
    """What dynamo does to the model is told when it happens and summed up at the end."""
    from ovqflex.models.hybrid import HybridLM

    monkeypatch.setattr(HybridLM, "forward", fault(HybridLM.forward))
    # (the graph-break case with the progress bar, whose line the warning is written above)
    result = train(cfg(tmp_path, compile=True, steps=3, progress=fault is _break_first))
    said = [line.removeprefix("warning: ") for line in capsys.readouterr().err.splitlines()
            if line.startswith("warning: ")]
    assert len(said) == len(warnings) and all(line.startswith(w) for line, w in zip(said, warnings)), said
    assert result.compiled == summary


@pytest.mark.parametrize("options, message", [
    pytest.param(dict(seq_len=128, length_warmup=(32,), length_warmup_steps=3),
                 "training length 32 is too short for task 'icr' (needs >= 47)", id="warmup-too-short"),
    pytest.param(dict(seq_len=32), "training length 32 is too short for task 'icr' (needs >= 47)", id="too-short"),
    pytest.param(dict(seq_len=46), "training length 46 is too short for task 'icr' (needs >= 47)", id="one-short"),
    pytest.param(dict(seq_len=512), "training length 512 is too long for task 'icr' (", id="more-keys-than-vocab"),
    pytest.param(dict(task="text", task_options={}, data="SHORT", seq_len=64),
                 "training length 64 is too long for task 'text' (", id="text-file-too-short"),
])
def test_a_training_length_the_task_cannot_make_is_refused_before_the_run_is_written(tmp_path, options, message):
    if options.get("data") == "SHORT":
        (tmp_path / "short.txt").write_text("too short for one example")
        options = {**options, "data": str(tmp_path / "short.txt")}
    with pytest.raises(ValueError) as refused:
        train(cfg(tmp_path, **options))
    assert str(refused.value).startswith(message), refused.value
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("deterministic", [None, True], ids=["default", "on"])
def test_compiled_cpu_training_repeats_bit_for_bit(tmp_path, deterministic):
    """On the CPU a run is deterministic by default: two compiled runs on two threads end with equal
    parameters, bit for bit (with ``deterministic=False`` they differ, at the 7th digit, after a
    step or two: threaded scatter-adds sum in a varying order); the process's own setting is kept."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        states = []
        for name in ("a", "b"):
            c = cfg(tmp_path / name, compile=True, steps=4, batch_size=8, deterministic=deterministic)
            train(c)
            states.append(load_checkpoint(latest_checkpoint(c.out)).model)
            assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_deterministic_defaults_to_on_for_the_cpu_only():
    from ovqflex.training.trainer import deterministic_on

    on = {(det, dev): deterministic_on(TrainConfig(deterministic=det), torch.device(dev))
          for det in (None, True, False) for dev in ("cpu", "cuda")}
    assert on == {(None, "cpu"): True, (None, "cuda"): False, (True, "cpu"): True, (True, "cuda"): True,
                  (False, "cpu"): False, (False, "cuda"): False}


def test_a_global_batch_the_ranks_cannot_share_is_refused(tmp_path):
    """(Checked in the loop, where the ranks are known: rank 0 of two, before anything is written.)"""
    c = cfg(tmp_path, batch_size=3)
    with pytest.raises(ValueError, match="batch_size=3 must be divisible by the number of ranks 2"):
        trainer_mod._train(c, DistInfo(rank=0, world_size=2), torch.device("cpu"), None, False, None, c.steps)
    assert not Path(c.out).exists()


def test_a_results_description_ends_with_what_compiling_did(tmp_path):
    eager = TrainResult(tmp_path, 6, 0.12345, 0.5, 12345.6)
    assert eager.describe() == "loss 0.1235, target accuracy 0.500, 12,346 tokens/s"
    compiled = TrainResult(tmp_path, 6, 0.12345, 0.5, 12345.6, compiled="compiled 2 graphs, no graph break")
    assert compiled.describe() == eager.describe() + "; compiled 2 graphs, no graph break"


@pytest.mark.parametrize("before", [(False, False), (True, False), (False, True)],
                         ids=["off", "on-strict", "off-warn-only"])
def test_a_run_leaves_the_callers_deterministic_setting_as_it_found_it(tmp_path, before):
    """The run switches deterministic algorithms on (the CPU's default) in warn-only mode; afterwards the
    caller's own setting is back, its warn-only flag included."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    try:
        train(cfg(tmp_path, steps=1))
        after = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    assert after == before


def _cli(args, env=None, check=True):
    proc = subprocess.run([sys.executable, "-m", "ovqflex.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


# the CLI runs of the stop-and-resume tests: 8 steps, checkpoints every 4
STOP_RUN = ["train", "--task", "icr", "--task-opt", "key_len=1", "--task-opt", "value_len=1", "--seq-len", "64",
            "--batch-size", "4", "--steps", "8", "--warmup", "2", "--no-compile", "--log-every", "1", "--no-progress",
            "--ckpt-every", "4", *CLI_MODEL]


@pytest.fixture(scope="module")
def straight_losses(tmp_path_factory) -> list[float]:
    """The losses of the 8-step run without interruption (one run shared by the stop tests)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    _cli([*STOP_RUN, "--out", str(out)])
    return [r["loss"] for r in metrics(out)]


def test_killed_run_resumes_to_the_same_final_loss(tmp_path, straight_losses):
    """N steps straight == N/2 steps, SIGKILL (two steps later, so unsaved progress is lost), resume."""
    killed = _cli([*STOP_RUN, "--out", str(tmp_path / "killed")], env={FAULT_KILL_ENV: "6"}, check=False)
    assert killed.returncode == -9, killed.stderr
    assert latest_checkpoint(tmp_path / "killed").name == "step_00000004"
    assert [r["step"] for r in metrics(tmp_path / "killed")][-1] == 6
    _cli([*STOP_RUN, "--out", str(tmp_path / "killed"), "--resume"])
    b = metrics(tmp_path / "killed")
    assert [r["step"] for r in b] == list(range(1, 9))  # lines of the lost steps 5-6 replaced, not duplicated
    assert [r["loss"] for r in b] == straight_losses


def test_sigterm_stops_after_the_step_with_a_checkpoint_and_resume_matches(tmp_path, straight_losses):
    """SIGTERM after step 5 (between the step-4 and step-8 checkpoints): the run stops with a checkpoint
    of step 5 and the shell's exit status 143; resuming it gives the uninterrupted losses. (SIGINT takes
    the same path: test_a_signal_during_the_last_step_is_not_swallowed.)"""
    stopped = _cli([*STOP_RUN, "--out", str(tmp_path / "stopped")], env={FAULT_SIGNAL_ENV: "5"}, check=False)
    assert stopped.returncode == 143, stopped.stderr
    assert "stopped by SIGTERM after step 5: checkpoint " in stopped.stderr and "--resume" in stopped.stderr
    assert latest_checkpoint(tmp_path / "stopped").name == "step_00000005"
    assert [r["step"] for r in metrics(tmp_path / "stopped")] == [1, 2, 3, 4, 5]
    resumed = _cli([*STOP_RUN, "--out", str(tmp_path / "stopped"), "--resume"])
    assert "resumed from" in resumed.stderr and "step_00000005" in resumed.stderr
    b = metrics(tmp_path / "stopped")
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [r["loss"] for r in b] == straight_losses


def test_cli_stop_after_says_how_far_it_went_and_resume_matches(tmp_path, straight_losses):
    """``--stop-after 3`` stops the 8-step run with a checkpoint of step 3 and exit status 0; the
    resumed run's losses are the uninterrupted run's."""
    stopped = _cli([*STOP_RUN, "--out", str(tmp_path / "run"), "--stop-after", "3"])
    assert "trained 3 steps of 8 (--stop-after; --resume continues)" in stopped.stdout
    assert latest_checkpoint(tmp_path / "run").name == "step_00000003"
    _cli([*STOP_RUN, "--out", str(tmp_path / "run"), "--resume"])
    assert [r["loss"] for r in metrics(tmp_path / "run")] == straight_losses


def test_a_signal_during_the_last_step_is_not_swallowed(tmp_path, monkeypatch):
    """SIGINT during the last step: the run completes (its final checkpoint) and still reports the stop,
    so a caller (an experiment) does not go on as if no one had asked."""
    monkeypatch.setenv(FAULT_SIGNAL_ENV, "3:INT")
    c = cfg(tmp_path, steps=3)
    with pytest.raises(TrainingInterrupted, match="stopped by SIGINT after its last step 3: checkpoint .*step_00000003; "
                                                  "the run is complete") as info:
        train(c)
    assert info.value.complete and info.value.exit_code == 130
    assert load_checkpoint(latest_checkpoint(c.out)).step == 3


def test_a_signal_at_a_checkpoint_step_writes_that_checkpoint_once(tmp_path, monkeypatch):
    """SIGTERM after step 2, a checkpoint step: the stop uses the checkpoint just written (not a second
    write of it); a run cut short by stop_after is not complete when the signal lands on its last step."""
    real, written = trainer_mod.save_checkpoint, []
    monkeypatch.setattr(trainer_mod, "save_checkpoint", lambda out, step, *a, **k: written.append(step) or
                        real(out, step, *a, **k))
    monkeypatch.setenv(FAULT_SIGNAL_ENV, "2")
    c = cfg(tmp_path, steps=6, ckpt_every=2)
    with pytest.raises(TrainingInterrupted, match="stopped by SIGTERM after step 2: checkpoint .*step_00000002; "
                                                  "continue with --resume") as info:
        train(c)
    assert written == [2] and not info.value.complete and info.value.checkpoint.name == "step_00000002"
    monkeypatch.setenv(FAULT_SIGNAL_ENV, "3")
    with pytest.raises(TrainingInterrupted, match="after step 3: .*continue with --resume") as info:
        train(c, resume=True, stop_after=3)
    assert written == [2, 3] and not info.value.complete


def test_fresh_run_refuses_a_used_directory_and_resume_needs_a_checkpoint(tmp_path):
    c = cfg(tmp_path, steps=2)
    train(c)
    with pytest.raises(ValueError, match="already holds a run .*step_00000002.*--resume"):
        train(c)
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        train(cfg(tmp_path / "empty"), resume=True)


def test_resume_with_different_settings_is_refused(tmp_path):
    """Each setting that shapes the run's data, model or optimisation must match its checkpoint's (the
    learning rate's whole schedule too: a resume must continue the run, not start another)."""
    c = cfg(tmp_path, steps=2)
    train(c)
    changes = dict(seq_len=128, batch_size=8, seed=1, lr=1e-3, min_lr=2e-5, warmup=1, weight_decay=0.1, beta1=0.8,
                   beta2=0.9, grad_clip=0.5, pattern="swa,linear", task_options=dict(vocab_size=64, key_len=1,
                                                                                       value_len=2))
    for key, value in changes.items():
        expected = rf"settings differ \({key}: checkpoint .* vs now {re.escape(repr(value))}\)"
        with pytest.raises(CheckpointError, match=expected):
            train(TrainConfig(**{**c.to_dict(), key: value, "steps": 4}), resume=True)
    train(TrainConfig(**{**c.to_dict(), "steps": 3, "log_every": 2, "keep_checkpoints": 1}), resume=True)  # fine


def test_resume_past_the_last_step_is_refused(tmp_path):
    c = cfg(tmp_path, steps=2)
    train(c)
    with pytest.raises(CheckpointError, match="at step 2, already >= --steps 2"):
        train(c, resume=True)


def test_corrupted_latest_checkpoint_gives_a_clear_error(tmp_path):
    c = cfg(tmp_path, steps=2)
    train(c)
    weights = latest_checkpoint(c.out) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="model.safetensors is truncated"):
        train(TrainConfig(**{**c.to_dict(), "steps": 4}), resume=True)


def test_eval_reports_lengths_and_overrides(tmp_path):
    c = cfg(tmp_path, steps=2, task_options=dict(vocab_size=64, key_len=1, value_len=1, min_pairs=1))
    train(c)
    doc = evaluate(c.out, [128, 64, 128], n_examples=3, batch_size=2, overrides={"max_centroids": 64})
    assert [r["length"] for r in doc["rows"]] == [64, 128]  # each length once, in order
    # the report describes the task it measured: full contexts, without the training mix
    assert "min_pairs" not in json.dumps(doc) and "training mix" not in doc["task_description"]
    assert all(0 <= r["accuracy"] <= 1 and r["targets"] == 3 * 6 for r in doc["rows"])
    assert doc["overrides"] == {"max_centroids": 64}
    # the loss is the mean cross-entropy of a target token (here the 3 examples' 18 targets at 64 tokens), of
    # the model in eval mode (in training mode a VQ layer would move its codebook while it is measured)
    from ovqflex.tasks import IGNORE
    from ovqflex.training.evaluate import eval_batches

    _, task, model, _ = load_run(c.out)
    assert not model.training
    model.set_overrides(max_centroids=64)
    x, y = next(eval_batches(task.evaluation(), 64, n_examples=3, batch_size=3, seed=c.seed))
    with torch.no_grad():
        mean = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE)
    assert abs(doc["rows"][0]["loss"] - mean.item()) < 1e-5 * mean.item()
    assert json.loads((Path(c.out) / "eval.json").read_text()) == {k: v for k, v in doc.items() if k != "plot"}
    assert doc["plot"] == str(Path(c.out) / "eval.png") and Path(doc["plot"]).stat().st_size > 1000
    with pytest.raises(ValueError, match="override nope=1"):
        evaluate(c.out, [64], n_examples=1, overrides={"nope": 1})
    with pytest.raises(ValueError, match="too short"):
        evaluate(c.out, [8], n_examples=1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        evaluate(tmp_path / "nothing", [64])
    default = evaluate(c.out, n_examples=1, name="eval-default")
    assert [r["length"] for r in default["rows"]] == [64, 128, 256]  # the training length, x2, x4
    named = evaluate(c.out, [64], n_examples=2, name="eval-x2")  # another report next to eval.json
    assert json.loads((Path(c.out) / "eval-x2.json").read_text())["rows"] == named["rows"]
    assert json.loads((Path(c.out) / "eval.json").read_text())["overrides"] == {"max_centroids": 64}
    with pytest.raises(ValueError, match="name must be a non-empty file stem"):
        evaluate(c.out, [64], n_examples=1, name="../x")
    with pytest.raises(ValueError, match="lengths must name at least one context length"):
        evaluate(c.out, [], n_examples=1)
    for arg, value in (("n_examples", True), ("batch_size", 0)):
        with pytest.raises(ValueError, match=f"{arg} must be an int >= 1, got {value}"):
            evaluate(c.out, [64], **{"n_examples": 1, arg: value})


def test_overrides_are_parsed_as_json_values_or_strings():
    assert parse_overrides(["max_centroids=4096", "backend=blocked", "logn_len=null", "x=a=b"]) == \
        {"max_centroids": 4096, "backend": "blocked", "logn_len": None, "x": "a=b"}
    for bad in ("max_centroids", "=4096"):
        with pytest.raises(ValueError, match=f"override must look like NAME=VALUE, got '{bad}'"):
            parse_overrides(["backend=blocked", bad])


def test_cli_eval_names_reports_by_their_overrides(tmp_path, capsys):
    """``ovqflex eval`` with other overrides writes its own report: none is overwritten."""
    c = cfg(tmp_path, steps=2, task_options=dict(vocab_size=64, key_len=1, value_len=1, min_pairs=1))
    train(c)
    base = ["eval", c.out, "--lengths", "64", "--examples", "2", "--batch-size", "2"]
    assert main(base) == 0
    assert main(base + ["--override", "max_centroids=64", "--override", "growth=full"]) == 0
    assert main(base + ["--name", "mine"]) == 0
    out = capsys.readouterr().out
    names = ["eval", "eval-max_centroids-64-growth-full", "mine"]
    for name in names:
        assert f"wrote {Path(c.out) / name}.json and {name}.png" in out
    docs = {n: json.loads((Path(c.out) / f"{n}.json").read_text()) for n in names}
    assert [d["overrides"] for d in docs.values()] == [{}, {"max_centroids": 64, "growth": "full"}, {}]
    assert report_name({"backend": "blocked", "x": "a/b c"}) == "eval-backend-blocked-x-a_b_c"
    assert report_name({"temperature": 0.5}) == "eval-temperature-0.5"  # a dot is kept


def _as_saved_by_an_earlier_release(checkpoint: Path) -> None:
    """Rewrite the checkpoint's configs as releases with OVQ's max_centroids / growth / seeding as
    HybridConfig fields wrote them (and re-sign its manifest, as that release did)."""
    state_file, manifest_file = checkpoint / "state.json", checkpoint / "manifest.json"
    state = json.loads(state_file.read_text())
    model = state["model_config"]
    ovq = model.pop("mixer_options").pop("ovq")
    model.update(max_centroids=ovq["max_centroids"], growth="plateau", seeding="spread", mixer_options={})
    options = state["train_config"]["model_options"]
    options["max_centroids"] = options.pop("ovq.max_centroids")
    state_file.write_text(json.dumps(state))
    manifest = json.loads(manifest_file.read_text())
    data = state_file.read_bytes()
    manifest["files"]["state.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_file.write_text(json.dumps(manifest))


def test_a_run_saved_with_ovq_config_fields_still_evaluates(tmp_path):
    c = cfg(tmp_path, steps=2)
    train(c)
    before = evaluate(c.out, [64], n_examples=3, batch_size=3, name="before")
    _as_saved_by_an_earlier_release(latest_checkpoint(c.out))
    assert json.loads((latest_checkpoint(c.out) / "state.json").read_text())["model_config"]["max_centroids"] == 32
    with pytest.warns(DeprecationWarning, match="max_centroids.* now OVQ options"):
        _, _, model, _ = load_run(c.out)
        after = evaluate(c.out, [64], n_examples=3, batch_size=3, name="after")
    assert [b.mixer.max_centroids for b in model.blocks if b.mixer_name == "ovq"] == [32]
    assert [(r["accuracy"], r["loss"]) for r in after["rows"]] == [(r["accuracy"], r["loss"]) for r in before["rows"]]


@pytest.mark.slow
@pytest.mark.parametrize("pattern, rel", [(None, 1e-4), ("swa,vq", 1e-5)], ids=["tiny", "swa-vq"])
def test_torchrun_two_ranks_match_one_process(tmp_path, pattern, rel):
    """gloo data parallel over 2 CPU processes == 1 process with the same global batch. With a VQ layer
    too: its EMA codebook statistics are summed over the ranks (each rank had learned its own codebook from
    its own half, and the loss drifted 8e-5 from the single process's at step 2, 1.8e-4 at step 6).

    Without the tiny preset's training mix (``min_pairs``): with it, the two runs agree at step 1
    but differ by ~4e-5 in the loss from step 2 on, for swa,ovq only (swa,nope stays equal to 6
    digits): apparently the mix's left padding brings OVQ's discrete routing near ties, where the
    rounding difference of a batch of 8 vs two of 4 flips a route. The loop's data-parallel
    arithmetic is what is tested here."""
    common = ["--task", "icr", "--task-opt", "key_len=1", "--task-opt", "value_len=1", "--task-opt", "min_pairs=null",
              "--seq-len", "64", "--batch-size", "8", "--steps", "6", "--warmup", "2", "--no-compile", "--log-every", "1",
              "--no-progress", *CLI_MODEL, *(["--pattern", pattern] if pattern else [])]
    _cli(["train", *common, "--out", str(tmp_path / "one")])
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", "29531" if pattern is None else "29533", "-m", "ovqflex.cli", "train",
                           *common, "--out", str(tmp_path / "two")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=rel), (ra, rb)


@pytest.mark.slow
def test_torchrun_ranks_stop_together_when_one_is_signalled(tmp_path):
    """SIGTERM to rank 1 alone after step 3 (logging every 2 steps): both ranks stop after step 4 with
    rank 0's checkpoint of it, and a torchrun resume gives the uninterrupted run's losses."""
    common = ["--task", "icr", "--task-opt", "key_len=1", "--task-opt", "value_len=1", "--task-opt", "min_pairs=null",
              "--seq-len", "64", "--batch-size", "8", "--steps", "6", "--warmup", "2", "--no-compile", "--log-every", "2",
              "--no-progress", *CLI_MODEL]
    _cli(["train", *common, "--out", str(tmp_path / "one")])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29532",
                "-m", "ovqflex.cli", "train", *common, "--out", str(tmp_path / "two")]
    proc = subprocess.run(torchrun, capture_output=True, text=True, timeout=600,
                          env={**os.environ, FAULT_SIGNAL_ENV: "3:TERM:1"})
    assert proc.returncode != 0 and "stopped by SIGTERM after step 4: checkpoint" in proc.stderr, proc.stderr
    assert latest_checkpoint(tmp_path / "two").name == "step_00000004"
    proc = subprocess.run([*torchrun, "--resume"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [2, 4, 6]
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4), (ra, rb)


def test_a_second_writer_is_refused_and_the_lock_released(tmp_path):
    """Two trains on one --out: the second is refused with the holder named (here: this process,
    through another open of the lock file), nothing of it is written; the lock goes with its run."""
    c = cfg(tmp_path, steps=2)
    with RunLock(c.out):
        with pytest.raises(RunLockError, match=f"in use by another writer: pid {os.getpid()} on host"):
            train(c)
        assert not (Path(c.out) / "metrics.jsonl").exists() and latest_checkpoint(c.out) is None
    train(c)
    assert not (Path(c.out) / LOCK_FILE).exists()


def test_a_fresh_start_after_a_crash_before_any_checkpoint_replaces_its_metrics(tmp_path):
    """A run killed before its first checkpoint left metric lines and no checkpoint (and a stale lock
    file): the next fresh run takes the lock over and its metrics are its own, not appended."""
    c = cfg(tmp_path, steps=3)
    run = Path(c.out)
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{}\n[2]\n{"step": 2, "lo')  # cut by the crash
    (run / LOCK_FILE).write_text('{"pid": 999999, "host": "gone", "started": "earlier"}')
    train(c)
    assert [r["step"] for r in metrics(run)] == [1, 2, 3] and metrics(run)[0]["loss"] != 9.0


def _resave(c: TrainConfig, edit) -> Path:
    """Rewrite the run's latest checkpoint through save_checkpoint (so its manifest is valid) after
    ``edit(state, tensors)``: what a bug, or a changed preset, not a damaged file, would give."""
    ckpt = load_checkpoint(latest_checkpoint(c.out))
    tensors = dict(ckpt.model)
    edit(ckpt.state, tensors)
    as_saved = SimpleNamespace(state_dict=lambda: tensors), SimpleNamespace(state_dict=lambda: ckpt.optimizer)
    return save_checkpoint(c.out, ckpt.step, *as_saved, ckpt.state)


def _set(section, key, value):
    return lambda state, tensors: state[section].__setitem__(key, value)


def _widen(state, tensors):
    tensors["embed.weight"] = torch.zeros(tensors["embed.weight"].shape[0], 48)


@pytest.mark.parametrize("edit, match", [
    (_set("model_config", "n_heads", -3), "state.json: invalid model_config \\(n_heads must be >= 1, got -3\\)"),
    (_set("model_config", "colour", 1), "state.json: invalid model_config \\(model_config: unknown key 'colour'"),
    (_set("train_config", "seq_lenn", 64), "state.json: invalid train_config \\(train_config: unknown key "
                                           "'seq_lenn' \\(did you mean 'seq_len'\\?\\)"),
    (_widen, "model.safetensors does not fit the model: embed.weight: shape \\[64, 48\\], the model has \\[64, 32\\]"),
], ids=["n_heads", "unknown-key", "train-key", "tensor-shape"])
def test_eval_and_resume_refuse_a_checkpoint_that_does_not_fit_its_configs(tmp_path, edit, match):
    c = cfg(tmp_path, steps=2)
    train(c)
    _resave(c, edit)
    with pytest.raises(CheckpointError, match=match):
        evaluate(c.out, [64], n_examples=1)
    with pytest.raises(CheckpointError, match=match):
        train(TrainConfig(**{**c.to_dict(), "steps": 4}), resume=True)


def test_eval_reads_a_checkpoint_of_its_run_by_path_or_name_and_refuses_another_runs(tmp_path):
    """A report is written into the run evaluated: a checkpoint of another run had been measured and
    written there under the wrong run's name."""
    c = cfg(tmp_path, steps=4, ckpt_every=2)
    train(c)
    run, older = Path(c.out), Path(c.out) / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    by_path = evaluate(run, [64], n_examples=2, checkpoint=str(older), name="by-path")
    by_name = evaluate(run, [64], n_examples=2, checkpoint="step_00000002", name="by-name")
    assert by_path["step"] == by_name["step"] == 2
    assert [r["accuracy"] for r in by_path["rows"]] == [r["accuracy"] for r in by_name["rows"]]
    assert evaluate(run, [64], n_examples=2, name="latest")["step"] == 4
    other = cfg(tmp_path, out=str(tmp_path / "other"), steps=2)
    train(other)
    with pytest.raises(CheckpointError, match=rf"checkpoint .*other.*step_00000002 is not one of run {run}'s "
                                              r"checkpoints \(step_00000002, step_00000004\): its report would be "
                                              rf"written into {run}; evaluate the run it belongs to"):
        evaluate(run, [64], n_examples=2, checkpoint=str(Path(other.out) / "checkpoints" / "step_00000002"))
    with pytest.raises(CheckpointError, match=rf"run {run} has no checkpoint 'step_00000003'; its checkpoints: "
                                              r"step_00000002, step_00000004"):
        evaluate(run, [64], n_examples=2, checkpoint="step_00000003")
    assert not (run / "eval.json").exists()
    (tmp_path / "untrained").mkdir()
    with pytest.raises(CheckpointError, match=r"untrained has no checkpoint \(train it first: ovqflex train --out "):
        evaluate(tmp_path / "untrained", [64], n_examples=2)


def test_a_run_saved_before_a_preset_changed_loads_its_saved_model(tmp_path, monkeypatch):
    """The saved model_config wins over what the preset builds today (named in a warning): runs
    saved before a preset change still evaluate and resume, as the model they trained."""
    from ovqflex.models.config import PRESETS

    c = cfg(tmp_path, steps=2)
    train(c)
    before = evaluate(c.out, [64], n_examples=2, name="before")
    monkeypatch.setitem(PRESETS, "tiny", {**PRESETS["tiny"], "norm_eps": 1e-3, "mlp_ratio": 2.0})
    with pytest.warns(UserWarning, match="builds another model today \\(mlp_ratio: 4.0 saved, 2.0 now; norm_eps: "
                                         "1e-05 saved, 0.001 now\\).*using its saved model_config"):
        after = evaluate(c.out, [64], n_examples=2, name="after")
    assert after["rows"] == [{**r, "seconds": a["seconds"]} for r, a in zip(before["rows"], after["rows"])]
    with pytest.warns(UserWarning, match="using its saved model_config"):
        train(TrainConfig(**{**c.to_dict(), "steps": 3}), resume=True)


def test_a_hand_edited_state_json_is_refused_by_eval(tmp_path, capsys):
    """state.json is under the manifest's checksum: an edited model_config is not silently ignored."""
    from ovqflex.cli import main

    c = cfg(tmp_path, steps=2)
    train(c)
    state = latest_checkpoint(c.out) / "state.json"
    state.write_text(state.read_text().replace('"n_heads": 2', '"n_heads": -3'))
    assert main(["eval", c.out, "--lengths", "64", "--examples", "1"]) == 2
    assert re.search("state.json is truncated or changed: .* bytes, expected .* \\(manifest.json\\)",
                     capsys.readouterr().err)


@pytest.mark.slow
def test_two_cli_trains_on_one_directory_do_not_mix(tmp_path):
    """The issue's probe: two `ovqflex train --seed 0/1` on one --out at once. One trains; the other
    is refused (the run lock, or, if it starts after the first finished, the used directory) and
    writes nothing: config.json, metrics and checkpoints are all the winner's."""
    run = tmp_path / "conc"
    common = ["train", "--out", str(run), "--steps", "20", "--seq-len", "64", "--batch-size", "4", "--ckpt-every",
              "5", "--no-compile", "--no-progress", "--log-every", "1", *CLI_MODEL]
    procs = [subprocess.Popen([sys.executable, "-m", "ovqflex.cli", *common, "--seed", str(s)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for s in (0, 1)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    winner = next(s for s, (rc, _) in enumerate(results) if rc == 0)
    assert re.search("in use by another writer: pid [0-9]+ on host|already holds a run", results[1 - winner][1])
    assert json.loads((run / "config.json").read_text())["train_config"]["seed"] == winner
    assert load_checkpoint(latest_checkpoint(run)).state["train_config"]["seed"] == winner
    assert [r["step"] for r in metrics(run)] == list(range(1, 21))


@pytest.mark.parametrize("lengths, message", [
    pytest.param([64, 512], "eval length 512 is too long for task 'icr'", id="more-keys-than-vocab"),
    pytest.param([8, 64], "eval length 8 is too short for task 'icr'", id="below-min-len"),
])
def test_eval_lengths_are_checked_before_any_evaluation(lengths, message):
    from ovqflex.tasks import make_task
    from ovqflex.training.evaluate import check_lengths

    task = make_task("icr", vocab_size=64, key_len=1, value_len=1)  # 60 content tokens: <= 60 distinct keys
    check_lengths(task, [64, 128, 256])
    with pytest.raises(ValueError, match=message):
        check_lengths(task, lengths)


def test_eval_measures_full_contexts_when_training_mixes_sizes():
    """A training-only task option (ICR ``min_pairs``) does not reach evaluation: every
    evaluated example has the full context and all ``n_queries`` targets."""
    from ovqflex.tasks import make_task
    from ovqflex.training.evaluate import evaluate_model

    task = make_task("icr", vocab_size=64, key_len=1, value_len=1, n_queries=6, min_pairs=1)
    vocab = task.vocab_size
    seen = []

    def model(x):  # records the context sizes it is shown; uniform logits
        seen.extend(int((row == 1).sum()) for row in x)  # one "→" per pair, context and queries
        return torch.zeros(*x.shape, vocab)

    rows = evaluate_model(model, task, [64, 128], n_examples=16, batch_size=8, seed=0, device=torch.device("cpu"))
    assert [r.targets for r in rows] == [16 * 6, 16 * 6]
    assert sorted(set(seen)) == [task.n_pairs(64) + 6, task.n_pairs(128) + 6]


def test_eval_examples_are_none_of_the_training_examples():
    """What ``evaluate_model`` measures at a length is none of the examples a run of that seed trains on at
    that length, in any of its first 300 steps (the training stream is a pure function of seed, step and
    index; evaluation draws from another seed): a model is never scored on the sequences it was fit to."""
    from ovqflex.tasks import make_batch, make_task
    from ovqflex.training.evaluate import eval_batches

    task = make_task("icr", vocab_size=64, key_len=1, value_len=1, n_queries=6)
    for length in (64, 128):
        measured = torch.cat([x for x, _ in eval_batches(task, length, n_examples=16, batch_size=8, seed=0)])
        trained = torch.cat([make_batch(task, seed=0, step=s, start=0, count=4, seq_len=length)[0]
                             for s in range(300)])
        assert measured.shape == (16, length) and trained.shape == (1200, length)
        shared = (measured[:, None] == trained[None]).all(-1).any(-1)
        assert not shared.any(), f"at {length}: eval examples {shared.nonzero().flatten().tolist()} are trained on"


def test_eval_examples_are_the_same_in_any_batch_size_and_distinct_within_and_across_lengths():
    """The ``n_examples`` examples measured at a length are one set, whatever the batch size splits it into,
    with no example twice; and each length draws its own (ICR's keys are every 4th token from the 2nd: the
    first six of the first example at 64 tokens are not those at 128, as they would be from one stream)."""
    from ovqflex.tasks import make_task
    from ovqflex.training.evaluate import eval_batches

    task = make_task("icr", vocab_size=64, key_len=1, value_len=1, n_queries=6)
    examples = {}
    for length in (64, 128):
        for batch_size in (2, 6, 8):
            batches = list(eval_batches(task, length, n_examples=6, batch_size=batch_size, seed=3))
            assert [x.shape[0] for x, _ in batches] == [min(batch_size, 6 - i) for i in range(0, 6, batch_size)]
            x, y = (torch.cat(t) for t in zip(*batches))
            if batch_size == 2:
                examples[length] = x, y
                assert len({tuple(row.tolist()) for row in x}) == 6
            else:
                assert torch.equal(x, examples[length][0]) and torch.equal(y, examples[length][1]), (length, batch_size)
    keys = {length: x[0, 1:25:4] for length, (x, _) in examples.items()}
    assert not torch.equal(keys[64], keys[128])


@pytest.mark.parametrize("log_every, caught_at, what", [(1, 4, "the training loss is nan"),
                                                         (5, 4, "the weights are not finite")],
                         ids=["loss-logged", "weights-before-checkpoint"])
def test_a_diverging_run_stops_without_checkpointing_non_finite_weights(tmp_path, monkeypatch, log_every, caught_at,
                                                                         what):
    """The 4th step's loss is NaN. Logged every step, the loss stops the run after step 4; logged
    every 5, the check of the weights before step 4's checkpoint does. Either way the checkpoint of
    step 2 is the run's latest, finite and kept (a rotation keeping one checkpoint would otherwise have
    replaced it), the metrics hold no NaN row, and the run directory records the divergence until a
    later train on it."""
    monkeypatch.setenv(FAULT_NAN_ENV, "4")
    c = cfg(tmp_path, steps=8, ckpt_every=2, keep_checkpoints=1, log_every=log_every)
    with pytest.raises(TrainingDiverged, match=rf"training diverged: {what} after step {caught_at}; the run stopped "
                                               r"without checkpointing it \(its latest checkpoint, .*step.*2.*, is "
                                               r"finite and kept\)") as e:
        train(c)
    assert e.value.step == caught_at and e.value.exit_code == 3
    run = Path(c.out)
    kept = load_checkpoint(e.value.checkpoint)
    assert latest_checkpoint(run) == e.value.checkpoint and kept.step == 2
    assert all(t.isfinite().all() for t in kept.model.values() if t.is_floating_point())
    assert [r["step"] for r in metrics(run)] == ([1, 2, 3] if log_every == 1 else [])
    assert diverged_step(run) == caught_at  # the run directory's record (diverged.json)
    monkeypatch.delenv(FAULT_NAN_ENV)  # the next attempt goes otherwise: it resumes and removes the record
    assert train(c, resume=True).step == 8 and diverged_step(run) is None


def test_the_cli_reports_divergence_in_one_line_with_exit_status_3(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(FAULT_NAN_ENV, "1")
    code = main(["train", "--out", str(tmp_path / "run"), "--task", "icr", "--task-opt", "vocab_size=64",
                 "--task-opt", "key_len=1", "--task-opt", "value_len=1", "--seq-len", "64", "--batch-size", "4",
                 "--steps", "3", "--no-compile", "--log-every", "1", "--no-progress", *CLI_MODEL])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3
    assert err[-1].startswith("ovqflex train: training diverged: the training loss is nan after step 1; ")
    assert "it has no checkpoint" in err[-1] and "Traceback" not in "\n".join(err)
