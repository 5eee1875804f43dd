"""tools/gpu_check.sh: what it checks before it runs anything (its parts need a GPU), and (slow) its
experiment part's slices on the CPU, carried from one to the next as packs."""
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from ovqflex.training.trainer import FAULT_SIGNAL_ENV

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.sh"


def test_an_unknown_part_is_refused_by_name_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), "tier,decode-singel", str(out)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "unknown part 'decode-singel' in PARTS" in done.stderr
    assert "decode-single" in done.stderr  # the valid parts are listed
    assert not out.exists()  # refused before the first part (tier) ran or any log was written


def _extract(pieces: list[Path], into: Path) -> list[str]:
    """The names in the pack cut into ``pieces``, extracted into ``into``."""
    blob = b"".join(p.read_bytes() for p in pieces)
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        # the "data" filter (Python >= 3.10.12 / 3.11.4) where it exists: later Pythons warn without one
        tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        return tar.getnames()


@pytest.mark.parametrize("case", ["no-pack", "dir-taken"])
def test_a_pack_to_unpack_is_checked_before_anything_runs(tmp_path, case):
    """``EXP_FROM`` must hold a pack, and ``EXP_DIR`` must not hold an experiment already (the pack
    would be mixed into it): each refused by name before the first part ran."""
    (tmp_path / "from").mkdir()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "experiment.json").write_text("{}")
    if case == "dir-taken":
        (tmp_path / "from" / "experiment.tgz.00").write_bytes(b"")
    env = {**os.environ, "EXP_FROM": str(tmp_path / "from"),
           "EXP_DIR": str(taken if case == "dir-taken" else tmp_path / "new")}
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), "tier,experiment", str(out)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 2
    expected = ("holds no experiment.tgz.NN pieces" if case == "no-pack"
                else f"EXP_DIR={taken} already holds an experiment")
    assert expected in done.stderr, done.stderr
    assert not out.exists()


@pytest.mark.slow
def test_experiment_slices_carry_a_run_cut_off_in_training_to_the_next_slice(tmp_path):
    """The experiment part on the CPU (``DEVICE=cpu``, the smoke scale: 20 steps, checkpoints every 10,
    one model). Slice 1 is stopped by SIGTERM after step 12: it packs the run's newest checkpoint alone
    (step 12, not step 10) with the rest of its directory. Slice 2 unpacks that pack into a new folder (a
    fresh machine), continues the run from step 12, evaluates it and packs the directory without
    checkpoints (dropped once the run was done). Slice 3, from slice 2's pack, finds every unit complete."""
    env = {**os.environ, "DEVICE": "cpu", "EXP_SCALE": "smoke", "EXP_MODELS": "sw-linear", "EXP_SEEDS": "0",
           "EXP_DIR": str(tmp_path / "first"), "PART_S": "900", "EXP_PIECE_MB": "1"}

    def slice_(n: int, **extra) -> tuple[str, list[Path]]:
        out = tmp_path / f"out{n}"
        done = subprocess.run(["bash", str(SCRIPT), "experiment", str(out)], capture_output=True, text=True,
                              timeout=1200, env={**env, **extra})
        assert done.returncode == 0, done.stderr
        return done.stdout, sorted(out.glob("experiment.tgz.*"))

    stdout, pieces = slice_(1, **{FAULT_SIGNAL_ENV: "12"})
    assert "experiment icr: exit 143" in stdout, stdout  # 128 + SIGTERM: stopped with a checkpoint
    assert "checkpoints kept: sw-linear-s0/checkpoints/step_00000012" in stdout, stdout
    assert len(pieces) > 1  # a checkpoint of the tiny model is over 1 MiB: cut into pieces
    names = _extract(pieces, tmp_path / "peek1")
    assert any(n.startswith("./sw-linear-s0/checkpoints/step_00000012/") for n in names)
    assert not any("step_00000010" in n for n in names)
    assert "./experiment.json" in names and "./results.json" not in names

    stdout, pieces = slice_(2, EXP_FROM=str(tmp_path / "out1"), EXP_DIR=str(tmp_path / "second"))
    assert "experiment icr (resumed): exit 0" in stdout, stdout
    log = (tmp_path / "out2" / "experiment.log").read_text()
    assert f"unpacked {len(list((tmp_path / 'out1').glob('experiment.tgz.*')))} piece(s)" in log, log
    assert "resuming from step 12" in log, log
    names = _extract(pieces, tmp_path / "peek2")
    assert "./sw-linear-s0/eval-base.json" in names and "./results.json" in names
    assert not any("checkpoints/" in n for n in names)

    stdout, _ = slice_(3, EXP_FROM=str(tmp_path / "out2"), EXP_DIR=str(tmp_path / "third"))
    assert "experiment icr (resumed): exit 0" in stdout, stdout
    assert "(2 already complete)" in (tmp_path / "out3" / "experiment.log").read_text()


@pytest.mark.slow
def test_the_pilot_part_trains_the_first_steps_at_each_lr_and_copies_its_table(tmp_path):
    """The pilot part on the CPU (the smoke scale, one model, two lrs, 2 of its 20 steps): OUT gets the
    log, pilot.md with a row per lr and pilot.json."""
    env = {**os.environ, "DEVICE": "cpu", "EXP_SCALE": "smoke", "PILOT_MODELS": "sw-linear", "PILOT_LRS": "1e-3,4e-3",
           "PILOT_STEPS": "2", "PILOT_DIR": str(tmp_path / "pilot"), "PART_S": "600"}
    done = subprocess.run(["bash", str(SCRIPT), "pilot", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=900, env=env)
    assert done.returncode == 0, done.stderr
    assert "pilot icr: exit 0" in done.stdout, done.stdout
    rows = json.loads((tmp_path / "out" / "pilot.json").read_text())["rows"]
    assert [(r["model"], r["lr"], r["steps"]) for r in rows] == [("sw-linear", 1e-3, 2), ("sw-linear", 4e-3, 2)]
    assert (tmp_path / "out" / "pilot.md").read_text().count("| sw-linear ") == 2


@pytest.mark.slow
def test_bench_parts_of_one_call_each_keep_their_json(tmp_path):
    """Two parts of profiles/gpu.toml in one call on the CPU (``DEVICE=cpu``, one short length through
    ``BENCH_SEQ_LENS``): each part's JSON lands in its own folder, with that part's scenarios at that
    length; one shared folder kept only the last part's (both write ``gpu.json``)."""
    env = {**os.environ, "DEVICE": "cpu", "BENCH_SEQ_LENS": "256", "PART_S": "600"}
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), "routing,op-vq", str(out)], capture_output=True, text=True,
                          timeout=900, env=env)
    assert done.returncode == 0, done.stderr
    assert "gpu --only routing: exit 0" in done.stdout and "gpu --only op-vq: exit 0" in done.stdout, done.stdout
    for part, scenarios in [("routing", {"routing-ovq", "routing-kvm-sqrt16"}), ("op-vq", {"op-vq"})]:
        result = json.loads((out / "bench" / part / "gpu.json").read_text())
        assert {r["scenario"] for r in result["rows"]} == scenarios
        assert {r["T"] for r in result["rows"]} == {256} and result["meta"]["seq_lens"] == [256]
    assert "== gpu --only op-vq --seq-lens 256" in (out / "bench.log").read_text()
