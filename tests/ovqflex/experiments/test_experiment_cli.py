"""``ovqflex experiment``: the plan (--dry-run), the listing in -h, and refusals by name."""
from pathlib import Path

import pytest

from ovqflex.cli import build_parser, main


def test_dry_run_prints_the_plan(tmp_path, capsys):
    out = tmp_path / "x"
    assert main(["experiment", "icr", "--dry-run", "--out", str(out), "--seeds", "0,1"]) == 0
    text = capsys.readouterr().out
    assert "experiment icr, scale cpu" in text and "units: 10 train + 16 eval = 26" in text
    assert "sw-ovq, sw-ovq N×2, sw-ovq N×4" in text and "sw-nope, sw-nope logn_len=64" in text and "budget:" in text
    assert "[26/26] eval sw-kvm seed 1" in text and not out.exists()
    assert main(["experiment", "icl", "--scale", "gpu", "--dry-run", "--models", "sw-nope", "--seeds", "2"]) == 0
    text = capsys.readouterr().out
    assert "train at 2048 tokens; evaluate at 2048, 4096, 8192, 16384, 32768" in text
    assert "[1/2] train sw-nope seed 2" in text and "runs/experiments/icl-gpu/sw-nope-s2" in text
    assert main(["experiment", "icr", "--scale", "gpu", "--dry-run", "--steps", "2000"]) == 0
    assert "per run: 2,000 steps x 4 x 2048 (first 128, 512 tokens over 1,200 steps)" in capsys.readouterr().out


def test_help_lists_the_experiments(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["experiment", "-h"])
    text = " ".join(capsys.readouterr().out.split())
    assert "icr: basic in-context recall" in text and "icl: long in-context linear regression" in text


@pytest.mark.parametrize("argv, match", [
    (["experiment", "nope"], "unknown experiment 'nope'; known experiments: icl, icr"),
    (["experiment", "icr", "--scale", "tpu", "--dry-run"], "no scale 'tpu'; its scales: cpu, gpu, smoke"),
    (["experiment", "icr", "--models", "sw-ovq,sw-foo", "--dry-run"], "no model 'sw-foo'; its models: sw-ovq"),
    (["experiment", "icr", "--steps", "0", "--dry-run"], "steps must be an int >= 1, got 0"),
], ids=["name", "scale", "model", "steps"])
def test_refusals_name_the_known_values(argv, match, capsys):
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_resume_with_nothing_to_resume(tmp_path, capsys):
    argv = ["experiment", "icr", "--scale", "smoke", "--models", "sw-ovq", "--out", str(tmp_path / "x"), "--resume"]
    assert main(argv) == 2
    assert "holds no experiment to resume" in capsys.readouterr().err


@pytest.mark.parametrize("seeds", ["0,-1", "0,1,0"], ids=["negative", "repeated"])
def test_bad_seed_list_is_refused(capsys, seeds):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["experiment", "icr", "--seeds", seeds])
    assert f"argument --seeds: expected distinct comma-separated integers >= 0 like 0,1, got '{seeds}'" \
        in capsys.readouterr().err


def test_jobs_below_one_is_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "x"
    assert main(["experiment", "icr", "--scale", "smoke", "--out", str(out), "--jobs", "0"]) == 2
    assert "jobs must be >= 1, got 0" in capsys.readouterr().err
    assert not out.exists()


def test_the_experiment_and_pilot_flags_reach_their_functions(tmp_path, monkeypatch, capsys):
    """What ``ovqflex experiment`` and ``ovqflex pilot`` hand on (``run_experiment`` and ``lr_pilot`` stubbed: no
    training): the plan of --scale, --models, --seeds and --out (default: runs/experiments/NAME-SCALE, with
    ``-pilot`` for a pilot), progress off with --no-progress, and --resume, --jobs, --drop-checkpoints, --lrs,
    --stop-after, --keep-checkpoints; a pilot's seeds default to the experiment's first."""
    import ovqflex.experiments as experiments
    from ovqflex.experiments import pilot

    calls = []

    def run_experiment(p, **kw):
        calls.append((p, kw))
        return {"experiment": "icr", "scale": p.scale_name, "task_description": "d", "train_seq_len": 64,
                "train_steps": 2, "train_batch_size": 2, "table": "TABLE", "files": ["f"]}

    monkeypatch.setattr(experiments, "run_experiment", run_experiment)
    monkeypatch.setattr(pilot, "lr_pilot", lambda p, lrs, stop_after, **kw: calls.append((p, lrs, stop_after, kw)))
    monkeypatch.chdir(tmp_path)
    common = ["icr", "--scale", "smoke", "--models", "sw-ovq"]
    assert main(["experiment", *common, "--seeds", "1", "--out", "x", "--no-progress", "--resume", "--jobs", "2",
                 "--drop-checkpoints"]) == 0
    assert main(["experiment", *common]) == 0
    assert main(["pilot", *common, "--lrs", "1e-3,2e-3", "--stop-after", "3", "--keep-checkpoints"]) == 0
    assert main(["pilot", *common, "--seeds", "1", "--lrs", "1e-3", "--stop-after", "3", "--out", "p"]) == 0
    (flagged, kw), (plain, plain_kw), (piloted, lrs, stop_after, pilot_kw), (seeded, _, _, seeded_kw) = calls
    assert (flagged.out, [(r.model.label, r.seed, r.train.progress) for r in flagged.runs]) == \
        (Path("x"), [("sw-ovq", 1, False)])
    assert {k: kw[k] for k in ("resume", "jobs", "drop_checkpoints")} == \
        dict(resume=True, jobs=2, drop_checkpoints=True)
    assert plain.out == Path("runs/experiments/icr-smoke") and [r.seed for r in plain.runs] == [0, 1]
    assert plain.runs[0].train.progress
    assert {k: plain_kw[k] for k in ("resume", "jobs", "drop_checkpoints")} == \
        dict(resume=False, jobs=1, drop_checkpoints=False)
    assert [r.seed for r in piloted.runs] == [0] and (lrs, stop_after) == ((1e-3, 2e-3), 3)
    assert pilot_kw["out"] == "runs/experiments/icr-smoke-pilot" and pilot_kw["keep_checkpoints"]
    assert [r.seed for r in seeded.runs] == [1] and seeded_kw["out"] == "p" and not seeded_kw["keep_checkpoints"]
    assert "TABLE" in capsys.readouterr().out
