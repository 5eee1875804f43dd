"""The learning-rate pilot: each run of a plan at each lr for the first steps of its whole schedule,
its table, a second call that reads what is done, and what it refuses."""
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ovqflex.experiments import plan
from ovqflex.experiments import pilot as pilot_mod
from ovqflex.experiments.pilot import lr_pilot, summarize, table
from ovqflex.training import latest_checkpoint, train
from ovqflex.training.trainer import FAULT_NAN_ENV

from .test_experiment_runner import tiny


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_each_lr_trains_the_first_steps_of_the_whole_runs_schedule(tmp_path):
    """A 6-step run, piloted for 3 steps at two lrs: each pilot's rows are the first 3 of the whole
    6-step run at that lr trained straight (the cosine decay over 6 steps, not 3); checkpoints are
    deleted; the table has a row per lr."""
    p = plan(tiny(steps=6), "s", tmp_path / "exp", models=["sw-linear"], progress=False)
    lines = []
    rows = lr_pilot(p, [2e-3, 1e-2], 3, out=tmp_path / "pilot", log=lines.append)
    assert [(r["model"], r["seed"], r["lr"], r["steps"]) for r in rows] == [("sw-linear", 0, 2e-3, 3),
                                                                          ("sw-linear", 0, 1e-2, 3)]
    for lr in (2e-3, 1e-2):
        run = tmp_path / "pilot" / f"sw-linear-s0-lr{lr:g}"
        straight = tmp_path / f"straight-{lr:g}"
        train(dataclasses.replace(p.runs[0].train, lr=lr, out=str(straight)))
        keys = ("step", "loss", "accuracy", "lr")
        assert [{k: r[k] for k in keys} for r in _metrics(run)] == [{k: r[k] for k in keys}
                                                                    for r in _metrics(straight)][:3]
        assert latest_checkpoint(run) is None
    assert _metrics(tmp_path / "straight-0.01")[2]["lr"] < 1e-2  # step 3 is on the decay of the 6-step schedule
    doc = json.loads((tmp_path / "pilot" / "pilot.json").read_text())
    assert doc["stop_after"] == 3 and doc["rows"] == rows
    md = (tmp_path / "pilot" / "pilot.md").read_text()
    assert md.count("| sw-linear ") == 2 and "| 0.002 " in md and "| 0.01 " in md
    assert any("sw-linear seed 0 lr 0.01: the first 3 of 6 steps" in line for line in lines)


def test_a_second_call_reads_the_runs_already_done_and_resumes_one_cut_off(tmp_path, monkeypatch):
    """lr 2e-3 done (read, not trained); lr 1e-2 stopped with its checkpoint at step 2 (as SIGTERM leaves
    it): resumed to step 3."""
    p = plan(tiny(steps=6), "s", tmp_path / "exp", models=["sw-linear"], progress=False)
    lr_pilot(p, [2e-3], 3, out=tmp_path / "pilot", log=lambda line: None)
    cut = p.runs[0].train
    train(dataclasses.replace(cut, lr=1e-2, out=str(tmp_path / "pilot" / "sw-linear-s0-lr0.01")), stop_after=2)
    calls = []
    real = pilot_mod.train
    monkeypatch.setattr(pilot_mod, "train", lambda cfg, **kw: calls.append((cfg.lr, kw)) or real(cfg, **kw))
    lines = []
    rows = lr_pilot(p, [2e-3, 1e-2], 3, out=tmp_path / "pilot", log=lines.append)
    assert calls == [(1e-2, {"resume": True, "stop_after": 3})]
    assert "sw-linear seed 0 lr 0.002: already done" in lines[0]
    assert [r["steps"] for r in rows] == [3, 3]


def test_a_run_directory_of_another_config_is_trained_again(tmp_path, monkeypatch):
    """A pilot run directory whose metrics reach the step but whose config is another's (here the plan's
    steps, so its schedules, changed) is not taken as done."""
    lr_pilot(plan(tiny(steps=6), "s", tmp_path / "exp", models=["sw-linear"], progress=False), [2e-3], 3,
             out=tmp_path / "pilot", log=lambda line: None)
    calls = []
    monkeypatch.setattr(pilot_mod, "train", lambda cfg, **kw: calls.append((cfg.steps, cfg.lr)))
    longer = plan(tiny(steps=8), "s", tmp_path / "exp8", models=["sw-linear"], progress=False)
    lr_pilot(longer, [2e-3], 3, out=tmp_path / "pilot", log=lambda line: None)
    assert calls == [(8, 2e-3)]


def test_summary_columns_learned_step_and_speed():
    """The row of made-up metrics: accuracy at the last logged step at or before each quarter, the
    first step at or above 0.5, tokens/s the median without the first (compiling) row."""
    rows = [{"step": s, "accuracy": a, "loss": 5.0 - s / 4, "tokens_per_s": t, "elapsed_s": 10.0 + s}
            for s, a, t in [(2, 0.0, 10.0), (4, 0.1, 100.0), (6, 0.6, 300.0), (8, 0.9, 200.0)]]
    run = plan(tiny(steps=8), "s", "unused", models=["sw-ovq"], progress=False).runs[0]
    row = summarize(run, 3e-3, rows, 9)
    assert row["accuracy"] == {"2": 0.0, "4": 0.1, "7": 0.6, "9": 0.9}  # 0.25/0.5/0.75/1 of 9, rounded
    assert row["learned_at"] == 6 and row["loss"] == 3.0 and row["tokens_per_s"] == 200.0
    assert (row["first_row_s"], row["seconds"], row["steps"]) == (12.0, 18.0, 8)
    text = table([row])
    assert "acc >= 0.5 at" in text and "| sw-ovq  |      0 | 0.003 |" in text
    # each column in its format: accuracy and loss to 3 decimals, tokens/s and seconds whole, None as "-"
    assert re.search(r"\| 0\.003 \| +0\.000 \| +0\.100 \| +0\.600 \| +0\.900 \| +6 \| +3\.000 \| +200 \| +12 \| +18 "
                     r"\| - +\|", text), text
    never = summarize(run, 1e-4, [{**r, "accuracy": 0.0} for r in rows], 9)
    assert summarize(run, 1e-4, [{**r, "accuracy": 0.5} for r in rows], 9)["learned_at"] == 2  # 0.5 counts
    assert never["learned_at"] is None and "| -  " in table([never])


def test_a_diverging_lr_is_a_row_not_a_failure(tmp_path, monkeypatch):
    """Every pilot run's loss is NaN from step 2 (``OVQFLEX_FAULT_NAN_FROM_STEP``): each lr's run stops
    there without a checkpoint of it, its row says so and the pilot goes on; a second call reads the
    divergence as done, trains nothing."""
    monkeypatch.setenv(FAULT_NAN_ENV, "2")
    p = plan(tiny(steps=6), "s", tmp_path / "exp", models=["sw-linear"], progress=False)
    lines = []
    rows = lr_pilot(p, [2e-3, 1e-2], 3, out=tmp_path / "pilot", log=lines.append)
    assert [(r["lr"], r["steps"], r["diverged_at"]) for r in rows] == [(2e-3, 1, 2), (1e-2, 1, 2)]
    assert sum("training diverged: the training loss is nan after step 2" in line for line in lines) == 2
    md = (tmp_path / "pilot" / "pilot.md").read_text()
    head, _, *body = md.splitlines()
    assert head.split("|")[-2].strip() == "diverged at" and [line.split("|")[-2].strip() for line in body] == ["2", "2"]
    calls = []
    monkeypatch.setattr(pilot_mod, "train", lambda cfg, **kw: calls.append(cfg.lr))
    assert lr_pilot(p, [2e-3, 1e-2], 3, out=tmp_path / "pilot", log=lambda line: None) == rows and calls == []


@pytest.mark.parametrize("lrs, stop_after, match", [
    ([], 3, r"lrs must be one or more numbers > 0, got \[\]"),
    ([1e-3, 0.0], 3, r"lrs must be one or more numbers > 0, got \[0.001, 0.0\]"),
    ([1e-3, 0.001], 3, r"lrs must be distinct, got \[0.001, 0.001\]"),
    ([True], 3, r"lrs must be one or more numbers > 0, got \[True\]"),
    ([1e-3], 0, "stop_after must be >= 1, got 0"),
    ([1e-3], 7, r"stop_after must be at most the run's steps \(6\), got 7"),
], ids=["no-lr", "zero-lr", "twice", "bool-lr", "no-steps", "past-the-run"])
def test_bad_arguments_are_refused_by_name_before_training(tmp_path, lrs, stop_after, match):
    p = plan(tiny(steps=6), "s", tmp_path / "exp", models=["sw-linear"], progress=False)
    with pytest.raises(ValueError, match=match):
        lr_pilot(p, lrs, stop_after, out=tmp_path / "pilot")
    assert not (tmp_path / "pilot").exists()


def test_cli_refuses_a_pilot_past_the_scales_steps():
    done = subprocess.run([sys.executable, "-m", "ovqflex", "pilot", "icr", "--scale", "smoke", "--models", "sw-ovq",
                           "--lrs", "1e-3", "--stop-after", "21"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "ovqflex pilot: error: stop_after must be at most the run's steps (20), got 21" in done.stderr
