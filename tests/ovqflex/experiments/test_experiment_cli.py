"""``ovqflex experiment``: the plan (--dry-run), the listing in -h, and refusals by name."""
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
