"""The runner: output directory rules, and one tiny experiment end to end -- killed during its
first training run, resumed (training continues from the checkpoint, complete units are
skipped), a damaged evaluation report redone alone, runs without checkpoints; one stopped
cleanly by SIGTERM; and its runs in worker processes (``jobs``): the same training, stopped with
checkpoints when the parent gets SIGTERM or dies, a dead worker reported by name."""
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ovqflex
from ovqflex.experiments import (EvalSetting, Experiment, ExperimentFailed, ModelSpec, Scale, plan, run_experiment,
                                 spec_differences)
from ovqflex.experiments import runner as runner_mod
from ovqflex.experiments.registry import DICTIONARY_SWEEP
from ovqflex.training import latest_checkpoint
from ovqflex.training.checkpoint import load_checkpoint, read_state
from ovqflex.training.trainer import FAULT_KILL_ENV, FAULT_NAN_ENV, FAULT_SIGNAL_ENV

# a model small enough that a step takes milliseconds; eval on the blocked backend (no compilation)
MODEL = dict(d_model=32, n_heads=2, window=16, chunk_size=16, block_size=16, **{"ovq.max_centroids": 32})
TASK = dict(vocab_size=256, key_len=2, value_len=1)


def tiny(steps: int = 4, ckpt_every: int = 2, compile: bool = False) -> Experiment:
    scale = Scale(preset="tiny", seq_len=64, steps=steps, batch_size=4, eval_lengths=(64, 128), task_options=TASK,
                  model_options=MODEL, warmup=1, ckpt_every=ckpt_every,
                  train_options={"compile": compile, "log_every": 1},
                  eval_examples=4, eval_batch_size=4, eval_overrides={"backend": "blocked"})
    return Experiment("tiny", "test", "icr", (ModelSpec("sw-ovq", "swa,ovq"), ModelSpec("sw-linear", "swa,linear")),
                      {"s": scale}, seeds=(0,), sweeps=(DICTIONARY_SWEEP,))


def run_tiny(out, resume=False, log=print, jobs=1, steps=4, ckpt_every=2, progress_every=60.0, drop_checkpoints=False):
    return run_experiment(plan(tiny(steps, ckpt_every), "s", out, progress=False), resume=resume, log=log, jobs=jobs,
                          progress_every=progress_every, drop_checkpoints=drop_checkpoints)


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
    saved = json.loads((tmp_path / "new" / "experiment.json").read_text())
    (tmp_path / "new" / "experiment.json").write_text(json.dumps({**saved, **{f"x{i}": i for i in range(10)}}))
    with pytest.raises(ValueError, match=r"\(x0: present in the directory, absent now; .*; x7: present in the "
                                         r"directory, absent now; and 2 more\)$"):
        runner_mod.prepare_out(p, resume=True)  # the first 8 differences named, the rest counted
    (tmp_path / "new" / "experiment.json").write_text("{")
    with pytest.raises(ValueError, match=r"experiment.json is not valid JSON \(.*\); choose another --out$"):
        runner_mod.prepare_out(p, resume=True)


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


def test_resume_may_add_test_time_variants_evaluated_from_the_final_checkpoint(tmp_path, monkeypatch):
    """An experiment that gained a test-time evaluation resumes a directory of the older one: only the
    new evaluation runs (from each run's final checkpoint) and its line joins the results; going back
    to the older spec (dropping the variant) is refused by name. A run whose checkpoints were deleted
    is refused before experiment.json is touched, not trained again."""
    run_tiny(tmp_path / "a", log=lambda line: None)
    run_tiny(tmp_path / "b", log=lambda line: None, drop_checkpoints=True)
    extended = dataclasses.replace(tiny(), sweeps=tiny().sweeps + (EvalSetting("max_centroids", 48, ("sw-ovq",)),))
    seen = []
    real_evaluate = runner_mod.evaluate

    def evaluate(run_dir, *a, **k):
        seen.append((Path(run_dir).name, k["overrides"]))
        return real_evaluate(run_dir, *a, **k)

    monkeypatch.setattr(runner_mod, "evaluate", evaluate)
    lines = []
    res = run_experiment(plan(extended, "s", tmp_path / "a", progress=False), resume=True, log=lines.append)
    assert lines[0] == f"extending {tmp_path / 'a'}: adds variant sw-ovq max_centroids=48"
    assert "7 units" in lines[1] and "(6 already complete)" in lines[1]
    assert seen == [("sw-ovq-s0", {"backend": "blocked", "max_centroids": 48})]
    assert [line["label"] for line in res["lines"]] == ["sw-ovq", "sw-ovq N×2", "sw-ovq N×4",
                                                        "sw-ovq max_centroids=48", "sw-linear"]
    report = json.loads((tmp_path / "a" / "sw-ovq-s0" / "eval-max_centroids-48.json").read_text())
    assert report["step"] == 4 and report["overrides"]["max_centroids"] == 48
    with pytest.raises(ValueError, match=r"models.sw-ovq.variants: 'sw-ovq max_centroids=48' \{'max_centroids': 48\} "
                                         r"in the directory, absent now \(a resume may add variants"):
        runner_mod.prepare_out(plan(tiny(), "s", tmp_path / "a", progress=False), resume=True)
    before = (tmp_path / "b" / "experiment.json").read_text()
    with pytest.raises(ValueError, match=r"these runs have evaluations on disk but no checkpoint .*: sw-ovq-s0 \(on "
                                         r"disk: sw-ovq, sw-ovq N×2, sw-ovq N×4; to evaluate: sw-ovq max_centroids=48\)"):
        run_experiment(plan(extended, "s", tmp_path / "b", progress=False), resume=True, log=lines.append)
    assert (tmp_path / "b" / "experiment.json").read_text() == before


def test_a_compiled_run_logs_what_compiling_did(tmp_path, eager_backend_compile):
    """Each trained run's line ends with the trainer's compile summary."""
    lines = []
    run_experiment(plan(tiny(compile=True), "s", tmp_path / "x", progress=False), log=lines.append)
    trained = [line for line in lines if ": trained in " in line]
    assert len(trained) == 2 and all(line.endswith("no graph break, no recompile") for line in trained), trained


def test_spec_differences_names_fields():
    a = {"train": {"steps": 1, "lr": 0.1}, "models": {"x": {"pattern": "swa"}}}
    b = {"train": {"steps": 1, "lr": 0.2}, "models": {"x": {"pattern": "swa"}, "y": {"pattern": "ovq"}}}
    assert spec_differences(a, b) == ["models.y: absent in the directory, present now",
                                      "train.lr: 0.1 in the directory vs 0.2 now"]
    assert spec_differences(a, a) == []


def _child(body: str, **env) -> tuple[list[str], dict]:
    """The command line and environment of a Python process that runs ``body`` with this module imported as
    ``t`` (and ``sys``), the project on its path, and the variables ``env`` (e.g. a fault to inject) set."""
    root = Path(ovqflex.__file__).resolve().parents[1]
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_experiment_runner as t\n{body}"
    path = f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return [sys.executable, "-c", code], {**os.environ, **env, "PYTHONPATH": path}


def test_sigterm_stops_the_experiment_after_a_step_and_resume_continues_from_it(tmp_path):
    """SIGTERM right after step 3 of the first run (checkpoints every 2): it stops with a checkpoint
    of step 3, and --resume continues from that step."""
    out = tmp_path / "exp"
    argv, env = _child(f"from ovqflex.training import TrainingInterrupted\n"
                       f"try:\n    t.run_tiny({str(out)!r})\n"
                       f"except TrainingInterrupted as e:\n    print(e)\n    sys.exit(e.exit_code)",
                       **{FAULT_SIGNAL_ENV: "3"})
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 143, proc.stderr
    assert "stopped by SIGTERM after step 3: checkpoint" in proc.stdout
    assert sorted(p.name for p in (out / "sw-ovq-s0" / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]
    lines = []
    run_tiny(out, resume=True, log=lines.append)
    assert "[1/6] train sw-ovq seed 0: 4 steps x 4 x 64 tokens, resuming from step 3" in "\n".join(lines)


def _run_tiny_killed_after(out: Path, step: int) -> subprocess.CompletedProcess:
    """``run_tiny(out)`` in a process that kills itself (SIGKILL) right after training step ``step``."""
    argv, env = _child(f"t.run_tiny({str(out)!r})", **{FAULT_KILL_ENV: str(step)})
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == -9, proc.stderr
    return proc


def test_killed_experiment_resumes_and_skips_complete_units(tmp_path, monkeypatch):
    out = tmp_path / "exp"
    # 1. a process killed (SIGKILL) right after step 3 of the first run, which has a checkpoint at step 2
    proc = _run_tiny_killed_after(out, 3)
    assert "[1/6] train sw-ovq seed 0: 4 steps x 4 x 64 tokens, from scratch" in proc.stdout
    assert (out / "sw-ovq-s0" / "checkpoints" / "step_00000002").is_dir() and not (out / "results.json").exists()

    # 2. resume: the run continues from step 2, everything else runs once
    lines = []
    res = run_tiny(out, resume=True, log=lines.append)
    text = "\n".join(lines)
    assert "[1/6] train sw-ovq seed 0: 4 steps x 4 x 64 tokens, resuming from step 2" in text
    assert "[5/6] train sw-linear seed 0: 4 steps x 4 x 64 tokens, from scratch" in text
    assert "elapsed" in text and "ETA" in text and "length     128: accuracy" in text
    assert _logged_steps(out / "sw-ovq-s0") == [1, 2, 3, 4]  # the killed run's step-3 line was dropped on resume
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


@pytest.mark.parametrize("jobs", [1, 2], ids=["in-order", "workers"])
def test_drop_checkpoints_deletes_a_runs_checkpoints_after_its_last_evaluation(tmp_path, monkeypatch, jobs):
    """drop_checkpoints: each evaluation of a run still reads its checkpoint (in this process: checked
    at every call), the run's checkpoints are gone once its last report is written, the reports and
    results stay, and a resume finds every unit complete."""
    seen = []
    real_evaluate = runner_mod.evaluate

    def evaluate(run_dir, *a, **k):
        seen.append((Path(run_dir).name, latest_checkpoint(run_dir) is not None))
        return real_evaluate(run_dir, *a, **k)

    monkeypatch.setattr(runner_mod, "evaluate", evaluate)
    lines = []
    res = run_tiny(tmp_path, log=lines.append, jobs=jobs, drop_checkpoints=True)
    if jobs == 1:
        assert seen == [("sw-ovq-s0", True)] * 3 + [("sw-linear-s0", True)]
    for run, reports in (("sw-ovq-s0", 3), ("sw-linear-s0", 1)):
        assert not (tmp_path / run / "checkpoints").exists()
        assert len(list((tmp_path / run).glob("eval-*.json"))) == reports
        assert f"    {run}: its evaluations are complete; deleted its checkpoints" in "\n".join(lines)
    assert [line["label"] for line in res["lines"]] == ["sw-ovq", "sw-ovq N×2", "sw-ovq N×4", "sw-linear"]
    lines.clear()
    assert run_tiny(tmp_path, resume=True, log=lines.append, drop_checkpoints=True)["lines"] == res["lines"]
    assert "(6 already complete)" in lines[0] and "deleted" not in "\n".join(lines)


def test_drop_checkpoints_on_resume_deletes_those_of_complete_runs_only(tmp_path):
    """A resume with drop_checkpoints deletes, before anything runs, the checkpoints of the runs whose
    evaluations are all on disk, and keeps a run's whose evaluation is missing (it is evaluated again from
    them, then they go)."""
    run_tiny(tmp_path, log=lambda line: None)
    assert latest_checkpoint(tmp_path / "sw-ovq-s0") is not None
    (tmp_path / "sw-ovq-s0" / "eval-max_centroids-x2.json").unlink()
    lines = []
    run_tiny(tmp_path, resume=True, log=lines.append, drop_checkpoints=True)
    text = "\n".join(lines)
    assert "(5 already complete)" in lines[0]
    assert lines[1].startswith("    sw-linear-s0: its evaluations are complete; deleted its checkpoints")
    assert text.index("[3/6] eval sw-ovq seed 0 (N×2)") < text.index("sw-ovq-s0: its evaluations are complete")
    assert not any((tmp_path / run / "checkpoints").exists() for run in ("sw-ovq-s0", "sw-linear-s0"))


def _latest_step(run_dir: Path) -> int | None:
    ckpt = latest_checkpoint(run_dir)
    return None if ckpt is None else int(read_state(ckpt)["step"])


def _logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def test_runs_in_worker_processes_train_what_one_process_trains(tmp_path, monkeypatch):
    """jobs=2: every unit runs once, each run in its own process with this process's threads shared among
    the runs at a time, with the weights a run in this process gets (one thread each: bit for bit); a resume
    then finds everything complete."""
    lines, started = [], []
    real_start = runner_mod._start_worker

    def start(ctx, plan, units, threads):
        started.append((units, threads))
        return real_start(ctx, plan, units, threads)

    monkeypatch.setattr(runner_mod, "_start_worker", start)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # (one under xdist) shared by two runs at a time: one each
    try:
        res = run_tiny(tmp_path / "two", log=lines.append, jobs=2)
    finally:
        torch.set_num_threads(before)
    assert started == [([0, 1, 2, 3], 1), ([4, 5], 1)]
    text = "\n".join(lines)
    assert "6 units into" in lines[0] and lines[0].endswith(", 2 runs at a time")
    for unit in ("[1/6] train sw-ovq seed 0", "[4/6] eval sw-ovq seed 0 (N×4)", "[5/6] train sw-linear seed 0"):
        assert text.count(f"{unit}:") >= 1, unit
    assert "    [6/6] length     128: accuracy" in text  # a worker's lines name their unit
    assert [line["label"] for line in res["lines"]] == ["sw-ovq", "sw-ovq N×2", "sw-ovq N×4", "sw-linear"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = run_tiny(tmp_path / "one", log=lambda line: None)
    finally:
        torch.set_num_threads(threads)
    assert one["lines"] == res["lines"]
    for run in ("sw-ovq-s0", "sw-linear-s0"):
        a, b = (load_checkpoint(latest_checkpoint(tmp_path / d / run)).model for d in ("two", "one"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), run
    lines.clear()
    run_tiny(tmp_path / "two", resume=True, log=lines.append, jobs=2)
    assert "(6 already complete)" in lines[0]


def test_a_worker_that_dies_is_named_and_the_experiment_fails(tmp_path, monkeypatch):
    """Both workers inherit the fault: each is killed after its step 3. The first to die is named;
    the other is asked to stop (it stops, or dies of the fault first)."""
    monkeypatch.setenv(FAULT_KILL_ENV, "3")
    with pytest.raises(ExperimentFailed) as failure:
        run_tiny(tmp_path, log=lambda line: None, jobs=2)
    first = re.match(r"(sw-ovq|sw-linear) seed 0: its process ended \(signal SIGKILL\) during \[(1|5)/6\] train "
                     r"\1 seed 0\n(.|\n)*continue with --resume$", str(failure.value))
    assert first, str(failure.value)
    assert _latest_step(tmp_path / f"{first[1]}-s0") == 2


def test_a_diverging_run_is_a_result_and_the_experiment_goes_on(tmp_path, monkeypatch):
    """sw-ovq's loss is NaN from its 3rd step: its training stops there (its step-2 checkpoint kept,
    its directory recording the divergence), its evaluations are skipped, sw-linear trains and is
    evaluated, and the results count sw-ovq's seed as diverged. A resume leaves it so."""
    real_train = runner_mod.train

    def train(cfg, **kw):
        if cfg.out.endswith("sw-ovq-s0"):
            monkeypatch.setenv(FAULT_NAN_ENV, "3")
        try:
            return real_train(cfg, **kw)
        finally:
            monkeypatch.delenv(FAULT_NAN_ENV, raising=False)

    monkeypatch.setattr(runner_mod, "train", train)
    lines = []
    res = run_tiny(tmp_path, log=lines.append)
    assert _latest_step(tmp_path / "sw-ovq-s0") == 2 and not list((tmp_path / "sw-ovq-s0").glob("eval-*"))
    assert any("train sw-ovq seed 0: training diverged: the training loss is nan after step 3" in line
               for line in lines)
    assert sum("skipped, the run diverged after step 3" in line for line in lines) == 3  # its 3 evaluations
    by_label = {line["label"]: line for line in res["lines"]}
    assert all(by_label[k]["diverged"] == {"0": 3} and by_label[k]["seeds"] == 0 for k in by_label
               if k.startswith("sw-ovq"))
    assert by_label["sw-linear"]["diverged"] == {} and by_label["sw-linear"]["seeds"] == 1
    assert "0/1, 1 diverged" in res["table"] and "0/1, 1 diverged" in (tmp_path / "results.md").read_text()
    lines.clear()
    run_tiny(tmp_path, resume=True, log=lines.append)
    assert "6 units into" in lines[0] and "(2 already complete, 4 of runs that diverged)" in lines[0]
    assert sum("skipped, the run diverged after step 3" in line for line in lines) == 4  # train and evaluations


def test_diverging_runs_in_workers_are_results_too(tmp_path, monkeypatch):
    """Both runs' losses are NaN from their 3rd step (the workers inherit the fault): the experiment
    completes with every line diverged."""
    monkeypatch.setenv(FAULT_NAN_ENV, "3")
    res = run_tiny(tmp_path, log=lambda line: None, jobs=2)
    assert all(line["diverged"] == {"0": 3} and line["seeds"] == 0 for line in res["lines"])
    assert _latest_step(tmp_path / "sw-ovq-s0") == 2 and _latest_step(tmp_path / "sw-linear-s0") == 2


def test_jobs_must_be_a_positive_int(tmp_path):
    for bad, match in ((0, "jobs must be >= 1, got 0"), (1.5, "jobs must be an int, got float 1.5")):
        with pytest.raises((ValueError, TypeError), match=match):
            run_tiny(tmp_path, jobs=bad)
    assert not tmp_path.joinpath("experiment.json").exists()


def _start_parallel(out: Path, steps: int, resume: bool) -> subprocess.Popen:
    argv, env = _child(f"from ovqflex.experiments import ExperimentInterrupted\n"
                       f"try:\n    t.run_tiny({str(out)!r}, resume={resume}, jobs=2, steps={steps}, ckpt_every=50)\n"
                       f"except ExperimentInterrupted as e:\n    print(e)\n    sys.exit(e.exit_code)")
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _when(condition, proc: subprocess.Popen | None = None, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc is None or proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _stopped_where_it_logged(run: Path, steps: int) -> bool:
    """The run's latest checkpoint is its last logged step, short of the end: it stopped after a step
    with a checkpoint of it (every 50 steps otherwise)."""
    logged = _logged_steps(run)
    return bool(logged) and _latest_step(run) == logged[-1] < steps


def test_sigterm_or_death_of_the_parent_stops_its_workers_with_checkpoints(tmp_path):
    """SIGTERM to the parent (what ``timeout --foreground`` sends it alone) is passed on to both
    workers: each stops after its step in flight with a checkpoint, and the parent exits 143 naming
    them. SIGKILL of the parent: the workers stop the same way on their own. A resume then finishes,
    with a line of each run's progress every ``progress_every`` seconds."""
    out, steps = tmp_path / "exp", 400
    runs = [out / "sw-ovq-s0", out / "sw-linear-s0"]
    proc = _start_parallel(out, steps, resume=False)
    _when(lambda: all(_logged_steps(r) for r in runs), proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 143, stderr
    assert re.search(r"stopped by SIGTERM: sw-ovq seed 0: stopped after step \d+: checkpoint \S+sw-ovq-s0\S+; "
                     r"sw-linear seed 0: stopped after step \d+: checkpoint \S+; continue with --resume$", stdout), \
        stdout
    assert all(_stopped_where_it_logged(r, steps) for r in runs)

    stopped = [_latest_step(r) for r in runs]
    proc = _start_parallel(out, steps, resume=True)
    _when(lambda: all(len(_logged_steps(r)) > n for r, n in zip(runs, stopped)), proc)
    proc.kill()
    proc.communicate()
    sizes = []

    def settled():  # both stopped with a checkpoint of their last step, and nothing more is logged
        sizes.append([len(_logged_steps(r)) for r in runs])
        return len(sizes) > 20 and sizes[-1] == sizes[-21] and all(_stopped_where_it_logged(r, steps) for r in runs)

    _when(settled, seconds=120)
    killed = [_latest_step(r) for r in runs]
    assert all(k > n for k, n in zip(killed, stopped))

    lines = []
    res = run_tiny(out, resume=True, log=lines.append, jobs=2, steps=steps, ckpt_every=50, progress_every=0.2)
    text = "\n".join(lines)
    line = r"^    running \(elapsed \d+s[^)]*\): .*train sw-ovq seed 0 step \d+/400, loss \d\.\d{3}, [\d,]+ tokens/s"
    assert re.search(line, text, re.M), text  # each run's progress, while the bars are off
    for r, k, head in zip(runs, killed, ("[1/6] train sw-ovq", "[5/6] train sw-linear")):
        assert f"{head} seed 0: {steps} steps x 4 x 64 tokens, resuming from step {k} -> {r}" in text
        assert _logged_steps(r) == list(range(1, steps + 1))
    assert [line["label"] for line in res["lines"]] == ["sw-ovq", "sw-ovq N×2", "sw-ovq N×4", "sw-linear"]


def test_a_run_that_died_before_its_first_checkpoint_trains_again_from_scratch(tmp_path):
    """Killed after step 1 (checkpoints every 2): the run directory holds its config and step 1's
    metrics but no checkpoint; the resume trains it from scratch, and its metrics hold each step once."""
    out = tmp_path / "exp"
    _run_tiny_killed_after(out, 1)
    run = out / "sw-ovq-s0"
    assert _logged_steps(run) == [1] and latest_checkpoint(run) is None
    lines = []
    run_tiny(out, resume=True, log=lines.append)
    assert "[1/6] train sw-ovq seed 0: 4 steps x 4 x 64 tokens, from scratch" in "\n".join(lines)
    assert _logged_steps(run) == [1, 2, 3, 4] and _latest_step(run) == 4


def test_eta_shares_the_work_left_among_the_runs_at_a_time(tmp_path):
    """The ETA is the mean time of each kind of unit times the units left, divided by the runs in
    progress at once: ``jobs``, or fewer when fewer runs are left."""
    p = plan(tiny(), "s", tmp_path, progress=False)  # sw-ovq: train + 3 evaluations; sw-linear: train + 1
    every = [True] * len(p.units)
    last_run = [u.run.model.label == "sw-linear" for u in p.units]
    for jobs, todo, eta in ((1, every, "28s"), (2, every, "14s"), (2, last_run, "12s")):
        clock = runner_mod._Clock(p.units, jobs)
        clock.add("train", 8.0)
        clock.add("train", 12.0)
        clock.add("eval", 2.0)
        assert clock.status(todo) == f"elapsed 0s, ETA {eta}", (jobs, eta)
    clock = runner_mod._Clock(p.units, 2)
    assert clock.status(every) == "elapsed 0s"
    clock.add("eval", 3.0)
    assert clock.status(every) == "elapsed 0s, ETA 6s + the train units"


class _Exited:
    """A worker process that has exited with ``exitcode`` (what :meth:`_Worker.close` reads)."""

    def __init__(self, exitcode: int):
        self.exitcode = exitcode

    def join(self):
        pass


class _Pipe:
    def close(self):
        pass


@pytest.mark.parametrize("exitcode, asked, current, end, outcome", [
    (0, False, None, None, None),
    (-9, False, 4, None, ("failed", "its process ended (signal SIGKILL) during [5/6] train sw-linear seed 0", 0)),
    (-15, True, 1, None, ("stopped", "its process ended (signal SIGTERM) during [2/6] eval sw-ovq seed 0",
                          signal.SIGTERM)),
    (3, True, None, None, ("stopped", "its process ended (exit code 3)", signal.SIGTERM)),
    (143, True, 0, ("stopped", "stopped after step 3", signal.SIGTERM), ("stopped", "stopped after step 3",
                                                                         signal.SIGTERM)),
    (1, False, 0, ("failed", "Traceback ..."), ("failed", "Traceback ...", 0)),
], ids=["ran-all", "died", "died-when-asked", "exited-when-asked", "said-stopped", "said-failed"])
def test_how_a_worker_ended(tmp_path, exitcode, asked, current, end, outcome):
    """A worker that dies is a failure, unless it was asked to stop (an evaluation has no handler of
    the signal it is passed: it dies of it); what a worker said before it ended is how it ended."""
    p = plan(tiny(), "s", tmp_path, progress=False)
    w = runner_mod._Worker(_Exited(exitcode), _Pipe(), _Pipe(), [0], "sw-ovq seed 0", current=current, end=end,
                           asked=asked)
    assert w.close(p) == outcome


def test_the_progress_line_reads_a_runs_last_whole_metrics_line(tmp_path):
    """A worker's progress shows its run's last metrics line; a line still being written (or no file, or
    an empty one) shows nothing rather than failing the parent."""
    assert runner_mod._last_metrics(tmp_path) is None
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("")
    assert runner_mod._last_metrics(tmp_path) is None
    metrics.write_text('{"step": 2, "loss": 1.5, "tokens_per_s": 900.0}\n')
    assert runner_mod._last_metrics(tmp_path) == {"step": 2, "loss": 1.5, "tokens_per_s": 900.0}
    metrics.write_text('{"step": 2, "loss": 1.5, "tokens_per_s": 900.0}\n{"step": 3, "lo')
    assert runner_mod._last_metrics(tmp_path) is None
