"""tools/gpu_check.sh: what it checks before it runs anything (its parts need a GPU), and (slow) its
experiment part's slices on the CPU."""
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "gpu_check.sh"


def test_an_unknown_part_is_refused_by_name_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), "tier,decode-singel", str(out)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "unknown part 'decode-singel' in PARTS" in done.stderr
    assert "decode-single" in done.stderr  # the valid parts are listed
    assert not out.exists()  # refused before the first part (tier) ran or any log was written


@pytest.mark.slow
def test_an_experiment_slice_packs_its_directory_and_the_next_slice_resumes_it(tmp_path):
    """The experiment part on the CPU (``DEVICE=cpu``, the smoke scale, one model): the slice trains and
    evaluates, packs its directory without checkpoints into OUT/experiment.tgz, and a next slice run
    from that directory unpacked elsewhere (a fresh machine) finds every unit complete."""
    env = {**os.environ, "DEVICE": "cpu", "EXP_SCALE": "smoke", "EXP_MODELS": "sw-linear", "EXP_SEEDS": "0",
           "EXP_DIR": str(tmp_path / "first"), "PART_S": "900"}
    done = subprocess.run(["bash", str(SCRIPT), "experiment", str(tmp_path / "out1")], capture_output=True,
                          text=True, timeout=1200, env=env)
    assert done.returncode == 0, done.stderr
    assert "experiment icr: exit 0" in done.stdout, done.stdout
    with tarfile.open(tmp_path / "out1" / "experiment.tgz") as tar:
        names = tar.getnames()
        # the "data" filter (Python >= 3.10.12 / 3.11.4) where it exists: later Pythons warn without one
        tar.extractall(tmp_path / "second", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    assert "./sw-linear-s0/eval-base.json" in names and "./results.json" in names
    assert not any("checkpoints" in n for n in names)
    env["EXP_DIR"] = str(tmp_path / "second")
    done = subprocess.run(["bash", str(SCRIPT), "experiment", str(tmp_path / "out2")], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    assert "experiment icr (resumed): exit 0" in done.stdout, done.stdout
    log = (tmp_path / "out2" / "experiment.log").read_text()
    assert "(2 already complete)" in log, log
