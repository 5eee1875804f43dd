"""The runner: output directory rules, and one tiny experiment end to end -- killed during its
first training run, resumed (training continues from the checkpoint, complete units are
skipped), a damaged evaluation report redone alone, runs without checkpoints; and one stopped
cleanly by SIGTERM."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ovqflex
from ovqflex.experiments import Experiment, ModelSpec, Scale, plan, run_experiment, spec_differences
from ovqflex.experiments import runner as runner_mod
from ovqflex.experiments.registry import DICTIONARY_SWEEP
from ovqflex.training.trainer import FAULT_KILL_ENV, FAULT_SIGNAL_ENV

# a model small enough that a step takes milliseconds; eval on the blocked backend (no compilation)
MODEL = dict(d_model=32, n_heads=2, window=16, chunk_size=16, block_size=16, **{"ovq.max_centroids": 32})
TASK = dict(vocab_size=256, key_len=2, value_len=1)


def tiny(steps: int = 4) -> Experiment:
    scale = Scale(preset="tiny", seq_len=64, steps=steps, batch_size=4, eval_lengths=(64, 128), task_options=TASK,
                  model_options=MODEL, warmup=1, ckpt_every=2, train_options={"compile": False, "log_every": 1},
                  eval_examples=4, eval_batch_size=4, eval_overrides={"backend": "blocked"})
    return Experiment("tiny", "test", "icr", (ModelSpec("sw-ovq", "swa,ovq"), ModelSpec("sw-linear", "swa,linear")),
                      {"s": scale}, seeds=(0,), sweeps=(DICTIONARY_SWEEP,))


def run_tiny(out, resume=False, log=print):
    return run_experiment(plan(tiny(), "s", out, progress=False), resume=resume, log=log)


def test_out_directory_rules(tmp_path):
    p = plan(tiny(), "s", tmp_path / "out", progress=False)
    with pytest.raises(ValueError, match="holds no experiment to resume"):
        runner_mod.prepare_out(p, resume=True)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="is not empty and holds no experiment.json"):
        runner_mod.prepare_out(p, resume=False)
    p = plan(tiny(), "s", tmp_path / "new", progress=False)
    runner_mod.prepare_out(p, resume=False)
    assert json.loads((tmp_path / "new" / "experiment.json").read_text()) == p.spec()
    with pytest.raises(ValueError, match="already holds an experiment .* pass --resume"):
        runner_mod.prepare_out(p, resume=False)
    runner_mod.prepare_out(p, resume=True)  # same spec: fine
    other = plan(tiny(steps=6), "s", tmp_path / "new", seeds=[0, 1], progress=False)
    with pytest.raises(ValueError, match=r"different experiment spec \(train.steps: 4 in the directory vs 6 now\)"):
        runner_mod.prepare_out(other, resume=True)


def test_resume_may_add_seeds_and_models_but_not_drop_them(tmp_path):
    """A resume with more seeds or models rewrites experiment.json with them; one that drops a seed or
    a model, or changes a model, is refused by name."""
    one = tiny()
    one = Experiment(one.name, one.description, one.task, one.models[:1], one.scales, seeds=(0,), sweeps=one.sweeps)
    runner_mod.prepare_out(plan(one, "s", tmp_path, progress=False), resume=False)
    lines = []
    more = plan(tiny(), "s", tmp_path, seeds=[0, 1], progress=False)
    runner_mod.prepare_out(more, resume=True, log=lines.append)
    assert lines == [f"extending {tmp_path}: adds seed 1, model sw-linear"]
    assert json.loads((tmp_path / "experiment.json").read_text()) == more.spec()
    with pytest.raises(ValueError, match=r"seeds: \[0, 1\] in the directory vs \[1\] now \(a resume may add seeds, "
                                         r"not drop \[0\]\); models.sw-linear: present in the directory, absent now"):
        runner_mod.prepare_out(plan(one, "s", tmp_path, seeds=[1], progress=False), resume=True)
    changed = dict(MODEL, window=8)
    scale = dataclasses.replace(one.scales["s"], model_options=changed)
    other = Experiment(one.name, one.description, one.task, tiny().models, {"s": scale}, seeds=(0, 1),
                       sweeps=one.sweeps)
    with pytest.raises(ValueError, match=r"models.sw-linear.config.window: 16 in the directory vs 8 now"):
        runner_mod.prepare_out(plan(other, "s", tmp_path, progress=False), resume=True)


def test_spec_differences_names_fields():
    a = {"train": {"steps": 1, "lr": 0.1}, "models": {"x": {"pattern": "swa"}}}
    b = {"train": {"steps": 1, "lr": 0.2}, "models": {"x": {"pattern": "swa"}, "y": {"pattern": "ovq"}}}
    assert spec_differences(a, b) == ["models.y: absent in the directory, present now",
                                      "train.lr: 0.1 in the directory vs 0.2 now"]
    assert spec_differences(a, a) == []


def test_sigterm_stops_the_experiment_after_a_step_and_resume_continues_from_it(tmp_path):
    """SIGTERM right after step 3 of the first run (checkpoints every 2): it stops with a checkpoint
    of step 3, and --resume continues from that step."""
    out = tmp_path / "exp"
    root = Path(ovqflex.__file__).resolve().parents[1]
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_experiment_runner as t\n"
            f"from ovqflex.training import TrainingInterrupted\n"
            f"try:\n    t.run_tiny({str(out)!r})\n"
            f"except TrainingInterrupted as e:\n    print(e)\n    sys.exit(e.exit_code)")
    env = {**os.environ, FAULT_SIGNAL_ENV: "3", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 143, proc.stderr
    assert "stopped by SIGTERM after step 3: checkpoint" in proc.stdout
    assert sorted(p.name for p in (out / "sw-ovq-s0" / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]
    lines = []
    run_tiny(out, resume=True, log=lines.append)
    assert "[1/6] train sw-ovq seed 0: 4 steps x 4 x 64 tokens, resuming from step 3" in "\n".join(lines)


def test_killed_experiment_resumes_and_skips_complete_units(tmp_path, monkeypatch):
    out = tmp_path / "exp"
    # 1. a process killed (SIGKILL) right after step 3 of the first run, which has a checkpoint at step 2
    root = Path(ovqflex.__file__).resolve().parents[1]
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_experiment_runner as t; "
            f"t.run_tiny({str(out)!r})")
    env = {**os.environ, FAULT_KILL_ENV: "3", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == -9, proc.stderr
    assert "[1/6] train sw-ovq seed 0: 4 steps x 4 x 64 tokens, from scratch" in proc.stdout
    assert (out / "sw-ovq-s0" / "checkpoints" / "step_00000002").is_dir() and not (out / "results.json").exists()

    # 2. resume: the run continues from step 2, everything else runs once
    lines = []
    res = run_tiny(out, resume=True, log=lines.append)
    text = "\n".join(lines)
    assert "[1/6] train sw-ovq seed 0: 4 steps x 4 x 64 tokens, resuming from step 2" in text
    assert "[5/6] train sw-linear seed 0: 4 steps x 4 x 64 tokens, from scratch" in text
    assert "elapsed" in text and "ETA" in text and "length     128: accuracy" in text
    steps = [json.loads(line)["step"] for line in (out / "sw-ovq-s0" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # the killed run's step-3 line was dropped on resume
    assert [line["label"] for line in res["lines"]] == ["sw-ovq", "sw-ovq N×2", "sw-ovq N×4", "sw-linear"]
    assert all(pt["n"] == 1 and 0 <= pt["mean"] <= 1 for line in res["lines"] for pt in line["points"])
    x4 = json.loads((out / "sw-ovq-s0" / "eval-max_centroids-x4.json").read_text())
    assert x4["overrides"] == {"backend": "blocked", "max_centroids": 128}
    for name in ("results.json", "results.md", "results.png"):
        assert (out / name).stat().st_size > 100

    # 3. resume again: nothing to do; a damaged report is redone alone
    calls = []
    real_evaluate, real_train = runner_mod.evaluate, runner_mod.train
    monkeypatch.setattr(runner_mod, "train", lambda *a, **k: calls.append("train"))
    monkeypatch.setattr(runner_mod, "evaluate", lambda *a, **k: (calls.append("eval"), real_evaluate(*a, **k))[1])
    lines.clear()
    again = run_tiny(out, resume=True, log=lines.append)
    assert calls == [] and "(6 already complete)" in lines[0]
    assert again["lines"] == res["lines"]
    (out / "sw-linear-s0" / "eval-base.json").write_text('{"rows": [')
    lines.clear()
    run_tiny(out, resume=True, log=lines.append)
    assert calls == ["eval"] and "(5 already complete)" in lines[0]
    assert "[6/6] eval sw-linear seed 0: 4 examples" in "\n".join(lines)

    # 4. a run whose evaluations are all on disk needs no checkpoint: deleting them retrains nothing
    for run in ("sw-ovq-s0", "sw-linear-s0"):
        shutil.rmtree(out / run / "checkpoints")
    lines.clear()
    assert run_tiny(out, resume=True, log=lines.append)["lines"] == res["lines"]
    assert calls == ["eval"] and "(6 already complete)" in lines[0]
    # ... but a run with an evaluation to redo is trained again, from scratch: the same result (deterministic CPU)
    (out / "sw-linear-s0" / "eval-base.json").unlink()
    lines.clear()
    monkeypatch.setattr(runner_mod, "train", lambda *a, **k: (calls.append("train"), real_train(*a, **k))[1])
    assert run_tiny(out, resume=True, log=lines.append)["lines"] == res["lines"]
    assert calls == ["eval", "train", "eval"]
    assert "[5/6] train sw-linear seed 0: 4 steps x 4 x 64 tokens, from scratch" in "\n".join(lines)
