"""Fault injection: ``ovqflex train`` killed (SIGKILL) 24 times at random points, each restart
resuming from the newest checkpoint, ends bit-identical to a run that was never killed.

Kill points, drawn from a seeded generator, four of each per cycle:

- ``time``: from outside, a random 0-0.4 s after the restarted run logged its first step
  (anywhere: a step, a metrics line, a checkpoint being written, renamed or pruned);
- ``rename-pause``: every checkpoint pauses 0.2 s between its write and its rename (the
  checkpoint writer's test hook); killed from outside a random 0-0.15 s after the first
  checkpoint the restarted run writes appears (while it is written or pauses);
- ``rename-kill``: the writer kills itself between the write and the rename of a checkpoint
  ``2-4`` steps ahead (the hook again);
- ``after-step``: the trainer kills itself right after a step ``1-3`` steps ahead (at or between
  checkpoints).

Every round has a backstop (a self-kill 5 steps ahead), so each one dies and the run needs all
its restarts. After each kill every checkpoint directory left must load (none half-written),
at least 8 kills must have landed between a checkpoint's write and its rename, and each
restart must say it resumes from the newest checkpoint.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ovqflex.training.checkpoint import FAULT_ENV, list_checkpoints, load_checkpoint
from ovqflex.training.trainer import FAULT_KILL_ENV

STEPS, CKPT_EVERY = 100, 2
MODEL = dict(d_model=32, n_heads=2, window=16, chunk_size=16, block_size=16, **{"ovq.max_centroids": 32})
ARGS = ["train", "--task", "icr", "--task-opt", "key_len=1", "--task-opt", "value_len=1", "--seq-len", "64",
        "--batch-size", "4", "--steps", str(STEPS), "--warmup", "2", "--no-compile", "--log-every", "1",
        "--no-progress", "--ckpt-every", str(CKPT_EVERY), "--keep", "2",
        *[f"--model-opt={k}={v}" for k, v in MODEL.items()]]
MODES = ("time", "rename-pause", "rename-kill", "after-step")


def _steps_logged(run: Path) -> list[int]:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    steps = []
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass  # a line being written
    return steps


def _newest(run: Path) -> int:
    found = list_checkpoints(run)
    return int(found[-1].name.split("_")[1]) if found else 0


def _start(run: Path, env: dict, log: Path) -> subprocess.Popen:
    args = [*ARGS, "--out", str(run)] + (["--resume"] if list_checkpoints(run) else [])
    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, "-m", "ovqflex.cli", *args], stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, **env})


def _wait_for(cond, proc: subprocess.Popen, timeout: float = 300) -> bool:
    """Poll ``cond`` until it holds (True) or the process ended (False)."""
    t0 = time.monotonic()
    while not cond():
        if proc.poll() is not None:
            return False
        assert time.monotonic() - t0 < timeout, "the training process hangs"
        time.sleep(0.005)
    return True


@pytest.mark.slow
def test_24_kills_at_random_points_resume_bit_exactly(tmp_path):
    rng = random.Random(22)
    subprocess.run([sys.executable, "-m", "ovqflex.cli", *ARGS, "--out", str(tmp_path / "straight")], check=True,
                   capture_output=True, timeout=600)
    run, kills, modes, in_rename = tmp_path / "killed", 0, [], 0
    for round_ in range(24):
        mode = MODES[round_ % 4]
        newest = _newest(run)
        env = {FAULT_KILL_ENV: str(newest + 5)}  # the backstop
        if mode == "rename-pause":
            env[FAULT_ENV] = "pause=0.2"
        elif mode == "rename-kill":
            env[FAULT_ENV] = f"kill={newest + CKPT_EVERY * rng.randint(1, 2)}"
        elif mode == "after-step":
            env[FAULT_KILL_ENV] = str(newest + rng.randint(1, 3))
        log = tmp_path / f"round{round_}.log"
        proc = _start(run, env, log)
        # from outside, after its first step (older lines are gone once it says "training")
        started = lambda: "training" in log.read_text() and any(s > newest for s in _steps_logged(run))  # noqa: E731
        pausing = lambda: any((run / "checkpoints").glob(".tmp-step_*"))  # noqa: E731
        if mode == "time" and _wait_for(started, proc):
            time.sleep(rng.uniform(0.0, 0.4))
            proc.send_signal(signal.SIGKILL)
        elif mode == "rename-pause" and _wait_for(started, proc) and _wait_for(pausing, proc):
            time.sleep(rng.uniform(0.0, 0.15))  # the writer pauses 0.2 s there
            proc.send_signal(signal.SIGKILL)
        rc = proc.wait(timeout=600)
        stderr = log.read_text()
        assert rc == -signal.SIGKILL, f"round {round_} ({mode}): exit {rc}\n{stderr}"
        kills += 1
        modes.append(mode)
        # killed inside the rename window: a complete checkpoint (manifest written last) not renamed yet
        in_rename += any((p / "manifest.json").exists() for p in (run / "checkpoints").glob(".tmp-step_*"))
        # the restart resumed from the newest checkpoint there was (or, before the first, started afresh)
        resumed = f", resumed from {run / 'checkpoints' / f'step_{newest:08d}'}" if newest else ""
        assert f"training {run} from step {newest}{resumed}\n" in stderr, stderr
        for path in list_checkpoints(run):  # no checkpoint left half-written
            load_checkpoint(path)
    final = _start(run, {}, tmp_path / "final.log")
    assert final.wait(timeout=600) == 0, (tmp_path / "final.log").read_text()
    assert kills >= 20 and set(modes) == set(MODES)
    assert in_rename >= 8, f"only {in_rename} of {kills} kills landed between a checkpoint's write and its rename"
    print(f"{kills} kills ({in_rename} between a checkpoint's write and its rename), {_newest(run)} steps")

    straight = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    killed = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in killed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in killed] == [r["loss"] for r in straight]
    assert [r["grad_norm"] for r in killed] == [r["grad_norm"] for r in straight]
    a, b = (load_checkpoint(list_checkpoints(d)[-1]) for d in (tmp_path / "straight", run))
    assert a.step == b.step == STEPS
    assert all(torch.equal(a.model[k], b.model[k]) for k in a.model)
    for i, state in a.optimizer["state"].items():
        assert all(torch.equal(v, b.optimizer["state"][i][n]) for n, v in state.items() if torch.is_tensor(v))
    assert not list((run / "checkpoints").glob(".*")) and not list(run.glob(".*"))
    assert not (run / "run.lock").exists()
